"""A drafter that knows the answer: the ceiling of speculative decoding on a workload.

``OracleDrafter(answers, k).propose`` stands in for an engine's n-gram ``propose``
(``engine.spec.propose``): every decoding request drafts the next ``k`` tokens of its
known output (``answers``: prompt ids -> the output ids of a run without speculation), so
every draft is accepted and every verification row is a token. No drafter can do better
at the same step costs (``benchmarks/spec_decode.py --oracle``).
"""

from __future__ import annotations

from collections.abc import Sequence

from roseinfer.engine.request import Request


class OracleDrafter:
    def __init__(self, answers: dict[tuple[int, ...], list[int]], k: int) -> None:
        self.answers, self.k = answers, k

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``spec_token_ids`` of each running request: the next k tokens of its answer
        when it decodes this step (within ``max_tokens``), else none."""
        for req in running:
            req.spec_token_ids = []
            if req.num_tokens - req.num_computed_tokens != 1:
                continue  # a prefill chunk, not a decode
            n = req.num_output_tokens
            k = min(self.k, req.params.max_tokens - n - 1)
            if k > 0:
                req.spec_token_ids = list(self.answers[tuple(req.prompt_token_ids)][n:n + k])
