"""Decoder self-attention over the paged KV cache, shared by the rotary model families.

One module covers Llama, Mistral, Qwen2/3, Phi-3 and Gemma 1/2/3; the per-family
differences are constructor options:

* ``qkv_bias`` / ``o_bias``: biases (Qwen2: q/k/v only; Llama ``attention_bias``: all);
* ``qk_norm``: a per-head norm on q and k before rotary (Qwen3: RMSNorm; Gemma 3: its
  ``1 + weight`` RMSNorm), named ``q_norm`` / ``k_norm`` as in the checkpoints;
* ``scale``: ``head_dim ** -0.5``, or ``query_pre_attn_scalar ** -0.5`` (Gemma 2/3);
* ``softcap``: attention-logit soft-capping (Gemma 2), PyTorch path only;
* ``sliding``: whether this layer honours the step's sliding window.

q/k/v are one fused ``qkv_proj`` (the loaders fuse checkpoint q/k/v; Phi-3 ships it
fused).  Shape letters as in ``layers``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from roseinfer.model import layers
from roseinfer.model.attention_metadata import AttentionMetadata
from roseinfer.model.config import ModelConfig
from roseinfer.model.rope import RopeInputs, apply_rotary
from roseinfer.model.sliding_window import WindowView


class Attention(nn.Module):
    """Fused-QKV GQA attention with rotary embedding and paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        qkv_bias: bool,
        o_bias: bool,
        scale: float,
        qk_norm: Callable[[int, float], nn.Module] | None = None,
        softcap: float | None = None,
        sliding: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = scale
        self.softcap = softcap
        self.sliding = sliding
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, config.norm_eps)
            self.k_norm = qk_norm(self.head_dim, config.norm_eps)

    def forward(
        self,
        x: Tensor,
        rope: RopeInputs,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        window: WindowView | None = None,
    ) -> Tensor:  # x [T, hidden] -> [T, hidden]
        out = self.attend(self.qkv_proj(x), rope, kv_cache, meta, window)  # [T, q_size]
        return self.o_proj(out)  # [T, hidden]

    def attend(
        self,
        qkv: Tensor,
        rope: RopeInputs,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        window: WindowView | None = None,
    ) -> Tensor:  # qkv [T, q_size + 2 * kv_size] -> [T, q_size], before o_proj
        """Everything between the q/k/v and output projections (LoRA adds its deltas
        to both around this: ``roseinfer.lora.forward``)."""
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.q_size)  # per head
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.kv_size)
            qkv = torch.cat([q, k, v], dim=-1)  # [T, q_size + 2 * kv_size]
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
        # Looked up on the module at call time, so a profiler's wrapper applies.
        out = layers.paged_attention(
            q, k, v, kv_cache, meta, self.scale, kv_written=rope.fused,
            window=window if self.sliding else None, softcap=self.softcap,
        )  # [T, H, Dh]
        return out.reshape(-1, self.q_size)  # [T, q_size]
