"""A step whose rows run different adapters (and the base model) in one forward.

``LoRABatch`` travels in ``AttentionMetadata.lora`` (set by the runner when any row
of the step has an adapter); ``LlamaForCausalLM.forward`` then hands the step to
``LoRABatch.forward``, which runs the decoder layers one by one: each base linear
(the same kernel ``Linear`` the C++ ``LlamaStack`` runs, or the module itself where
the stack does not serve the model) on every row, then, per adapter segment (rows
``[start, end)`` of one adapter; the runner lays rows out grouped by adapter), the
fp32 low-rank delta added in place.  Base rows get no delta.  With the kernels every
other op is the stack's own row kernel (``rms_norm``, ``rope_and_cache_``,
``paged_attention``, ``silu_mul``) and the residual adds are the same single float
adds, so a base row is bitwise what the stack computes and an adapter row depends only
on its own input and adapter: batch invariance holds across base-only and mixed steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from roseinfer.lora.weights import LoadedAdapter
from roseinfer.model.attention_metadata import AttentionMetadata
from roseinfer.model.fast_path import kernel_linear
from roseinfer.model.layers import row_kernels_usable
from roseinfer.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from roseinfer.model.rope import rope_inputs
from roseinfer.model.sliding_window import sliding_window_view

LINEARS = ("qkv", "o", "gate_up", "down")


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
    """The adapters of one step: ``segments`` = (start, end, adapter) row ranges."""

    base: BaseLinears
    segments: list[tuple[int, int, LoadedAdapter]]

    def linear(self, layer: int, name: str, x: Tensor) -> Tensor:
        """Base linear ``name`` of ``layer`` on all rows plus each segment's delta."""
        x = x.float().contiguous()  # no-ops on the float32 path
        y = _run(self.base.layer(layer, x)[name], x)  # [T, N]
        self.add_deltas(layer, name, x, y)
        return y

    def add_deltas(self, layer: int, name: str, x: Tensor, y: Tensor) -> None:
        """The segments' deltas on one thread: each is too small to pay for a parallel
        region's fork and join (the kernels' arithmetic does not depend on threads)."""
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(1)
        try:
            for start, end, adapter in self.segments:
                low_rank = adapter.layers[layer].get(name)
                if low_rank is not None:  # in place on rows [start, end): [m, N] float32
                    y[start:end].add_(low_rank.delta(x[start:end]))
        finally:
            if threads > 1:
                torch.set_num_threads(threads)

    def forward(self, model: LlamaForCausalLM, h: Tensor, positions: Tensor,
                kv_caches: list[Tensor], meta: AttentionMetadata) -> Tensor:
        """Embedded h [T, hidden] -> final-norm hidden [T, hidden], layer by layer."""
        linears = self.base.layers(h)
        if self.base.on_stack and meta.token_seq is not None:
            return self._forward_stack_ops(model, h, positions, kv_caches, meta, linears)
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

    def _forward_stack_ops(self, model: LlamaForCausalLM, h: Tensor, positions: Tensor,
                           kv_caches: list[Tensor], meta: AttentionMetadata,
                           linears: list[dict[str, object]]) -> Tensor:
        """The LlamaStack's step op for op (csrc/stack.cpp: the same row kernels, the
        same scale, residual adds then norms) with the deltas added after each linear."""
        cfg, inner = model.config, model.model
        ops = torch.ops.roseinfer
        h_heads, kv_heads, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, t = h_heads * dh, h.shape[0]
        scale = float(torch.tensor(1.0) / torch.sqrt(torch.tensor(float(dh))))  # as the stack's
        cos_sin, eps = inner.rotary_emb.cos_sin_cache, float(inner.norm.eps)
        layers = inner.layers
        x = ops.rms_norm(h, layers[0].input_layernorm.weight, eps)  # [T, hidden]
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            lin = linears[i]
            qkv = lin["qkv"].forward(x)  # [T, q + 2 kv]
            self.add_deltas(i, "qkv", x, qkv)
            ops.rope_and_cache_(qkv, positions, cos_sin, kv_cache, meta.slot_mapping,
                                h_heads, kv_heads)
            attn = ops.paged_attention(qkv[:, :q_size].view(t, h_heads, dh), kv_cache,
                                       meta.block_tables, meta.token_seq,
                                       meta.token_context_lens, meta.block_size, scale)
            attn = attn.view(t, q_size)
            o = lin["o"].forward(attn)  # [T, hidden]
            self.add_deltas(i, "o", attn, o)
            h = h + o
            x = ops.rms_norm(h, layer.post_attention_layernorm.weight, eps)
            gate_up = lin["gate_up"].forward(x)  # [T, 2I]
            self.add_deltas(i, "gate_up", x, gate_up)
            act = ops.silu_mul(gate_up)  # [T, I]
            down = lin["down"].forward(act)  # [T, hidden]
            self.add_deltas(i, "down", act, down)
            h = h + down
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else inner.norm
            x = ops.rms_norm(h, norm.weight, eps)
        return x
