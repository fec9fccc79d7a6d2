"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Phi-3, SmolLM) over a
paged KV cache, and the base the Gemma models (``gemma``) specialise.

One implementation covers the family; the differences are config-driven:

* Qwen2: ``attention_bias`` (bias on q/k/v, never on o_proj).
* Llama with ``attention_bias``: bias on q/k/v and o_proj (as transformers does).
* Llama 3.x: ``llama3`` / ``linear`` rope scaling lives in the cos/sin table only;
  Llama 3.2 1B/3B tie the embeddings.
* Mistral, Phi-3, Qwen2/3 with ``use_sliding_window``: the sliding window is honoured
  (``sliding_window``; ``ModelConfig.is_sliding_layer``), see ``sliding_window``.
* Qwen3 (``qwen3``): per-head RMSNorm on q and k before rotary (``config.qk_norm``).
* Phi-3 / Phi-4-mini (``phi3``): fused checkpoint tensors, ``longrope``, partial rotary.
* SmolLM: Llama with tied embeddings.

Hugging Face names are mirrored (``model.layers.N.self_attn...``) except that q/k/v
are fused into ``qkv_proj`` and gate/up into ``gate_up_proj``.  A plain Llama-shaped
float32 CPU model runs every decoder layer in the C++ stack (``fast_path`` says when);
everything else runs the layers below, with the C++ row ops where they apply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from roseinfer.model.attention import Attention
from roseinfer.model.attention_metadata import AttentionMetadata
from roseinfer.model.config import ModelConfig
from roseinfer.model.layers import (
    RMSNorm,
    WeightLoadTracker,
    get_activation,
    row_kernels_usable,
)
from roseinfer.model.rope import RopeInputs, RotaryEmbedding, rope_inputs
from roseinfer.model.sliding_window import WindowView, sliding_window_view


class LlamaAttention(Attention):
    """Fused-QKV GQA attention with rotary embedding and paged KV cache."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        o_bias = config.attention_bias and not config.architecture.lower().startswith("qwen2")
        super().__init__(
            config, qkv_bias=config.attention_bias, o_bias=o_bias,
            scale=config.head_dim**-0.5, qk_norm=RMSNorm if config.qk_norm else None,
            sliding=config.is_sliding_layer(layer),
        )


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)) with gate/up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = get_activation(config.hidden_act)
        self.is_silu = config.hidden_act in ("silu", "swish")

    def forward(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.is_silu and row_kernels_usable(gate_up):
            return self.down_proj(torch.ops.roseinfer.silu_mul(gate_up))  # one pass
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, h: Tensor, rope: RopeInputs, kv_cache: Tensor, meta: AttentionMetadata,
        window: WindowView | None = None,
    ) -> Tensor:  # [T, hidden] -> [T, hidden]
        return self.finish(h, self.attention(h, rope, kv_cache, meta, window))

    def attention(
        self, h: Tensor, rope: RopeInputs, kv_cache: Tensor, meta: AttentionMetadata,
        window: WindowView | None = None,
    ) -> Tensor:  # [T, hidden] -> the attention block's output [T, hidden] (K/V written)
        return self.self_attn(self.input_layernorm(h), rope, kv_cache, meta, window)

    def finish(self, h: Tensor, attn: Tensor) -> Tensor:  # residual + MLP, row-local
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder stack, final norm; holds the shared rotary caches (a second one
    for layers with their own rope base: Gemma 3's sliding layers)."""

    def __init__(self, config: ModelConfig, layer_cls: type[nn.Module],
                 norm_cls: type[nn.Module]) -> None:
        super().__init__()
        # Given an (uninitialised) weight, nn.Embedding skips its random init: on the
        # meta device (registry.create_model) that init imports torch._dynamo (~2.5 s).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_layers))
        self.norm = norm_cls(config.hidden_size, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            config.rotary_dim,
        )
        self.rotary_emb_local: RotaryEmbedding | None = None
        if config.rope_local_theta is not None:
            self.rotary_emb_local = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.rope_local_theta,
                None, config.rotary_dim,
            )


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / SmolLM causal LM over a paged KV cache (and the base of
    the other rotary families: they swap the layer and norm classes below)."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm
    supports_decode_stack = True  # layers are exactly what the C++ LlamaStack computes

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.layer_cls, self.norm_cls)
        # Tied embeddings: no lm_head parameter; compute_logits reads embed_tokens.
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._stack: object | None = None
        self._stack_state = "unbuilt"
        self._head_kernel: object | None = None

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids [T] -> [T, hidden] (Gemma scales it)."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:
        """input_ids/positions [T] -> final-norm hidden states [T, hidden] (rows outside
        ``meta.out_rows``, when set, may be zero)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"expected {len(self.model.layers)} KV caches, got {len(kv_caches)}"
            )
        h = self.embed(input_ids)  # [T, hidden]
        if meta.lora is not None:  # rows with LoRA adapters: layer by layer (roseinfer.lora)
            return meta.lora.forward(self, h, positions, kv_caches, meta)
        stack = self._decode_stack(h)
        if stack is not None and meta.token_seq is not None:
            # Every layer in one C++ call (roseinfer.kernels), for decode and prefill rows
            # alike: one arithmetic per row whatever the batch (docs/CONTRACTS.md).
            return stack.forward(
                h, positions, self.model.rotary_emb.cos_sin_cache, kv_caches,
                meta.block_tables, meta.token_seq, meta.token_context_lens, meta.slot_mapping,
                meta.block_size, meta.out_rows,
            )
        cfg = self.config
        rope = rope_inputs(self.model.rotary_emb, positions, h)
        local = self.model.rotary_emb_local
        local_rope = rope if local is None else rope_inputs(local, positions, h)
        window = sliding_window_view(meta, cfg.sliding_window)  # once per step, all layers
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            r = local_rope if cfg.uses_local_rope(i) else rope
            if i == last and meta.out_rows is not None:
                # Only the rows read go past the last attention (K/V written for all):
                # the MLP is row-local, so they get the values of the whole step.
                attn = layer.attention(h, r, kv_cache, meta, window)  # [T, hidden]
                kept = h.new_zeros(h.shape)  # [T, hidden]
                kept[meta.out_rows] = layer.finish(h[meta.out_rows], attn[meta.out_rows])
                h = kept
            else:
                h = layer(h, r, kv_cache, meta, window)
        return self.model.norm(h)

    def _decode_stack(self, h: Tensor) -> object | None:
        """The C++ decode stack over this model's weights, built on first use; None if
        the kernels are unavailable or do not cover this model (see ``fast_path``)."""
        if self._stack_state == "unbuilt":
            from roseinfer.model.fast_path import build_head_kernel, build_llama_decode_stack

            self._stack = build_llama_decode_stack(self, h)
            self._head_kernel = build_head_kernel(self) if h.dtype == torch.float32 else None
            self._stack_state = "built"
        return self._stack

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (soft-capped if configured)."""
        head = self._head_kernel if self._stack_state == "built" else None
        if head is not None and hidden.dtype == torch.float32:
            logits = head.forward(hidden)  # the C++ fp32 kernel, one arithmetic for every M
        elif self.lm_head is not None:
            logits = self.lm_head(hidden).float()  # [N, vocab]
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()  # [N, vocab]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap  # Gemma 2
        return logits

    def compute_greedy(self, hidden: Tensor) -> tuple[list[int], list[bool]] | None:
        """Each row's greedy token of ``compute_logits(hidden)`` and whether its logit is
        finite, without every logit: a GGUF Q8_0 head's ``greedy`` kernel (bitwise the
        argmax of the head's own logits, ``csrc/head_greedy.h``); None where the head
        has none (then ``compute_logits``)."""
        kernel = getattr(self.lm_head, "kernel", None)  # compute_logits' (Fp16Linear's)
        if (hidden.dtype != torch.float32 or self.config.final_logit_softcapping is not None
                or kernel is None or not kernel.has_greedy()):
            return None
        values, ids = kernel.greedy(hidden)
        return ids.tolist(), [math.isfinite(v) for v in values.tolist()]

    def tied_embedding(self) -> Tensor:
        """The embedding matrix [vocab, hidden] a tied LM head reads."""
        return self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, Tensor]],
                     on_module_loaded: Callable[[str], bool] | None = None) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up
        (``on_module_loaded``: ``WeightLoadTracker``'s)."""
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        fused: dict[str, tuple[str, str, tuple[int, int]]] = {
            "q_proj": ("qkv_proj", "q", (0, q)),
            "k_proj": ("qkv_proj", "k", (q, q + kv)),
            "v_proj": ("qkv_proj", "v", (q + kv, q + 2 * kv)),
            "gate_proj": ("gate_up_proj", "gate", (0, inter)),
            "up_proj": ("gate_up_proj", "up", (inter, 2 * inter)),
        }
        shards: dict[str, set[str]] = {}
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                shards[name] = {"q", "k", "v"}
            elif ".gate_up_proj." in name:
                shards[name] = {"gate", "up"}
        tracker = WeightLoadTracker(self, shards, on_module_loaded)
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: transformers also takes the head from embed_tokens
            parts = hf_name.split(".")
            if len(parts) >= 3 and parts[-2] in fused:
                target, shard, rows = fused[parts[-2]]
                name = ".".join(parts[:-2] + [target, parts[-1]])
                tracker.load(name, tensor, shard=shard, rows=rows, source=hf_name)
            else:
                tracker.load(hf_name, tensor)
        tracker.finish()


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama architecture with an optional sliding window (v0.1: 4096)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama architecture with q/k/v bias (``config.attention_bias``)."""
