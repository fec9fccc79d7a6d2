"""Gemma, Gemma 2 and Gemma 3 (text) over a paged KV cache.

References: transformers' ``modeling_gemma`` / ``modeling_gemma2`` / ``modeling_gemma3``.
What sets them apart from Llama (``llama``, whose model class they extend):

* embeddings scaled by ``sqrt(hidden_size)`` (the constant cast to the model dtype);
* RMSNorm as ``norm(x) * (1 + weight)`` in float32, then cast (``GemmaRMSNorm``);
  checkpoints store ``weight`` (llama.cpp's GGUF stores ``1 + weight``; the GGUF
  loader subtracts the 1 again);
* GeGLU MLP: ``gelu_pytorch_tanh(gate) * up`` (legacy configs say ``gelu``);
* Gemma 2/3: "sandwich" norms — ``post_attention_layernorm`` on the attention output,
  ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP;
  attention scale ``query_pre_attn_scalar ** -0.5``; interleaved sliding-window and
  global layers (``ModelConfig.layer_types``: Gemma 2 alternates, Gemma 3 has five
  sliding layers per global one);
* Gemma 2: attention-logit and final-logit soft-capping ``tanh(x / cap) * cap``;
* Gemma 3: q/k norms (Gemma-style) before rotary; sliding layers rotate with
  ``rope_local_base_freq`` (10k), global ones with ``rope_theta`` and its scaling.

Tied embeddings, no biases.  None of this is in the C++ decoder stack, so these models
run layer by layer, on the C++ row ops where they apply (norms, rotary + KV write, paged
attention — windows included — and the GEMMs); GeGLU, soft-capping and (Gemma 2) the
soft-capped attention are plain PyTorch, so batch invariance is not promised for them.  ``Gemma3ForConditionalGeneration``
checkpoints (Gemma 3 4B+) load their language model; vision tensors are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from roseinfer.model.attention import Attention
from roseinfer.model.attention_metadata import AttentionMetadata
from roseinfer.model.config import ModelConfig
from roseinfer.model.layers import row_kernels_usable
from roseinfer.model.llama import LlamaForCausalLM, LlamaMLP
from roseinfer.model.rope import RopeInputs
from roseinfer.model.sliding_window import WindowView


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` computed in float32 then cast (transformers' order)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [T, n] -> [T, n]
        if self.weight.dtype == torch.float32 and row_kernels_usable(x):
            # the C++ row op (batch-invariant) with the (1 + weight) multiplier
            return torch.ops.roseinfer.rms_norm(x, 1.0 + self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # [T, n]
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaDecoderLayer(nn.Module):
    """Gemma block: pre-norm (Gemma 1) or sandwich-norm (Gemma 2/3) attention and MLP."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.norm_eps
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Attention(
            config, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            scale=float(scalar) ** -0.5, qk_norm=GemmaRMSNorm if config.qk_norm else None,
            softcap=config.attn_logit_softcapping, sliding=config.is_sliding_layer(layer),
        )
        # Gemma 1: the pre-MLP norm (Llama's role); Gemma 2/3: on the attention output.
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm: nn.Module | None = None
        self.post_feedforward_layernorm: nn.Module | None = None
        if config.architecture != "GemmaForCausalLM":
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, h: Tensor, rope: RopeInputs, kv_cache: Tensor, meta: AttentionMetadata,
        window: WindowView | None = None,
    ) -> Tensor:  # [T, hidden] -> [T, hidden]
        return self.finish(h, self.attention(h, rope, kv_cache, meta, window))

    def attention(
        self, h: Tensor, rope: RopeInputs, kv_cache: Tensor, meta: AttentionMetadata,
        window: WindowView | None = None,
    ) -> Tensor:  # [T, hidden] -> the attention's output [T, hidden] (K/V written)
        return self.self_attn(self.input_layernorm(h), rope, kv_cache, meta, window)

    def finish(self, h: Tensor, attn: Tensor) -> Tensor:  # norms, residuals, MLP: row-local
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            h = h + attn
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma (1) causal LM; the base of Gemma 2 and 3 (config-driven differences)."""

    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm
    supports_decode_stack = False

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids [T] -> embeddings * sqrt(hidden) [T, hidden] (constant in the model dtype)."""
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32)
        return h * scale.to(device=h.device, dtype=h.dtype)


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: sandwich norms, soft-capping, alternating sliding / global layers."""


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 text: sandwich norms, q/k norms, 5:1 sliding / global layers, two rope bases."""


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 4B+ (image-text) checkpoint; vision is skipped."""

    def load_weights(self, weights: Iterable[tuple[str, Tensor]],
                     on_module_loaded: Callable[[str], bool] | None = None) -> None:
        """Load the ``language_model`` tensors (either transformers layout)."""
        super().load_weights(_language_model(weights), on_module_loaded)


def _language_model(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """Text-model tensors renamed to Gemma3ForCausalLM's names, vision ones dropped:
    ``language_model.model.X`` (transformers < 4.52) / ``model.language_model.X`` -> ``model.X``."""
    for name, tensor in weights:
        for old, new in (("language_model.model.", "model."), ("model.language_model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
            if name.startswith(old):
                yield new + name.removeprefix(old), tensor
                break
        else:
            if name.startswith("lm_head."):
                yield name, tensor
