"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, SmolLM) over a paged KV cache.

One implementation covers the family; the differences are config-driven:

* Qwen2: ``attention_bias`` (bias on q/k/v, never on o_proj).
* Llama with ``attention_bias``: bias on q/k/v and o_proj (as transformers does).
* Mistral: plain Llama.  Its sliding window is ignored: attention is full causal, which
  is exact while contexts stay within the window (4096 for Mistral-7B v0.1, and
  v0.2+ have no window).  Qwen2's optional sliding window is ignored likewise.
* SmolLM: Llama with tied embeddings.

Hugging Face names are mirrored (``model.layers.N.self_attn...``) except that q/k/v
are fused into ``qkv_proj`` and gate/up into ``gate_up_proj``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from roseinfer.model.attention_metadata import AttentionMetadata
from roseinfer.model.config import ModelConfig
from roseinfer.model.layers import (
    RMSNorm,
    RopeInputs,
    RotaryEmbedding,
    WeightLoadTracker,
    apply_rotary,
    get_activation,
    paged_attention,
    rope_inputs,
    row_kernels_usable,
)


class LlamaAttention(nn.Module):
    """Fused-QKV GQA attention with rotary embedding and paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        o_bias = config.attention_bias and not config.architecture.lower().startswith("qwen2")
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)

    def forward(
        self, x: Tensor, rope: RopeInputs, kv_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:  # x [T, hidden] -> [T, hidden]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        if rope.fused:  # rotary in place + K/V into the cache, one C++ pass
            qkv = qkv.contiguous()
            torch.ops.roseinfer.rope_and_cache_(
                qkv, rope.positions, rope.cos_sin_cache, kv_cache, meta.slot_mapping,
                self.num_heads, self.num_kv_heads,
            )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, Dh]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        if not rope.fused:
            assert rope.cos is not None and rope.sin is not None
            q = apply_rotary(q, rope.cos, rope.sin)
            k = apply_rotary(k, rope.cos, rope.sin)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, kv_written=rope.fused)
        return self.o_proj(out.reshape(-1, self.q_size))  # [T, hidden]


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

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, h: Tensor, rope: RopeInputs, kv_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:  # [T, hidden] -> [T, hidden]
        h = h + self.self_attn(self.input_layernorm(h), rope, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder stack, final norm; holds the shared rotary cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / SmolLM causal LM over a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied embeddings: no lm_head parameter; compute_logits reads embed_tokens.
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._stack: object | None = None
        self._stack_state = "unbuilt"
        self._head_kernel: object | None = None

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:
        """input_ids/positions [T] -> final-norm hidden states [T, hidden]."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"expected {len(self.model.layers)} KV caches, got {len(kv_caches)}"
            )
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        stack = self._decode_stack(h)
        if stack is not None and meta.token_seq is not None:
            # Every layer in one C++ call (roseinfer.kernels), for decode and prefill rows
            # alike: one arithmetic per row whatever the batch (docs/CONTRACTS.md).
            return stack.forward(
                h, positions, self.model.rotary_emb.cos_sin_cache, kv_caches,
                meta.block_tables, meta.token_seq, meta.token_context_lens, meta.slot_mapping,
                meta.block_size,
            )
        rope = rope_inputs(self.model.rotary_emb, positions, h)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, rope, kv_cache, meta)
        return self.model.norm(h)

    def _decode_stack(self, h: Tensor) -> object | None:
        """The C++ decode stack over this model's weights, built on first use; None if
        the kernels are unavailable or do not cover this model (see ``fast_path``)."""
        if self._stack_state == "unbuilt":
            from roseinfer.model.fast_path import build_head_kernel, build_llama_decode_stack

            self._stack = build_llama_decode_stack(self, h)
            self._head_kernel = None if self._stack is None else build_head_kernel(self)
            self._stack_state = "built"
        return self._stack

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        head = self._head_kernel if self._stack_state == "built" else None
        if head is not None and hidden.dtype == torch.float32:
            return head.forward(hidden)  # the C++ fp32 kernel, one arithmetic for every M
        if self.lm_head is not None:
            return self.lm_head(hidden).float()  # [N, vocab]
        return F.linear(hidden, self.model.embed_tokens.weight).float()  # [N, vocab]

    def tied_embedding(self) -> Tensor:
        """The embedding matrix [vocab, hidden] a tied LM head reads."""
        return self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up."""
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
        tracker = WeightLoadTracker(self, shards)
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
    """Mistral: Llama architecture (sliding window ignored, see module docstring)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama architecture with q/k/v bias (``config.attention_bias``)."""
