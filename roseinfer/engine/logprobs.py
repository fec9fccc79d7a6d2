"""LogprobBuilder: per-token ``Logprob`` entries for sampled tokens and prompt tokens.

Sampled tokens get their entry from the sampler's raw logprob and top-N (once per
token). Prompt logprobs are recorded by ONE sequence of a request (the first of n),
position by position: entry p (for prompt token p) comes from the logits at position
p - 1, and an entry is only ever appended for the next missing position, so a prompt
recomputed after preemption, or computed in chunks of any size, yields each entry
exactly once and in order.
"""

from __future__ import annotations

import torch

from roseinfer.engine.request import Request
from roseinfer.outputs import Logprob
from roseinfer.tokenizer import Tokenizer

PromptLogprobs = list[dict[int, Logprob] | None]


class LogprobBuilder:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def piece(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def sampled_entry(self, token_id: int, logprob: float,
                      top: list[tuple[int, float]]) -> dict[int, Logprob]:
        """The sampled token's Logprob plus the top-N alternatives, keyed by token id."""
        rank_of = {tid: r + 1 for r, (tid, _) in enumerate(top)}
        entry = {token_id: Logprob(logprob, rank_of.get(token_id), self.piece(token_id))}
        for r, (tid, v) in enumerate(top):
            entry.setdefault(tid, Logprob(v, r + 1, self.piece(tid)))
        return entry

    def record_prompt(self, req: Request, chunk_logits: torch.Tensor,
                      entries: PromptLogprobs) -> None:
        """Append the entries that ``chunk_logits`` [n, V] (logits of positions
        ``req.num_computed_tokens ..``, before the step's update) give and that are
        still missing from ``entries``; keeps ``req.num_prompt_logprobs`` in step."""
        start = req.num_computed_tokens
        first = len(entries)  # next missing prompt position
        end = min(start + chunk_logits.shape[0], req.num_prompt_tokens - 1)  # last position
        if first < start + 1 or first > end:
            return  # nothing new here (or a gap: never happens with the cache cap)
        rows = chunk_logits[first - 1 - start:end - start]  # logits of positions first-1..end-1
        targets = req.all_token_ids[first:end + 1]
        lp = torch.log_softmax(rows.float(), dim=-1)  # [m, V]
        tgt = torch.tensor(targets, device=lp.device)[:, None]  # [m, 1]
        chosen_t = lp.gather(1, tgt)  # [m, 1]
        chosen = chosen_t[:, 0].tolist()
        ranks = (lp > chosen_t).sum(-1).add(1).tolist()
        n = req.params.prompt_logprobs or 0
        top_v, top_i = lp.topk(n, dim=-1) if n else (None, None)
        for j, tok in enumerate(targets):
            entry = {tok: Logprob(chosen[j], ranks[j], self.piece(tok))}
            if n:
                for r, (tid, v) in enumerate(zip(top_i[j].tolist(), top_v[j].tolist(),
                                                 strict=True)):
                    entry.setdefault(tid, Logprob(v, r + 1, self.piece(tid)))
            entries.append(entry)
        req.num_prompt_logprobs = len(entries)
