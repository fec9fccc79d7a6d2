"""Architecture registry: map a Hugging Face architecture name to a model class.

``create_model`` builds the module on the meta device (no random init), then
materialises uninitialised storage with ``to_empty`` and recomputes derived buffers
(rotary cos/sin caches).  Weights are filled afterwards by ``model.load_weights``
(or, from the weight cache, by ``weight_state.model_from_state`` on the meta model).
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

from roseinfer.model.config import MODEL_TYPE_ARCHITECTURES, ModelConfig
from roseinfer.model.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    GemmaForCausalLM,
)
from roseinfer.model.gpt2 import GPT2LMHeadModel
from roseinfer.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from roseinfer.model.phi3 import Phi3ForCausalLM
from roseinfer.model.qwen3 import Qwen3ForCausalLM

_ARCHITECTURES: MappingProxyType[str, type[nn.Module]] = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GPT2LMHeadModel": GPT2LMHeadModel,
})


def supported_architectures() -> list[str]:
    """Architecture names (HF class names) that ``get_model_class`` accepts."""
    return sorted(_ARCHITECTURES)


def get_model_class(architecture: str) -> type[nn.Module]:
    """Model class for an HF architecture (``LlamaForCausalLM``) or model_type (``llama``)."""
    if architecture in _ARCHITECTURES:
        return _ARCHITECTURES[architecture]
    if architecture.lower() in MODEL_TYPE_ARCHITECTURES:
        return _ARCHITECTURES[MODEL_TYPE_ARCHITECTURES[architecture.lower()]]
    raise ValueError(
        f"unsupported model architecture {architecture!r}; supported: "
        f"{supported_architectures()} (or model types {sorted(MODEL_TYPE_ARCHITECTURES)})"
    )


def create_meta_model(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    """``config``'s model on the meta device in ``dtype``: shapes only, no storage, no
    random init (the model files build embeddings from a given meta tensor, so nothing
    runs ``normal_`` on meta, which imports torch._dynamo: ~2.5 s)."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config)
    return model.to(dtype=dtype)


def create_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build ``config``'s model with uninitialised weights of ``dtype`` on ``device``, in eval mode."""
    model = create_meta_model(config, dtype)
    materialize(model, device)
    reset_buffers(model)
    model.requires_grad_(False)
    return model.eval()


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer still on the meta device uninitialised storage on
    ``device`` (``to_empty`` without its ``empty_like`` on meta, which imports sympy)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device),
                    requires_grad=param.requires_grad)
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)


def reset_buffers(model: nn.Module) -> None:
    """Recompute every derived buffer (rotary cos/sin caches) once storage exists."""
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
