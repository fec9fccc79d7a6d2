"""The identity of a model's KV: what a block on disk must match to be loaded.

K/V of a token depend on the weights, the weight format (quantization), the compute
and KV dtypes, the model's shape, the block size, the code that computes them (the
model, the kernels' Python and C++ sources) and torch.  ``model_identity`` digests
all of them into a name; a block file stores it and a reader compares it, and the
store keeps each identity's blocks in its own directory.  Weights are named by their
files' identity as the weight cache names them (``cache_key.source_fingerprint``:
size, mtime and SHA-256 of the head and tail), or, for a model object given without a
file, by a SHA-256 of all of its tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from roseinfer.kvcache.block_file import VERSION
from roseinfer.model.cache_key import code_fingerprint, digest, source_fingerprint
from roseinfer.model.config import ModelConfig

_CODE_PARTS = ("model", "kernels")
_CSRC_SUFFIXES = (".h", ".hpp", ".cpp", ".cc")


def weights_digest(model: nn.Module) -> str:
    """SHA-256 (hex) of every parameter and buffer of ``model``, with their names."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def kernel_sources_digest() -> str:
    """SHA-256 (16 hex digits) of the C++ kernel sources (``roseinfer/kernels/csrc``)."""
    csrc = Path(__file__).resolve().parents[1] / "kernels" / "csrc"
    h = hashlib.sha256()
    if csrc.is_dir():
        for path in sorted(p for p in csrc.rglob("*") if p.suffix in _CSRC_SUFFIXES):
            h.update(path.relative_to(csrc).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def model_identity(weights: Path | str, model_config: ModelConfig, *, quantization: str,
                   dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int) -> str:
    """A 16-hex-digit name of the model's KV (module docstring).  ``weights``: the
    checkpoint's path, or a ``weights_digest``."""
    source: Any = (source_fingerprint(weights) if isinstance(weights, Path)
                   else {"weights_sha256": weights})
    return digest({
        "block_file_version": VERSION,
        "weights": source,
        "model_config": _jsonable(dataclasses.asdict(model_config)),
        "quantization": quantization,
        "dtype": str(dtype), "kv_dtype": str(kv_dtype), "block_size": block_size,
        "code": code_fingerprint(_CODE_PARTS), "kernels": kernel_sources_digest(),
        "torch": torch.__version__,
    })


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
