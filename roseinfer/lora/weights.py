"""An adapter made ready to run: per layer, one low-rank set per fused linear.

roseinfer fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, so an
adapter's modules are fused the same way: ``A`` stacks the adapted modules' A rows
``[R = sum r, in]``, and each adapted module is one part: its rank rows ``[r0, r1)`` of A
feed its output columns ``[n0, n1)`` through ``Bt [r, out]`` (its B transposed, times its
scaling).  No zero blocks, no rank padding.  The delta of a row is ``(x A^T) B^T`` in
fp32, added to the base linear's output.  Everything lives in one float32 buffer laid
out by a plan (one row per part, csrc/lora.h); with the C++ kernels the buffer is filled
by one ``lora_fill`` call and served by ``torch.classes.roseinfer.LoraAdapter``
(batch-invariant, per segment in the stack), else by torch copies and matmuls.
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


PLAN_COLS = 11  # layer, linear, a_offset, R, K, N, r0, r1, n0, n1, bt_offset
LINEAR_INDEX = {name: i for i, name in enumerate(FUSED)}  # the stack's order (csrc/lora.h)


@dataclass(slots=True)
class LowRank:
    """The delta ``(x A^T) B^T`` of one fused linear for the PyTorch path: ``a`` [R, K]
    and ``parts`` (r0, r1, n0, n1, Bt [r1 - r0, n1 - n0]), views of the buffer."""

    a: Tensor
    parts: list[tuple[int, int, int, int, Tensor]]

    def add_delta(self, x: Tensor, y: Tensor) -> None:
        """y [m, N] += the delta of x [m, K] (float32)."""
        t = x @ self.a.T  # [m, R]
        for r0, r1, n0, n1, bt in self.parts:
            y[:, n0:n1] += t[:, r0:r1] @ bt  # [m, r] @ [r, n]


@dataclass
class LoadedAdapter:
    """A resident adapter: ``buffer`` laid out by ``plan`` (int64 [P, 11]); ``kernel``:
    the C++ ``LoraAdapter`` over it (None without kernels); ``layers[i][fused name]`` ->
    its LowRank (absent: no delta) for the PyTorch path, built on first use."""

    lora_int_id: int
    name: str
    buffer: Tensor  # float32 [n]: every A and Bt is a view of it
    plan: list[list[int]]
    num_layers: int
    kernel: object | None = None
    _layers: list[dict[str, LowRank]] | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * 4

    @property
    def layers(self) -> list[dict[str, LowRank]]:
        if self._layers is None:
            self._layers = _low_ranks(self.buffer, self.plan, self.num_layers)
        return self._layers


def _low_ranks(buffer: Tensor, plan: list[list[int]], num_layers: int
               ) -> list[dict[str, LowRank]]:
    """Per layer, the LowRank views of ``buffer`` that ``plan`` describes."""
    layers: list[dict[str, LowRank]] = [{} for _ in range(num_layers)]
    fused_names = list(FUSED)
    for layer, which, a_off, r_total, k, _, r0, r1, n0, n1, bt_off in plan:
        low_rank = layers[layer].get(fused_names[which])
        if low_rank is None:
            a = buffer[a_off:a_off + r_total * k].view(r_total, k)  # [R, K]
            low_rank = layers[layer][fused_names[which]] = LowRank(a, [])
        bt = buffer[bt_off:bt_off + (r1 - r0) * (n1 - n0)].view(r1 - r0, n1 - n0)  # [r, n]
        low_rank.parts.append((r0, r1, n0, n1, bt))
    return layers


def _plan(tensors: dict[tuple[int, str], tuple[Tensor, Tensor, float]], config: ModelConfig
          ) -> tuple[list[list[int]], list[tuple[int, str]], int]:
    """(plan rows, the (layer, module) of each row, buffer floats): per fused linear its
    A then each part's Bt."""
    shapes = module_shapes(config)
    rows: list[list[int]] = []
    keys: list[tuple[int, str]] = []
    offset = 0
    for layer in range(config.num_layers):
        for fused, members in FUSED.items():
            ranks = {m: tensors[(layer, m)][0].shape[0] for m in members if (layer, m) in tensors}
            if not ranks:
                continue
            total_r, k = sum(ranks.values()), shapes[members[0]][1]
            n_total = sum(shapes[m][0] for m in members)
            a_off, offset = offset, offset + total_r * k
            r0 = n0 = 0
            for m in members:
                out_f = shapes[m][0]
                if m in ranks:
                    r = ranks[m]
                    rows.append([layer, LINEAR_INDEX[fused], a_off, total_r, k, n_total,
                                 r0, r0 + r, n0, n0 + out_f, offset])
                    keys.append((layer, m))
                    offset += r * out_f
                    r0 += r
                n0 += out_f
    return rows, keys, offset


def build_adapter(lora_int_id: int, name: str, spec: AdapterSpec, config: ModelConfig,
                  use_kernels: bool, reuse: Tensor | None = None,
                  device: torch.device | None = None) -> LoadedAdapter:
    """Read the checked adapter's tensors and lay them out per layer (see module
    docstring) on ``device`` (the model's; the CPU by default).  ``reuse``: an evicted
    adapter's buffer, overwritten when it is large enough (no fresh pages to fault in);
    nothing may use that adapter any more."""
    tensors = read_tensors(spec, config)
    shapes = module_shapes(config)
    for (layer, m), (ma, mb, _) in tensors.items():
        out_f, in_f = shapes[m]
        r = ma.shape[0]
        if tuple(ma.shape) != (r, in_f) or tuple(mb.shape) != (out_f, r):
            raise ValueError(f"LoRA adapter {spec.path!r}: layer {layer} {m} "
                             "changed since the adapter was checked")
    rows, keys, total = _plan(tensors, config)
    # Every float of the buffer is written below (A rows and Bt parts tile it).
    buffer = (reuse[:total] if reuse is not None and reuse.numel() >= total
              else torch.empty(total, device=device))
    plan = torch.tensor(rows, dtype=torch.int64).view(-1, PLAN_COLS)  # [P, 11]
    srcs = [tensors[key] for key in keys]
    if use_kernels:  # one C++ call: copies, transposes and scales every part
        torch.ops.roseinfer.lora_fill(buffer, [a for a, _, _ in srcs], [b for _, b, _ in srcs],
                                      [s for _, _, s in srcs], plan)
        kernel = torch.classes.roseinfer.LoraAdapter(buffer, plan, config.num_layers)
        return LoadedAdapter(lora_int_id, name, buffer, rows, config.num_layers, kernel)
    for (_, _, a_off, _, k, _, r0, r1, n0, n1, bt_off), (ma, mb, scaling) in zip(
            rows, srcs, strict=True):
        buffer[a_off + r0 * k:a_off + r1 * k].view(r1 - r0, k).copy_(ma)
        bt = buffer[bt_off:bt_off + (r1 - r0) * (n1 - n0)].view(r1 - r0, n1 - n0)
        bt.copy_(mb.T).mul_(scaling)  # in float32, as lora_fill: bitwise the same
    return LoadedAdapter(lora_int_id, name, buffer, rows, config.num_layers)
