"""GGUF checkpoints: metadata -> ModelConfig, tensors -> dequantized HF-named weights.

The header (metadata and tensor table) is parsed here with ``struct`` over a
read-only ``mmap``: ``gguf.GGUFReader`` builds one numpy view per vocabulary
string and needs ~4 s for a 49k-token vocabulary, this takes ~0.1 s. Tensor
data stays memory-mapped; each tensor is dequantized with
``gguf.quants.dequantize`` only when the weights iterator reaches it.

Tensor names are mapped to Hugging Face names and llama.cpp's changes to the
values undone (Q/K row permutation, Gemma's ``1 + weight`` norms, GPT-2's transposed
``Conv1D``); what each architecture needs is in :mod:`roseinfer.model.gguf_arch`.
"""

from __future__ import annotations

import logging
import math
import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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
from roseinfer.model.loader import Checkpoint

logger = logging.getLogger(__name__)

_SCALARS: Mapping[int, tuple[str, int]] = MappingProxyType({  # GGUFValueType -> (struct, size)
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
})
_STRING, _ARRAY = 8, 9

# Tensor types read as plain values, not blocks (numpy dtype; BF16 is reinterpreted by torch).
_PLAIN: Mapping[GGMLQuantizationType, Any] = MappingProxyType({
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.BF16: np.uint16,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
})

@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. ``shape`` is in torch order (slowest dim first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's parsed header plus memory-mapped access to its tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
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


def _parse_header(mm: mmap.mmap, path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    if len(mm) < 24 or mm[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian files "
                         "are not supported)")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = _read_str(mm, pos)
        (vtype,) = struct.unpack_from("<I", mm, pos)
        metadata[key], pos = _read_value(mm, pos + 4, vtype)
    entries = []
    for _ in range(n_tensors):
        name, pos = _read_str(mm, pos)
        (n_dims,) = struct.unpack_from("<I", mm, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        entries.append((name, tuple(reversed(dims)), GGMLQuantizationType(qtype), offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, qtype, offset in entries:
        block, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(shape) // block * type_size
        start = data_start + offset
        if start + nbytes > len(mm):
            raise ValueError(f"{path}: tensor {name!r} extends past the end of the file")
        tensors[name] = GGUFTensorInfo(name, shape, qtype, start, nbytes)
    return metadata, tensors


def _read_str(mm: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", mm, pos)
    end = pos + 8 + length
    return mm[pos + 8:end].decode("utf-8"), end


def _read_value(mm: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALARS:
        fmt, size = _SCALARS[vtype]
        return struct.unpack_from("<" + fmt, mm, pos)[0], pos + size
    if vtype == _STRING:
        return _read_str(mm, pos)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {vtype}")
    etype, count = struct.unpack_from("<IQ", mm, pos)
    pos += 12
    if etype in _SCALARS:
        fmt, size = _SCALARS[etype]
        return list(struct.unpack_from(f"<{count}{fmt}", mm, pos)), pos + count * size
    if etype == _STRING:  # vocabularies and merges: ~100k strings, so one tight loop
        strings = []
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", mm, pos)
            strings.append(mm[pos + 8:pos + 8 + length].decode("utf-8"))
            pos += 8 + length
        return strings, pos
    values = []
    for _ in range(count):
        value, pos = _read_value(mm, pos, etype)
        values.append(value)
    return values, pos


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
