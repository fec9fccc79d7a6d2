"""The int8 KV cache (``kv_cache_dtype="int8"``): its layout and arithmetic, in PyTorch.

A cache of this kind is one int8 tensor per layer, ``[2 (K, V), slots, Hkv, Dh + 4]``:
each (slot, KV head) row holds the head's ``Dh`` values as int8 followed by their
scale, a float32 stored as its 4 bytes (native byte order).  Scales live inside the
row, so everything that moves or copies slots (prefix-cache sharing, the disk cache,
tensor-parallel shards) carries them without knowing about them.

Arithmetic (docs/CONTRACTS.md; the C++ kernels compute the same bits on CPU): for one
row ``x[0..Dh)`` in float32,

* ``scale = absmax(x) / 127`` (float32 division; 0 when the row is all zeros);
* ``q[i] = round_half_even(x[i] / scale)`` (IEEE division, then clamped to
  [-127, 127]; 0 when scale == 0);
* the value read back is ``q[i] * scale``.

Attention over such a cache quantizes each query head's row by the same rule, so that
a score is an integer dot product times both scales: ``s_t = (float(sum_i qq[i] *
kq_t[i]) * (qscale * kscale_t)) * softmax_scale`` in the C++ kernels (exact integers);
here (``quantize_queries``) the dequantized query times the dequantized K, the same
values up to float32 rounding.  The weights of V stay float: ``out = sum_t (p_t *
vscale_t) * vq_t``.

A row's bytes depend only on that token's own K or V, never on the other tokens of the
batch, its chunk or its block: the batch-invariance contract survives quantization.
Every op here runs on any device (no CPU-only kernels), so CUDA works as CPU does.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_BYTES = 4  # one float32 scale per (slot, KV head) row
QMAX = 127


def is_int8(kv_cache: Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one (slot, KV head) row of a cache of this dtype."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def head_dim_of(kv_cache: Tensor) -> int:
    """The model's head dim behind a cache tensor [2, slots, Hkv, row]."""
    width = kv_cache.shape[-1]
    return width - SCALE_BYTES if is_int8(kv_cache) else width


def quantize_rows(x: Tensor) -> Tensor:
    """x [..., Dh] (any float dtype) -> packed int8 rows [..., Dh + 4] (module docstring)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / QMAX  # [..., 1]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows: q = 0
    q = torch.round(xf / safe).clamp_(-QMAX, QMAX).to(torch.int8)  # [..., Dh], half to even
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)  # [..., Dh + 4]


def scales_of(packed: Tensor) -> Tensor:
    """The float32 scales [..., 1] of packed rows [..., Dh + 4]."""
    return packed[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize_rows(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Packed int8 rows [..., Dh + 4] -> values q * scale [..., Dh] in ``dtype``."""
    q = packed[..., :-SCALE_BYTES].float()  # [..., Dh]
    return (q * scales_of(packed)).to(dtype)


def read_rows(cache_half: Tensor, index: Tensor, dtype: torch.dtype) -> Tensor:
    """cache_half [slots, Hkv, row] rows at index (any shape) as ``dtype`` [..., Hkv, Dh]."""
    rows = cache_half[index]
    return dequantize_rows(rows, dtype) if is_int8(cache_half) else rows.to(dtype)


def quantize_queries(q: Tensor) -> Tensor:
    """Queries [..., Dh] as attention over an int8 cache sees them: each head's row
    quantized like a K/V row and read back (``q * scale``) in q's dtype."""
    return dequantize_rows(quantize_rows(q), q.dtype)


def to_cache_rows(x: Tensor, kv_dtype: torch.dtype) -> Tensor:
    """New K or V rows [T, Hkv, Dh] as a cache of ``kv_dtype`` stores them."""
    return quantize_rows(x) if kv_dtype == torch.int8 else x.to(kv_dtype)
