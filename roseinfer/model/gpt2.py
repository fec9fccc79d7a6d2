"""GPT-2 over a paged KV cache.

Learned absolute position embeddings, pre-LayerNorm blocks, fused ``c_attn`` q/k/v
projection, gelu_new MLP and (normally) an lm_head tied to ``wte``.  Parameter names
mirror Hugging Face's (``transformer.h.N.attn.c_attn``...), but the Conv1D layers are
plain ``nn.Linear`` so checkpoint Conv1D weights ``[in, out]`` are transposed on load.
Attention scale is ``1 / sqrt(head_dim)`` (transformers' defaults: scale_attn_weights,
no per-layer-index scaling).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from roseinfer.model.attention_metadata import AttentionMetadata
from roseinfer.model.config import ModelConfig
from roseinfer.model.layers import WeightLoadTracker, get_activation, paged_attention

# Conv1D modules whose checkpoint weights are stored [in, out].
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# Causal-mask buffers older checkpoints carry; harmless.
_IGNORED = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$")


class GPT2Attention(nn.Module):
    """Multi-head attention with fused q/k/v projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        # H * Dh: the hidden size, or this rank's heads under tensor parallelism.
        self.qkv_size = config.num_heads * config.head_dim
        self.scale = self.head_dim**-0.5
        self.c_attn = nn.Linear(config.hidden_size, 3 * self.qkv_size, bias=True)
        self.c_proj = nn.Linear(self.qkv_size, config.hidden_size, bias=True)

    def forward(self, x: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        qkv = self.c_attn(x)  # [T, 3 * H * Dh]
        q, k, v = qkv.split(self.qkv_size, dim=-1)  # [T, H * Dh] each
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, Dh]
        k = k.view(-1, self.num_heads, self.head_dim)  # [T, H, Dh]
        v = v.view(-1, self.num_heads, self.head_dim)  # [T, H, Dh]
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)  # [T, H, Dh]
        return self.c_proj(out.reshape(-1, self.qkv_size))  # [T, hidden]


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(x)))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        return self.c_proj(self.act(self.c_fc(x)))  # via [T, intermediate]


class GPT2Block(nn.Module):
    """Pre-LayerNorm block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, h: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        h = h + self.attn(self.ln_1(h), kv_cache, meta)  # [T, hidden]
        return h + self.mlp(self.ln_2(h))


class GPT2Model(nn.Module):
    """Token + position embeddings, blocks, final LayerNorm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Uninitialised weights given: no random init (on meta it imports torch._dynamo).
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size,
                                _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                _weight=torch.empty(config.max_position_embeddings,
                                                    config.hidden_size))
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 causal LM over a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        # Tied embeddings (the GPT-2 default): no lm_head parameter, use wte.
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:
        """input_ids/positions [T] -> final-LayerNorm hidden states [T, hidden]."""
        if len(kv_caches) != len(self.transformer.h):
            raise ValueError(f"expected {len(self.transformer.h)} KV caches, got {len(kv_caches)}")
        h = self.transformer.wte(input_ids) + self.transformer.wpe(positions)  # [T, hidden]
        for block, kv_cache in zip(self.transformer.h, kv_caches, strict=True):
            h = block(h, kv_cache, meta)
        return self.transformer.ln_f(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()  # [N, vocab]
        return F.linear(hidden, self.transformer.wte.weight).float()  # [N, vocab]

    def tied_embedding(self) -> Tensor:
        """The embedding matrix [vocab, hidden] a tied LM head reads."""
        return self.transformer.wte.weight

    def load_weights(self, weights: Iterable[tuple[str, Tensor]],
                     on_module_loaded: Callable[[str], bool] | None = None) -> None:
        """Load Hugging Face GPT-2 tensors (with or without the ``transformer.`` prefix;
        ``on_module_loaded``: ``WeightLoadTracker``'s)."""
        tracker = WeightLoadTracker(self, on_module_loaded=on_module_loaded)
        for hf_name, tensor in weights:
            if _IGNORED.search(hf_name):
                continue
            if hf_name == "lm_head.weight":
                if self.lm_head is None:
                    continue  # tied to wte
                tracker.load(hf_name, tensor)
                continue
            name = hf_name if hf_name.startswith("transformer.") else "transformer." + hf_name
            if name.endswith(tuple(f".{c}.weight" for c in _CONV1D)):
                tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
            tracker.load(name, tensor, source=hf_name)
        tracker.finish()
