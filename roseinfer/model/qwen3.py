"""Qwen3 (dense): the Llama decoder plus a per-head RMSNorm on q and k before rotary.

transformers' ``Qwen3Attention`` normalises ``q_proj(x)`` and ``k_proj(x)`` over each
head's ``head_dim`` (``q_norm`` / ``k_norm``, Llama-style RMSNorm), with no q/k/v bias
and an explicit ``head_dim`` (128 for every size, not ``hidden / heads``).  All of it is
config-driven in ``llama`` (``ModelConfig.qk_norm``); the C++ decoder stack has no q/k
norm, so Qwen3 runs the per-layer path (C++ row ops for norms, rotary and attention).
Qwen2.5 is the Qwen2 architecture (``Qwen2ForCausalLM``).
"""

from __future__ import annotations

from roseinfer.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama architecture with q/k norms (``config.qk_norm``)."""
