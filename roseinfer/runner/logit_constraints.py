"""Per-row logit constraints of a sampling batch, as tensors: which ids a row may
sample (structured-output masks AND ``allowed_token_ids``) and the ``logit_bias``
entries to add. Built by ``SamplingBatch.from_requests``; applied by ``Sampler``.
Each row's result depends on that row's parameters only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from roseinfer.sampling_params import SamplingParams


def combined_allowed_mask(params: Sequence[SamplingParams], grammar_mask: Tensor | None,
                 vocab_size: int, device: torch.device) -> Tensor | None:
    """[B, V] bool, True = allowed: the rows' grammar masks (``grammar_mask``, [B, V]
    bool or None) AND each row's allowed_token_ids; None when no row restricts its
    tokens. ``grammar_mask`` is returned as is when no row has allowed_token_ids."""
    b = len(params)
    if grammar_mask is not None and (tuple(grammar_mask.shape) != (b, vocab_size)
                                     or grammar_mask.dtype != torch.bool):
        raise ValueError(f"the allowed mask must be [{b}, {vocab_size}] bool, got "
                         f"{tuple(grammar_mask.shape)} {grammar_mask.dtype}")
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return grammar_mask
    allowed = (grammar_mask.clone() if grammar_mask is not None
               else torch.ones(b, vocab_size, dtype=torch.bool, device=device))
    for i in rows:
        only = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        only[_ids_tensor(params[i].allowed_token_ids, vocab_size, device)] = True
        allowed[i] &= only
    return allowed


def logit_bias_entries(params: Sequence[SamplingParams], vocab_size: int,
                       device: torch.device) -> tuple[Tensor, Tensor, Tensor] | None:
    """(rows, ids, bias) of every row's logit_bias entries; None when no row has any."""
    rows: list[int] = []
    ids: list[int] = []
    bias: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            bias += p.logit_bias.values()
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            _ids_tensor(ids, vocab_size, device),
            torch.tensor(bias, dtype=torch.float32, device=device))


def _ids_tensor(ids: Sequence[int], vocab_size: int, device: torch.device) -> Tensor:
    t = torch.tensor(ids, dtype=torch.int64)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got "
                         f"{int(t.min())}..{int(t.max())}")
    return t.to(device)
