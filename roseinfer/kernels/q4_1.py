"""Recover a GGUF's Q4_1 blocks from their dequantized fp32 weights, exactly.

The GGUF loader hands every tensor to the model as float32: a Q4_1 block of 32 weights
becomes ``w = fp32(fp32(d * q) + m)`` with ``d``, ``m`` fp16 and ``q`` in [0, 15] (the
``gguf`` package's dequantizer).  ``recover_q4_1(w)`` finds ``(q, d, m)`` back — ``m``
is the block's minimum (the quantizer gives the minimum q = 0), ``d`` the fp16 value
that maps the maximum to q = 15 — and returns them only if they reproduce every weight
bit for bit; otherwise None (the weight was not Q4_1, or a fused tensor mixes formats).
The C++ kernel then computes with the GGUF's own weights: no requantization error and
0.625 bytes per weight (``csrc/q8_gemm.h``).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32


def recover_q4_1(weight: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(q int8 [N, K] in [0, 15], d fp32 [N, K/32], m fp32 [N, K/32]) or None."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK or weight.dtype != torch.float32:
        return None
    n, k = weight.shape
    w = weight.detach().reshape(n, k // BLOCK, BLOCK)
    m = w.amin(-1)
    if not torch.equal(m, m.half().float()):
        return None
    d = ((w.amax(-1) - m) / 15).half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((w - m[..., None]) / safe[..., None]).clamp_(0, 15)
    q = torch.where(d[..., None] > 0, q, torch.zeros_like(q))
    if not torch.equal(d[..., None] * q + m[..., None], w):
        return None
    return q.to(torch.int8).reshape(n, k), d.contiguous(), m.contiguous()
