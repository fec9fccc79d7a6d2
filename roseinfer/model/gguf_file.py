"""GGUFFile: a GGUF file's parsed header (``gguf_header``) plus memory-mapped access to
its tensors, each read as torch (quantized types dequantized with
``gguf.quants.dequantize``). What ``gguf_arch`` reads the metadata of and
``gguf_loader`` / ``gguf_stream`` read the tensors of.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from roseinfer.model.gguf_header import GGUFTensorInfo, map_file
from roseinfer.model.gguf_header import parse_header as _parse_header

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
