"""Where roseinfer's on-disk caches live and what names an entry.

Root: ``$ROSEINFER_CACHE_DIR``, else ``~/.cache/roseinfer``.  Off when the caller says
so (``weight_cache=False``, ``--no-weight-cache``) or, by default, when
``$ROSEINFER_WEIGHT_CACHE`` is ``0`` / ``false`` / ``off`` / ``no``.

An entry is named by a key (a JSON-able dict) that holds everything its content depends
on, so a changed input is a different entry, never stale data:

* the source files' identity (``source_fingerprint``): for each file its name, size,
  modification time (ns) and the SHA-256 of its first 4 MiB and last 1 MiB — not of
  the whole file (0.2 s per 100 MB here; seconds for multi-GB models).  The header of a
  GGUF (metadata, vocabulary, tensor table) is in the first MiBs;
* a hash of the code that produced the content (for weights ``roseinfer/model/*.py``
  and the kernels' Python side), so fixing a loader or a quantizer never serves
  weights made by the old code;
* whatever the caller adds (weight format, dtype, library versions).

Entries of one source/format share a *slot* (source path + kind); writing an entry
removes the other entries of its slot, so a re-converted model does not pile up.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CACHE_DIR_ENV = "ROSEINFER_CACHE_DIR"
CACHE_SWITCH_ENV = "ROSEINFER_WEIGHT_CACHE"
_HEAD_BYTES = 4 << 20
_TAIL_BYTES = 1 << 20
# Files of a checkpoint directory that the loaders read (tokenizer files are the
# tokenizer cache's business and share this list: config and tokenizer JSONs).
_SOURCE_SUFFIXES = (".json", ".safetensors", ".bin", ".gguf", ".pt", ".pth", ".model", ".txt")


def cache_root() -> Path:
    """The cache directory (not created here)."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "roseinfer"


def cache_enabled(option: bool | None = None) -> bool:
    """``option`` when given, else on unless ``$ROSEINFER_WEIGHT_CACHE`` turns it off."""
    if option is not None:
        return bool(option)
    return os.environ.get(CACHE_SWITCH_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _file_identity(path: Path) -> dict[str, Any]:
    st = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_HEAD_BYTES))
        if st.st_size > _HEAD_BYTES:
            f.seek(max(_HEAD_BYTES, st.st_size - _TAIL_BYTES))
            digest.update(f.read(_TAIL_BYTES))
    return {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256_head_tail": digest.hexdigest()}


def source_files(source: Path) -> list[Path]:
    """The files a checkpoint at ``source`` (a file or directory) is read from: a file
    (plus a ``config.json`` beside it), or a directory's checkpoint-like files."""
    if source.is_dir():
        return sorted(p for p in source.iterdir()
                      if p.is_file() and p.suffix.lower() in _SOURCE_SUFFIXES)
    beside = source.parent / "config.json"
    return [source] + ([beside] if beside.is_file() and beside != source else [])


def source_fingerprint(source: Path) -> list[dict[str, Any]]:
    """Identity of the files of ``source`` (see the module docstring)."""
    return [_file_identity(p) for p in source_files(source)]


def code_fingerprint(parts: tuple[str, ...]) -> str:
    """SHA-256 (16 hex digits) of the roseinfer code a cached conversion depends on:
    ``parts`` are paths in the package, files or directories (their ``*.py``)."""
    package = Path(__file__).resolve().parents[1]
    files: list[Path] = []
    for part in parts:
        path = package / part
        files += sorted(path.glob("*.py")) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def digest(value: Mapping[str, Any] | list[Any]) -> str:
    """A stable 16-hex-digit name for a JSON-able value."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_name(source: Path, kind: Mapping[str, Any], key: Mapping[str, Any]) -> str:
    """``<slot>-<key digest>``: the slot is (resolved source path, ``kind``)."""
    return f"{digest({'source': str(source.resolve()), **kind})}-{digest(key)}"


def slot_of(name: str) -> str:
    return name.split("-", 1)[0]
