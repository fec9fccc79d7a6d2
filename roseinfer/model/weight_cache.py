"""The weight cache: a converted model's tensors (``weight_state``) in one safetensors
file, so the next start skips dequantizing and quantizing.

``<cache root>/weights/<slot>-<key>.safetensors`` (root and key: ``cache_key``).  The
key holds the source files' identity, the weight format, the dtype, how linear layers
are stored (int8 ``qweight``/``scales``, or plain weights when the int8 kernels are not
loaded), the cache format version, the torch version and the conversion code's hash.
The stored tensors do not depend on the CPU (int8 values come from elementwise
IEEE ops in ``quantize_int8_blocks``; the CPU-specific packing runs at load).

Safety: an entry is written to a temporary file and renamed into place, so a reader
never sees a partial one.  Its header carries the full key and a CRC-32 of every
tensor; ``load`` checks both (~0.1 s for the default model's 270 MB) and treats any
mismatch, truncation or unreadable file as a miss: a warning, the entry is deleted
and the caller converts again.  No fsync: a file cut short by a crash fails the check.
Tensors are memory-mapped copy-on-write (``safe_open``), never written back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from roseinfer.model.cache_key import entry_name, slot_of

logger = logging.getLogger("roseinfer.model")

CACHE_FORMAT_VERSION = 1
_KEY_FIELD = "roseinfer.key"
_CRC_FIELD = "roseinfer.crc32"
_SOURCE_FIELD = "roseinfer.source"


def tensor_crc32(tensor: Tensor) -> int:
    """CRC-32 of a tensor's bytes (any dtype)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(flat.numpy())


class CorruptEntryError(ValueError):
    """A cache entry that cannot be trusted (bad header, key, checksum or content)."""


class WeightCache:
    """One weight-cache entry: ``load`` (None on a miss), ``save`` and ``discard``."""

    def __init__(self, directory: Path, source: Path, kind: dict[str, Any],
                 key: dict[str, Any]) -> None:
        """``kind``: what makes entries of one source different (format, dtype);
        ``key``: everything the content depends on (includes ``kind``)."""
        self.directory = directory
        self.source = source
        self.key = {"cache_format": CACHE_FORMAT_VERSION, **key}
        self.path = directory / f"{entry_name(source, kind, self.key)}.safetensors"
        self._key_text = json.dumps(self.key, sort_keys=True)

    def load(self) -> dict[str, Tensor] | None:
        """The stored tensors (memory-mapped), or None when there is no valid entry."""
        if not self.path.is_file():
            return None
        try:
            return self._read()
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is a miss
            self.discard(f"unreadable or corrupt ({exc})")
            return None

    def _read(self) -> dict[str, Tensor]:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get(_KEY_FIELD) != self._key_text:
                raise CorruptEntryError("its key does not match")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        sums = json.loads(meta[_CRC_FIELD])
        if set(sums) != set(tensors):
            raise CorruptEntryError("its checksum list does not match its tensors")
        for name, tensor in tensors.items():
            if tensor_crc32(tensor) != sums[name]:
                raise CorruptEntryError(f"tensor {name!r} fails its checksum")
        return tensors

    def discard(self, why: str) -> None:
        """Delete this entry (a warning says ``why``); the caller rebuilds it."""
        logger.warning("weight cache entry %s is %s: converting the model again", self.path, why)
        _unlink(self.path)

    def save(self, state: dict[str, Tensor]) -> bool:
        """Write ``state`` atomically; False (with a warning) if it could not be written."""
        from safetensors.torch import save_file

        tensors = _own_storage(state)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.directory).free
            if free < size + (256 << 20):
                raise OSError(f"{free >> 20} MiB free, {size >> 20} MiB needed")
            metadata = {_KEY_FIELD: self._key_text, _SOURCE_FIELD: str(self.source),
                        _CRC_FIELD: json.dumps({n: tensor_crc32(t) for n, t in tensors.items()})}
            save_file(tensors, str(tmp), metadata=metadata)
            os.replace(tmp, self.path)
        except Exception as exc:  # noqa: BLE001 - the cache is an optimisation
            _unlink(tmp)
            logger.warning("could not write the weight cache entry %s (%s); the next start "
                           "will convert the model again", self.path, exc)
            return False
        self._remove_stale()
        logger.info("weight cache: wrote %s (%.0f MiB)", self.path, size / (1 << 20))
        return True

    def _remove_stale(self) -> None:
        """Delete the other entries of this slot (older key: source or code changed)."""
        slot = slot_of(self.path.name)
        for other in self.directory.glob(f"{slot}-*.safetensors"):
            if other != self.path:
                _unlink(other)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):  # gone already, or a read-only cache
        path.unlink()


def _own_storage(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous tensors, each with its own storage (safetensors refuses shared ones:
    e.g. a tied fp16 head's record holds the embedding matrix)."""
    seen: set[int] = set()
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        t = tensor.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out
