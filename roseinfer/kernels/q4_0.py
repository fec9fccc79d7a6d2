"""Quantize float weights to GGUF Q4_0 blocks at load (quantization ``"q4_0"``).

Q4_0 stores 32 weights as an fp16 scale ``d`` and 32 4-bit values ``q`` (18 bytes,
0.5625 bytes per weight), ``w ~ d * (q - 8)``.  ``quantize_q4_0`` writes the bytes that
llama.cpp's reference quantizer (``quantize_row_q4_0_ref``) and the ``gguf`` package
(``gguf.quants.quantize``) write for the same fp32 values, bit for bit: per block the
value of largest magnitude (the first, on ties) is ``max``, ``d = max / -8`` in fp32,
``q = min(15, trunc(w * (1 / d) + 8.5))`` (q = 8 for every weight when d == 0), and
``d`` is stored rounded to fp16; byte j holds q[j] in its low and q[j + 16] in its high
nibble.  The result runs the GGUF kernels as a Q4_0 tensor of a file would
(``kernels.gguf.make_gguf_linear``).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32
Q4_0_TYPE = 2  # GGMLQuantizationType.Q4_0
Q4_0_BLOCK_BYTES = 18
CHUNK_VALUES = 16 << 20  # weights quantized at a time: ~64 MB fp32 temporaries each


def quantize_q4_0(weight: Tensor) -> Tensor:
    """uint8 [N, K / 32 * 18]: the Q4_0 blocks of a float [N, K] weight (K % 32 == 0)."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"Q4_0 needs a 2-D weight with rows of whole 32-blocks, got "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    out = torch.empty(n, k // BLOCK * Q4_0_BLOCK_BYTES, dtype=torch.uint8)
    step = max(1, CHUNK_VALUES // k)  # rows at a time: bounded fp32 temporaries
    for r in range(0, n, step):
        blocks = weight[r:r + step].detach().float().reshape(-1, k // BLOCK, BLOCK)
        first_max = blocks.abs().argmax(dim=-1, keepdim=True)  # the first of equal magnitudes
        d = blocks.gather(-1, first_max) / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(blocks * inv + 8.5).clamp_(0, 15).to(torch.uint8)
        packed = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
        scale = d.to(torch.float16).view(torch.uint8)  # [rows, k / 32, 2], little-endian fp16
        out[r:r + step] = torch.cat([scale, packed], dim=-1).reshape(-1, out.shape[1])
    return out
