"""A step whose rows run different adapters (and the base model) in one forward.

``LoRABatch`` travels in ``AttentionMetadata.lora`` (set by the runner when any row
of the step has an adapter); ``LlamaForCausalLM.forward`` then hands the step to
``LoRABatch.forward``.  Segments are rows ``[start, end)`` of one adapter (the runner
lays rows out grouped by adapter); base rows get no delta.

With the C++ kernels (``step``: a ``torch.classes.roseinfer.LoraStep``) a model the
``LlamaStack`` serves runs the whole step in ``LlamaStack.forward_lora``: the stack's
own step with every segment's fp32 delta ``(x A^T) B^T`` added after each linear
(csrc/lora.h).  A base row is bitwise what ``forward`` computes and an adapter row
depends only on its own values and adapter: batch invariance holds across base-only and
mixed steps.  Otherwise the decoder layers run one by one in PyTorch (the modules, each
followed by the segments' deltas: the kernel ``LoraStep.apply`` when loaded, else
matmuls), for other devices and dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from roseinfer.lora.weights import LINEAR_INDEX, LoadedAdapter
from roseinfer.model.attention_metadata import AttentionMetadata
from roseinfer.model.fast_path import kernel_linear
from roseinfer.model.layers import row_kernels_usable
from roseinfer.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from roseinfer.model.rope import rope_inputs
from roseinfer.model.sliding_window import sliding_window_view


def lora_unsupported_reason(model: nn.Module) -> str | None:
    """Why LoRA cannot run on ``model`` (None: it can)."""
    if not isinstance(model, LlamaForCausalLM) or model.layer_cls is not LlamaDecoderLayer:
        return f"{type(model).__name__} is not a Llama-family model with Llama decoder layers"
    if getattr(model, "tensor_parallel", None) is not None:
        return "tensor parallelism"
    return None


class BaseLinears:
    """The base model's linears as the LoRA path calls them: per layer, the kernel
    ``Linear`` the stack uses (when the model runs on the stack) or the module."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._layers: list[dict[str, object]] | None = None
        self.on_stack = False  # the C++ LlamaStack serves this model (set on first use)

    def layer(self, i: int, sample: Tensor) -> dict[str, object]:
        return self.layers(sample)[i]

    def layers(self, sample: Tensor) -> list[dict[str, object]]:
        if self._layers is None:
            self._layers = self._build(sample)
        return self._layers

    def _build(self, sample: Tensor) -> list[dict[str, object]]:
        kernels = self.model._decode_stack(sample) is not None  # the stack serves this model
        self.on_stack = kernels
        out: list[dict[str, object]] = []
        for layer in self.model.model.layers:
            mods = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
                    "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
            out.append({k: _kernel_or_module(m, kernels) for k, m in mods.items()})
        return out

    def reset(self) -> None:
        """Forget the linears (after the model's modules are swapped)."""
        self._layers = None


def _kernel_or_module(module: nn.Module, kernels: bool) -> object:
    kernel = kernel_linear(module) if kernels else None
    return kernel if kernel is not None else module


def _run(linear: object, x: Tensor) -> Tensor:
    if isinstance(linear, nn.Module):
        return linear(x)
    return linear.forward(x.contiguous())  # type: ignore[attr-defined]


@dataclass(slots=True)
class LoRABatch:
    """The adapters of one step: ``segments`` = (start, end, adapter) row ranges and,
    with the C++ kernels, the same as a ``LoraStep`` (``step``)."""

    base: BaseLinears
    segments: list[tuple[int, int, LoadedAdapter]]
    step: object | None = None

    def linear(self, layer: int, name: str, x: Tensor) -> Tensor:
        """Base linear ``name`` of ``layer`` on all rows plus each segment's delta."""
        x = x.float().contiguous()  # no-ops on the float32 path
        y = _run(self.base.layer(layer, x)[name], x)  # [T, N]
        self.add_deltas(layer, name, x, y)
        return y

    def add_deltas(self, layer: int, name: str, x: Tensor, y: Tensor) -> None:
        """y [T, N] += each segment's delta of linear ``name``, in place."""
        if self.step is not None and y.dtype == torch.float32 and y.is_contiguous():
            self.step.apply(layer, LINEAR_INDEX[name], x, y)  # type: ignore[attr-defined]
            return
        for start, end, adapter in self.segments:
            low_rank = adapter.layers[layer].get(name)
            if low_rank is not None:  # rows [start, end): [m, N]
                low_rank.add_delta(x[start:end], y[start:end])

    def forward(self, model: LlamaForCausalLM, h: Tensor, positions: Tensor,
                kv_caches: list[Tensor], meta: AttentionMetadata) -> Tensor:
        """Embedded h [T, hidden] -> final-norm hidden [T, hidden]."""
        self.base.layers(h)  # builds the base linears (and learns whether the stack serves)
        if self.base.on_stack and self.step is not None and meta.token_seq is not None:
            stack = model._decode_stack(h)
            return stack.forward_lora(  # type: ignore[union-attr]
                h, positions, model.model.rotary_emb.cos_sin_cache, kv_caches,
                meta.block_tables, meta.token_seq, meta.token_context_lens, meta.slot_mapping,
                meta.block_size, self.step)
        cfg = model.config
        inner = model.model
        rope = rope_inputs(inner.rotary_emb, positions, h)
        local = inner.rotary_emb_local
        local_rope = rope if local is None else rope_inputs(local, positions, h)
        window = sliding_window_view(meta, cfg.sliding_window)
        for i, (layer, kv_cache) in enumerate(zip(inner.layers, kv_caches, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            r = local_rope if cfg.uses_local_rope(i) else rope
            qkv = self.linear(i, "qkv", layer.input_layernorm(h))  # [T, q + 2 kv]
            out = attn.attend(qkv, r, kv_cache, meta, window)  # [T, q]
            h = h + self.linear(i, "o", out)
            gate_up = self.linear(i, "gate_up", layer.post_attention_layernorm(h))  # [T, 2I]
            if mlp.is_silu and row_kernels_usable(gate_up):
                act = torch.ops.roseinfer.silu_mul(gate_up)  # [T, I]
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = mlp.act(gate) * up
            h = h + self.linear(i, "down", act)
        return inner.norm(h)
