"""An adapter made ready to run: per layer, one low-rank pair per fused linear.

roseinfer fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, so an
adapter's modules are fused the same way: ``A`` stacks the adapted modules' A rows
``[sum r, in]`` and ``B`` is block-structured ``[out, sum r]`` (each module's B, times
its scaling, in its output rows and its own rank columns; zeros elsewhere, which add
exact zeros).  The delta of a row is ``(x A^T) B^T``, in fp32, added to the base
linear's output; with the C++ kernels both products run the fp32 kernel ``Linear``
(one arithmetic for every row count: batch-invariant), else plain matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from roseinfer.lora.adapter import AdapterSpec, module_shapes, read_adapter
from roseinfer.model.config import ModelConfig

# roseinfer's fused linear -> the HF modules in it, in output-row order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",),
}


class LowRank:
    """The delta ``(x A^T) B^T`` of one fused linear (scaling folded into B)."""

    def __init__(self, a: Tensor, b: Tensor, use_kernels: bool) -> None:
        self.a = a.contiguous()  # [R, K]
        self.b = b.contiguous()  # [N, R]
        self._ka: object | None = None
        self._kb: object | None = None
        if use_kernels:
            from roseinfer.kernels import make_linear

            self._ka = make_linear(self.a, None, fp16=False)
            self._kb = make_linear(self.b, None, fp16=False)

    def delta(self, x: Tensor) -> Tensor:  # [m, K] -> [m, N] float32
        x = x.float()
        if self._ka is not None and self._kb is not None:
            return self._kb.forward(self._ka.forward(x.contiguous()))  # type: ignore[attr-defined]
        return (x @ self.a.T) @ self.b.T  # [m, R] -> [m, N]


@dataclass
class LoadedAdapter:
    """A resident adapter: ``layers[i][fused name]`` -> its LowRank (absent: no delta)."""

    lora_int_id: int
    name: str
    layers: list[dict[str, LowRank]]
    nbytes: int


def build_adapter(lora_int_id: int, name: str, spec: AdapterSpec, config: ModelConfig,
                  use_kernels: bool) -> LoadedAdapter:
    """Read the checked adapter's tensors and fuse them per layer (see module docstring)."""
    tensors = read_adapter(spec)
    shapes = module_shapes(config)
    layers: list[dict[str, LowRank]] = [{} for _ in range(config.num_layers)]
    nbytes = 0
    for layer in range(config.num_layers):
        for fused, members in FUSED.items():
            present = [m for m in members if (layer, m) in tensors]
            if not present:
                continue
            total_rank = sum(tensors[(layer, m)][0].shape[0] for m in present)
            out_total = sum(shapes[m][0] for m in members)
            in_f = shapes[members[0]][1]
            a = torch.empty(total_rank, in_f)  # [R, K]
            b = torch.zeros(out_total, total_rank)  # [N, R]
            row = col = 0
            for m in members:
                out_f = shapes[m][0]
                if (layer, m) in tensors:
                    ma, mb, scaling = tensors[(layer, m)]
                    r = ma.shape[0]
                    a[col:col + r] = ma
                    b[row:row + out_f, col:col + r] = mb * scaling
                    col += r
                row += out_f
            layers[layer][fused] = LowRank(a, b, use_kernels)
            nbytes += (a.numel() + b.numel()) * 4
    return LoadedAdapter(lora_int_id, name, layers, nbytes)
