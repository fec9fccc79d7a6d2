"""GGUF checkpoints: metadata -> ModelConfig, tensors -> dequantized HF-named weights.

The header (metadata and tensor table) is parsed and validated by
:mod:`roseinfer.model.gguf_header` (``struct`` over a read-only ``mmap``). Tensor
data stays memory-mapped; each tensor is dequantized with
``gguf.quants.dequantize`` only when the weights iterator reaches it.

Tensor names are mapped to Hugging Face names and llama.cpp's changes to the
values undone (Q/K row permutation, Gemma's ``1 + weight`` norms, GPT-2's transposed
``Conv1D``); what each architecture needs is in :mod:`roseinfer.model.gguf_arch`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from roseinfer.model.config import ModelConfig
from roseinfer.model.gguf_arch import ROPE_TENSORS, gguf_model_config, hf_name, to_hf_tensor
from roseinfer.model.gguf_arch import llama3_rope_factors as llama3_rope_factors  # re-export
from roseinfer.model.gguf_header import GGUFTensorInfo as GGUFTensorInfo  # re-export
from roseinfer.model.gguf_header import map_file
from roseinfer.model.gguf_header import parse_header as _parse_header
from roseinfer.model.loader import Checkpoint

logger = logging.getLogger(__name__)

# Tensor types read as plain values, not blocks (numpy dtype; BF16 is reinterpreted by torch).
_PLAIN: Mapping[GGMLQuantizationType, Any] = MappingProxyType({
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.BF16: np.uint16,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
})


class GGUFFile:
    """A GGUF file's parsed header plus memory-mapped access to its tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mm = map_file(self.path)
        self.metadata, self.tensors = _parse_header(self._mm, self.path)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """Metadata value ``{architecture}.{suffix}``."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def read_tensor(self, info: GGUFTensorInfo) -> torch.Tensor:
        """The tensor as torch: F32/F16/BF16/ints as stored, quantized types -> float32."""
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        plain = _PLAIN.get(info.qtype)
        if plain is not None:
            tensor = torch.from_numpy(raw.view(plain).reshape(info.shape).copy())
            if info.qtype == GGMLQuantizationType.BF16:
                tensor = tensor.view(torch.bfloat16)
            return tensor
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        rows = raw.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)
        try:
            values = dequantize(rows, info.qtype)
        except NotImplementedError as exc:
            raise ValueError(
                f"{self.path}: tensor {info.name!r} has type {info.qtype.name}, "
                f"which gguf {exc}"
            ) from exc
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)


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
