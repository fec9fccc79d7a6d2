"""A GGUF file's weights used as stored by the C++ kernels (``csrc/gguf_gemm.h``).

``make_gguf_linear(parts, bias)`` builds a ``torch.classes.roseinfer.Linear`` straight
from the stored bytes of one or more tensors (fused q/k/v or gate/up parts may mix
types, e.g. Q4_K and Q6_K in a Q4_K_M file): no fp32 copy, no requantization.  Each
quantized weight is repacked once into 16-column panels of the same size as its stored
bytes (that panel copy is the only one; the caller then drops the raw tensors), and the
values the kernel multiplies are exactly ``gguf.quants.dequantize`` of those bytes.
Activations are quantized per row and 32 values to int16 (int8 for Q4_1 and Q4_0 parts
of an ``act8`` layer), every 32-block dot is an exact integer, scaled and summed in fp32 in
block order: batch-invariant (docs/CONTRACTS.md, "Weight formats and CPU kernels").
F16 / BF16 parts keep 16-bit panels and fp32 math (one FMA chain per output).

``gguf_rows(raw, qtype, ids)`` dequantizes rows of a stored tensor (embeddings) from its
raw (e.g. mmapped) bytes, bitwise as the gguf package does.  A tied LM head is
``make_gguf_linear([(qtype, raw_embedding)], None)``: it repacks, so it costs one more
copy of the embedding's stored size while ``gguf_rows`` keeps reading the raw bytes.
The kernels must be loaded (``cpu_kernels_available()``).
"""

from __future__ import annotations

import torch
from torch import Tensor

# GGMLQuantizationType value -> (values per block, bytes per block), as ggml stores them.
_BLOCKS: dict[int, tuple[int, int]] = {
    1: (1, 2),  # F16
    30: (1, 2),  # BF16
    8: (32, 34),  # Q8_0
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}
_NAMES = {1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1",
          12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def gguf_kernel_types() -> frozenset[int]:
    """The GGMLQuantizationType values ``make_gguf_linear`` and ``gguf_rows`` take."""
    return frozenset(_BLOCKS)


def gguf_row_values(qtype: int, row_bytes: int) -> int:
    """Values per row of a stored row of ``row_bytes`` bytes; ValueError when ``qtype`` is
    not supported or the bytes are not whole blocks (K-quants: 256 values per block, so a
    K that is not a multiple of 256 cannot be stored as one)."""
    if int(qtype) not in _BLOCKS:
        raise ValueError(f"GGUF type {int(qtype)} has no CPU kernel; supported: "
                         f"{sorted(_NAMES[t] for t in _BLOCKS)}")
    values, size = _BLOCKS[int(qtype)]
    if row_bytes <= 0 or row_bytes % size:
        raise ValueError(f"a {_NAMES[int(qtype)]} row holds whole blocks of {values} values "
                         f"({size} bytes each); {row_bytes} bytes per row is not a multiple "
                         f"of {size}")
    return row_bytes // size * values


def _check_raw(raw: Tensor, qtype: int) -> Tensor:
    if not isinstance(raw, Tensor) or raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError("a GGUF part must be a uint8 tensor [rows, row_bytes]")
    if raw.device.type != "cpu":
        raise ValueError("GGUF parts must be CPU tensors")
    gguf_row_values(qtype, int(raw.shape[1]))
    return raw if raw.stride(1) == 1 else raw.contiguous()


def make_gguf_linear(parts: list[tuple[int, Tensor]], bias: Tensor | None, act8: bool = False,
                     extra_copy: bool = False) -> object:
    """A ``torch.classes.roseinfer.Linear`` over stored GGUF tensors.

    ``parts``: (GGMLQuantizationType value, raw uint8 [rows, row_bytes] exactly as in the
    file); their rows are stacked as output columns in order, every part with the same
    number K of values per row (in_features).  The raw tensors are read, never written,
    and may be dropped afterwards.  ``act8``: Q4_1 and Q4_0 parts take int8 activations
    (``model/quantize.py`` ``act8_layer``, ``csrc/q4_act8.h``); other types ignore it.
    ``extra_copy``: with ``act8``, Q4_1 and Q4_0 parts also keep an int8 copy of their values
    (1.6x their size) for steps of more than 4 rows (faster there; the same results).  ValueError for an unsupported type,
    a row size that is not whole blocks, parts of different K, or a bias of the wrong size.
    """
    if not parts:
        raise ValueError("make_gguf_linear needs at least one part")
    types, raws, ks = [], [], set()
    for qtype, raw in parts:
        raw = _check_raw(raw, int(qtype))
        types.append(int(qtype))
        raws.append(raw)
        ks.add(gguf_row_values(int(qtype), int(raw.shape[1])))
    if len(ks) != 1:
        raise ValueError(f"GGUF parts of one layer must have the same in_features; got {sorted(ks)}")
    k = ks.pop()
    n = sum(int(r.shape[0]) for r in raws)
    b = None if bias is None else bias.detach().float().contiguous()
    if b is not None and b.shape != (n,):
        raise ValueError(f"bias of shape {tuple(b.shape)} for {n} output columns")
    from roseinfer.kernels import _pack

    linear = torch.classes.roseinfer.Linear(torch.empty(0, k), b, False)
    _pack(torch.empty(n, k, device="meta"),
          lambda: linear.set_gguf_weight(types, raws, act8, extra_copy))
    return linear


def gguf_rows(raw: Tensor, qtype: int, ids: Tensor) -> Tensor:
    """fp32 [T, K]: rows ``ids`` [T] of a stored [V, row_bytes] tensor, dequantized bitwise
    as ``gguf.quants.dequantize`` (read straight from ``raw``, e.g. an mmap view)."""
    raw = _check_raw(raw, int(qtype))
    ids = ids.reshape(-1)
    values = ids.tolist()  # one tensor op, not min + max (each cache-cold in a decode step)
    if values and (min(values) < 0 or max(values) >= raw.shape[0]):
        raise ValueError(f"row ids out of range [0, {raw.shape[0]})")
    return torch.ops.roseinfer.gguf_rows(raw, int(qtype), ids)
