"""Verification of speculative drafts: which drafted tokens a step accepts.

A chunk with drafts t_1..t_d has d + 1 logits rows: row j is the target model's
distribution for the token after the sequence extended by t_1..t_j. Each row is
sampled like any other (``Sampler``, with every filter of its request: temperature,
top-k/p, min-p, penalties over its own output-so-far, logit_bias, masks), giving
y_0..y_d. The chunk emits y_0..y_a, where a is the first j with y_j != t_{j+1}
(a = d when every draft matched): accepted drafts are exactly the y's equal to them,
and the last emitted token is the correction (or the bonus token after all d).

Why this is rejection sampling: the n-gram draft is deterministic, a point mass q = 1
on t. Speculative sampling (Leviathan et al., Chen et al.) accepts t with probability
min(1, p(t) / q(t)) = p(t) and otherwise samples from norm(max(0, p - q)) = p with t
removed, renormalised. Sampling y ~ p and accepting iff y == t gives the same thing:
P(accept) = p(t), and given a rejection y is distributed as p(y) / (1 - p(t)) over
y != t. So the emitted tokens are distributed exactly as non-speculative sampling.
Greedy rows (argmax) accept exactly the drafts plain greedy decoding would produce.

Seeded rows: row j draws the j-th uniform from the request's generator, the one
non-speculative sampling would draw for that token; after the step the generator is
rewound to have drawn one uniform per *emitted* token (``get_state`` / ``set_state``).
With batch-invariant logits a seeded request then yields the same tokens with and
without speculation, whatever is drafted or accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from roseinfer.runner.sampler import Sampler, SamplerOutput, SamplingBatch


@dataclass(slots=True)
class VerifyOutput:
    sampled: SamplerOutput  # per row: y_j, its logprobs, validity
    num_emitted: list[int]  # per chunk: rows whose token is emitted (0: its first row failed)


class RejectionSampler:
    """Samples every row of a step and verifies each chunk's drafts against them.

    ``logits`` [R, V] and ``batch`` (R rows) hold, chunk after chunk, its 1 + d rows;
    ``drafts[c]`` are the d drafted tokens of chunk c (empty: an ordinary row). Every
    row of a chunk shares the request's generator.
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: Tensor, batch: SamplingBatch,
                 drafts: Sequence[Sequence[int]]) -> VerifyOutput:
        starts = _chunk_starts(drafts)
        if starts[-1] != batch.batch_size:
            raise ValueError(f"{batch.batch_size} rows for chunks of {starts[-1]} rows")
        seeded = set(batch.seeded_rows)
        saved: dict[int, Tensor] = {}  # chunk -> its generator's state before the step
        for c, chunk_drafts in enumerate(drafts):
            gen = batch.generators[starts[c]]
            if chunk_drafts and gen is not None and starts[c] in seeded:
                saved[c] = gen.get_state()
        out = self.sampler(logits, batch)
        tokens = out.token_ids.tolist()
        valid = out.valid.tolist() if out.valid is not None else [True] * len(tokens)
        emitted: list[int] = []
        for c, chunk_drafts in enumerate(drafts):
            lo, hi = starts[c], starts[c + 1]
            n = accepted_rows(tokens[lo:hi], valid[lo:hi], chunk_drafts)
            emitted.append(n)
            if c in saved and n < hi - lo:  # rows past the emitted ones drew for nothing
                _rewind(batch.generators[lo], saved[c], max(n, 1))
        return VerifyOutput(out, emitted)


def accepted_rows(tokens: Sequence[int], valid: Sequence[bool], drafts: Sequence[int]
                  ) -> int:
    """How many of a chunk's rows emit their token: up to and including the first
    row whose token differs from the draft it verifies (or the last row), stopping
    before a row that could not be sampled."""
    for j, (token, ok) in enumerate(zip(tokens, valid, strict=True)):
        if not ok:
            return j
        if j == len(drafts) or token != drafts[j]:
            return j + 1
    return len(tokens)


def _chunk_starts(drafts: Sequence[Sequence[int]]) -> list[int]:
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    return starts


def _rewind(gen: torch.Generator, state: Tensor, num_draws: int) -> None:
    """Put ``gen`` where it was after ``num_draws`` single uniforms from ``state``: the
    draws of the emitted rows (one each, as ``uniform_draws`` makes them)."""
    gen.set_state(state)
    scratch = torch.empty(1, dtype=torch.float64, device=gen.device)
    for _ in range(num_draws):
        scratch.uniform_(generator=gen)
