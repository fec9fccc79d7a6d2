"""Top-k, top-p and min-p: the filters that mask (to -inf) the tokens a sampled row may
not draw, row by row (the sampler's step 5, after temperature: ``sampler.py``)."""

from __future__ import annotations

import torch
from torch import Tensor


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask (to -inf) everything outside the per-row top-k, then the top-p nucleus.

    logits [B, V]; top_k [B] int64 in [1, V] (V = off); top_p [B] in (0, 1].
    Top-k keeps exactly k tokens even with ties. Top-p (on the top-k-renormalised
    distribution) keeps the smallest prefix of the sorted tokens whose cumulative
    probability reaches top_p; the top token is always kept. Returns a new tensor.
    """
    sorted_x, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V] each
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)  # [V]
        sorted_x = sorted_x.masked_fill(ranks.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_x, dim=-1)  # [B, V]
        cum = probs.cumsum(dim=-1)  # [B, V]
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # mass above
        drop = before >= top_p.unsqueeze(1)
        drop &= (top_p < 1.0).unsqueeze(1)  # rounding must not trim top_p=1 rows
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_x)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens whose prob < min_p * max prob. logits [B, V]; min_p [B]."""
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))
