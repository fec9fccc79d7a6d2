"""An adapter made ready to run: per layer, one low-rank pair per fused linear.

roseinfer fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, so an
adapter's modules are fused the same way: ``A`` stacks the adapted modules' A rows
``[sum r, in]`` and ``B`` is block-structured ``[out, sum r]`` (each module's B, times
its scaling, in its output rows and its own rank columns; zeros elsewhere, which add
exact zeros).  The fused rank is padded with zero rows / columns to a multiple of 8,
so the kernel's AVX2 path (K % 8 == 0) serves every rank.  The delta of a row is
``(x A^T) B^T``, in fp32, added to the base linear's output; with the C++ kernels both
products run the fp32 kernel ``Linear`` (one arithmetic for every row count:
batch-invariant), else plain matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from roseinfer.lora.adapter import AdapterSpec, module_shapes
from roseinfer.lora.sources import read_tensors
from roseinfer.model.config import ModelConfig

# roseinfer's fused linear -> the HF modules in it, in output-row order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",),
}


RANK_ALIGN = 8  # the fp32 kernel's AVX2 path needs K % 8 == 0 (B's K is the rank)


class LowRank:
    """The delta ``(x A^T) B^T`` of one fused linear (scaling folded into B); x is a
    contiguous float32 [m, K]."""

    def __init__(self, a: Tensor, b: Tensor, kernel_cls: object | None) -> None:
        self.a = a  # [R, K] contiguous float32
        self.b = b  # [N, R] contiguous float32
        self.delta = self._torch_delta
        if kernel_cls is not None:  # torch.classes.roseinfer.Linear: the fp32 kernel
            ka, kb = kernel_cls(a, None, False), kernel_cls(b, None, False)  # type: ignore[operator]
            self.delta = lambda x: kb.forward(ka.forward(x))  # [m, K] -> [m, R] -> [m, N]

    def _torch_delta(self, x: Tensor) -> Tensor:  # [m, K] -> [m, N]
        return (x @ self.a.T) @ self.b.T


@dataclass
class LoadedAdapter:
    """A resident adapter: ``layers[i][fused name]`` -> its LowRank (absent: no delta)."""

    lora_int_id: int
    name: str
    layers: list[dict[str, LowRank]]
    buffer: Tensor  # float32 [n]: every A and B of ``layers`` is a view of it

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * 4


def build_adapter(lora_int_id: int, name: str, spec: AdapterSpec, config: ModelConfig,
                  use_kernels: bool, reuse: Tensor | None = None) -> LoadedAdapter:
    """Read the checked adapter's tensors and fuse them per layer (see module docstring).
    ``reuse``: an evicted adapter's buffer, overwritten when it is large enough (no fresh
    pages to fault in); nothing may use that adapter any more."""
    tensors = read_tensors(spec, config)
    kernel_cls = torch.classes.roseinfer.Linear if use_kernels else None  # looked up once
    shapes = module_shapes(config)
    layers: list[dict[str, LowRank]] = [{} for _ in range(config.num_layers)]
    plan = []  # (layer, fused, members, padded rank, N, K)
    for layer in range(config.num_layers):
        for fused, members in FUSED.items():
            ranks = [tensors[(layer, m)][0].shape[0] for m in members if (layer, m) in tensors]
            if ranks:
                padded = -(-sum(ranks) // RANK_ALIGN) * RANK_ALIGN
                plan.append((layer, fused, members, padded,
                             sum(shapes[m][0] for m in members), shapes[members[0]][1]))
    total = sum(r * (n + k) for *_, r, n, k in plan)
    if reuse is not None and reuse.numel() >= total:
        buffer = reuse[:total].zero_()
    else:
        buffer = torch.zeros(total)  # one allocation: every A and B is a view of it
    offset = 0
    for layer, fused, members, padded, out_total, in_f in plan:
        a = buffer[offset:offset + padded * in_f].view(padded, in_f)  # [R, K]
        offset += padded * in_f
        b = buffer[offset:offset + out_total * padded].view(out_total, padded)  # [N, R]
        offset += out_total * padded
        row = col = 0
        for m in members:
            out_f = shapes[m][0]
            if (layer, m) in tensors:
                ma, mb, scaling = tensors[(layer, m)]
                r = ma.shape[0]
                if tuple(ma.shape) != (r, in_f) or tuple(mb.shape) != (out_f, r):
                    raise ValueError(f"LoRA adapter {spec.path!r}: layer {layer} {m} "
                                     "changed since the adapter was checked")
                a[col:col + r].copy_(ma)
                torch.mul(mb, scaling, out=b[row:row + out_f, col:col + r])
                col += r
            row += out_f
        layers[layer][fused] = LowRank(a, b, kernel_cls)
    return LoadedAdapter(lora_int_id, name, layers, buffer)
