"""GGUF checkpoints: metadata -> ModelConfig, tensors -> dequantized HF-named weights.

The file is read through :mod:`roseinfer.model.gguf_file` (``GGUFFile``, re-exported
here): the header (metadata and tensor table) is parsed and validated by
:mod:`roseinfer.model.gguf_header` (``struct`` over a read-only ``mmap``). Tensor data
stays memory-mapped; each tensor is dequantized with ``gguf.quants.dequantize`` only
when the weights iterator reaches it.

Tensor names are mapped to Hugging Face names and llama.cpp's changes to the
values undone (Q/K row permutation, Gemma's ``1 + weight`` norms, GPT-2's transposed
``Conv1D``); what each architecture needs is in :mod:`roseinfer.model.gguf_arch`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from roseinfer.model.checkpoint import Checkpoint
from roseinfer.model.config import ModelConfig
from roseinfer.model.gguf_arch import ROPE_TENSORS, gguf_model_config, hf_name, to_hf_tensor
from roseinfer.model.gguf_arch import llama3_rope_factors as llama3_rope_factors  # re-export
from roseinfer.model.gguf_file import GGUFFile as GGUFFile  # re-export
from roseinfer.model.gguf_header import GGUFTensorInfo as GGUFTensorInfo  # re-export

logger = logging.getLogger(__name__)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All metadata key/values of a GGUF file (no tensor data is read)."""
    return GGUFFile(path).metadata


def iter_gguf_weights(gf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every model tensor in the file, one at a time."""
    arch = gf.architecture
    for info in gf.tensors.values():
        if info.name in ROPE_TENSORS:  # folded into config.rope_scaling
            continue
        mapped = hf_name(info.name, arch)
        if mapped is None:
            logger.warning("%s: skipping unknown GGUF tensor %r", gf.path, info.name)
            continue
        name, part = mapped
        yield name, to_hf_tensor(gf.read_tensor(info), arch, part, config)


def load_gguf(path: str | Path) -> Checkpoint:
    """Config plus a lazy HF-named weights iterator for a GGUF file."""
    gf = GGUFFile(path)
    config = gguf_model_config(gf)
    count = sum(info.name not in ROPE_TENSORS for info in gf.tensors.values())
    return Checkpoint(config=config, weights=iter_gguf_weights(gf, config), source=gf.path,
                      num_tensors=count)
