"""Where an adapter comes from: a PEFT directory (``adapter``) or a GGUF LoRA file
(``gguf_adapter``, a path ending in ``.gguf``); one check and one read for both."""

from __future__ import annotations

from torch import Tensor

from roseinfer.lora.adapter import AdapterSpec, inspect_adapter, read_adapter
from roseinfer.lora.gguf_adapter import inspect_gguf_adapter, read_gguf_adapter
from roseinfer.model.config import ModelConfig


def is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def check_adapter(path: str, config: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """The checked adapter at ``path``; ValueError naming the problem."""
    if is_gguf(path):
        return inspect_gguf_adapter(path, config, max_lora_rank)
    return inspect_adapter(path, config, max_lora_rank)


def read_tensors(spec: AdapterSpec, config: ModelConfig
                 ) -> dict[tuple[int, str], tuple[Tensor, Tensor, float]]:
    """(layer, module) -> (A [r, in], B [out, r], scaling) of a checked adapter."""
    if is_gguf(spec.path):
        return read_gguf_adapter(spec, config)
    return read_adapter(spec)
