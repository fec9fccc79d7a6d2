"""Build the C++ decode stack (``roseinfer.kernels``) over a Llama-family model's weights.

A decode step (one new token per sequence) of a float32 CPU model with a SiLU MLP
then runs every decoder layer in one call: no Python per layer, no per-op dispatch.
The stack shares the model's tensors (norm weights, fp32 linear weights) or its
prepacked fp16 kernels, so it costs no extra weight memory and sees weight reloads.
Anything it does not cover returns None and the model keeps its per-layer path
(``stack_unsupported_reason`` names why: the stack has no sliding window, soft-capping,
q/k norm, partial rotary, other attention scale, per-layer rope, non-Llama layers or
the all-reduces of a tensor-parallel shard).
Rope scaling (llama3, linear, longrope) is only in the cos/sin table it is handed, so
Llama 3.x and full-rotary Phi-3 keep the stack.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

logger = logging.getLogger("roseinfer.model")


def kernel_linear(module: nn.Module) -> object | None:
    """The kernel ``Linear`` for an ``nn.Linear`` (fp32, shared) or an ``Fp16Linear``."""
    from roseinfer.kernels import make_linear
    from roseinfer.model.quantize import Fp16Linear

    if isinstance(module, Fp16Linear):
        return module.kernel
    if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
        return make_linear(module.weight, module.bias, fp16=False)
    return None


def stack_unsupported_reason(model: Any) -> str | None:
    """Why the LlamaStack cannot compute ``model``'s layers exactly (None: it can)."""
    cfg = model.config
    checks = (
        (not getattr(model, "supports_decode_stack", False), f"{cfg.architecture} layers"),
        (getattr(model, "tensor_parallel", None) is not None, "tensor-parallel collectives"),
        (cfg.hidden_act not in ("silu", "swish"), f"activation {cfg.hidden_act}"),
        (cfg.qk_norm, "q/k norms"),
        (cfg.sliding_window is not None, "sliding-window attention"),
        (cfg.attn_logit_softcapping is not None, "attention-logit soft-capping"),
        (cfg.query_pre_attn_scalar is not None, "query_pre_attn_scalar attention scale"),
        (cfg.rotary_dim != cfg.head_dim, "partial rotary"),
        (cfg.rope_local_theta is not None, "per-layer rope bases"),
    )
    return next((reason for failed, reason in checks if failed), None)


def build_llama_decode_stack(model: Any, sample: Tensor) -> object | None:
    """A ``torch.classes.roseinfer.LlamaStack`` for ``model``, or None when not applicable."""
    cfg = model.config
    if sample.device.type != "cpu" or sample.dtype != torch.float32:
        return None
    reason = stack_unsupported_reason(model)
    if reason is not None:
        logger.info("%s runs layer by layer (the C++ decoder stack has no %s)",
                    cfg.architecture, reason)
        return None
    from roseinfer.kernels import cpu_kernels_available

    if not cpu_kernels_available():
        return None
    inner = model.model
    if inner.rotary_emb.cos_sin_cache.dtype != torch.float32:
        return None
    stack = torch.classes.roseinfer.LlamaStack(
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
        float(inner.norm.eps), inner.norm.weight.detach(),
    )
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [kernel_linear(m) for m in
                   (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(k is None for k in linears):
            return None
        if layer.input_layernorm.eps != inner.norm.eps:
            return None
        stack.add_layer(layer.input_layernorm.weight.detach(),
                        layer.post_attention_layernorm.weight.detach(), *linears)
    logger.info("decode steps run in the C++ decoder stack (%d layers)", len(inner.layers))
    return stack


def build_head_kernel(model: Any) -> object | None:
    """A kernel ``Linear`` over a float32 LM head (tied or not), sharing its weight: one
    arithmetic for every row count (batch invariance), and its threaded GEMV beats MKL
    for the few rows of a decode step.  None for an fp16 head (already a kernel) or
    anything else."""
    from roseinfer.kernels import cpu_kernels_available, make_linear
    from roseinfer.model.quantize import Fp16Linear

    head = getattr(model, "lm_head", None)
    if isinstance(head, Fp16Linear) or not cpu_kernels_available():
        return None
    if head is None:
        weight, bias = model.tied_embedding(), None
    elif isinstance(head, nn.Linear):
        weight, bias = head.weight, head.bias
    else:
        return None
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
        return None
    return make_linear(weight, bias, fp16=False)
