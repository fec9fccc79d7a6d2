"""GGUF header parsing: metadata key/values and the tensor table, validated.

Parsed with ``struct`` over a read-only ``mmap``: ``gguf.GGUFReader`` builds one numpy
view per vocabulary string and needs ~4 s for a 49k-token vocabulary, this takes
~0.1 s. A GGUF file is untrusted input, so every malformed header is one
``ValueError`` naming the file and the field at fault (a metadata key, a tensor name,
or a header part) — never ``struct.error``, ``OverflowError``, ``RecursionError`` or
``MemoryError``:

- every count and length is checked against the bytes left in the file before it is
  read, so nothing is allocated for data the file does not hold (a string array of n
  items needs at least 8n bytes; nested arrays at least 12 bytes an item);
- arrays nest at most ``MAX_ARRAY_DEPTH`` deep; strings must be valid UTF-8; keys and
  tensor names are unique;
- ``general.alignment`` is an integer power of two (>= 1);
- a tensor has 1..``MAX_DIMS`` dims, each >= 1, a known type whose block size divides
  its rows, an offset that is a multiple of the alignment, and data inside the file.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS: Mapping[int, tuple[str, int]] = MappingProxyType({  # GGUFValueType -> (struct, size)
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
})
_STRING, _ARRAY = 8, 9
MAX_ARRAY_DEPTH = 4  # arrays of arrays ... (llama.cpp writes none nested)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
_HEADER_BYTES = 24  # magic, version, n_tensors, n_kv
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. ``shape`` is in torch order (slowest dim first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Reader:
    """A bounds-checked cursor over the header; ``where`` names the field being read."""

    __slots__ = ("mm", "size", "path", "pos", "where")

    def __init__(self, mm: mmap.mmap, path: Path) -> None:
        self.mm, self.size, self.path = mm, len(mm), path
        self.pos = 0
        self.where = "header"

    def fail(self, why: str) -> ValueError:
        return ValueError(f"{self.path}: malformed GGUF {self.where}: {why}")

    def need(self, n: int, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, only {left} left")

    def unpack(self, fmt: str, size: int, what: str) -> tuple[Any, ...]:
        self.need(size, what)
        values = struct.unpack_from(fmt, self.mm, self.pos)
        self.pos += size
        return values

    def string(self, what: str) -> str:
        (length,) = self.unpack("<Q", 8, f"{what} length")
        self.need(length, what)
        start = self.pos
        self.pos += length
        try:
            return self.mm[start:self.pos].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8 ({exc.reason})") from None

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.unpack("<" + fmt, size, "value")[0]
        if vtype == _STRING:
            return self.string("string value")
        if vtype != _ARRAY:
            raise self.fail(f"unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        etype, count = self.unpack("<IQ", 12, "array header")
        if etype in _SCALARS:
            fmt, size = _SCALARS[etype]
            self.need(count * size, f"array of {count} items")
            values = list(struct.unpack_from(f"<{count}{fmt}", self.mm, self.pos))
            self.pos += count * size
            return values
        if etype == _STRING:
            return self._strings(count)
        if etype != _ARRAY:
            raise self.fail(f"unknown array item type {etype}")
        self.need(count * 12, f"array of {count} arrays")
        return [self.value(etype, depth + 1) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """Vocabularies and merges: ~100k strings, so one tight loop."""
        self.need(count * 8, f"array of {count} strings")
        mm, pos, unpack = self.mm, self.pos, struct.unpack_from
        strings: list[str] = []
        try:  # a slice past the end is cut short; the next unpack (or the check below) fails
            for _ in range(count):
                (length,) = unpack("<Q", mm, pos)
                strings.append(mm[pos + 8:pos + 8 + length].decode("utf-8"))
                pos += 8 + length
        except (struct.error, OverflowError):  # OverflowError: a length beyond ssize_t
            pos = self.size + 1
        except UnicodeDecodeError as exc:
            raise self.fail(f"string {len(strings)} of {count} is not valid UTF-8 "
                            f"({exc.reason})") from None
        if pos > self.size:
            raise self.fail(f"string {len(strings)} of {count} runs past the end of the file")
        self.pos = pos
        return strings


def map_file(path: Path) -> mmap.mmap:
    """A read-only mapping of the file at ``path``; an empty file (which ``mmap`` cannot
    map) is the same ``ValueError`` as any other malformed header, naming the file."""
    with open(path, "rb") as f:
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # "cannot mmap an empty file"
            raise ValueError(f"{path}: malformed GGUF header: the file is empty") from exc


def parse_header(mm: mmap.mmap, path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """(metadata, tensors by name) of the GGUF file mapped in ``mm``; ValueError naming the
    file and the field for anything malformed."""
    r = _Reader(mm, path)
    if r.size < _HEADER_BYTES or mm[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian files "
                         "are not supported)")
    r.pos = _HEADER_BYTES
    r.where = "header counts"
    r.need(n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES,
           f"{n_kv} metadata entries and {n_tensors} tensors")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        r.where = f"metadata key #{i}"
        key = r.string("key")
        r.where = f"metadata key {key!r}"
        if key in metadata:
            raise r.fail("duplicate key")
        (vtype,) = r.unpack("<I", 4, "value type")
        metadata[key] = r.value(vtype)
    entries = []
    names: set[str] = set()
    for i in range(n_tensors):
        entry = _tensor_entry(r, i)
        if entry[0] in names:
            raise r.fail("duplicate tensor name")
        names.add(entry[0])
        entries.append(entry)
    r.where = "metadata key 'general.alignment'"
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise r.fail(f"must be a power of two >= 1, got {align!r}")
    data_start = (r.pos + align - 1) // align * align
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, qtype, offset in entries:
        r.where = f"tensor {name!r}"
        block, type_size = GGML_QUANT_SIZES[qtype]
        if shape[-1] % block:
            raise r.fail(f"row length {shape[-1]} is not a multiple of {qtype.name}'s block "
                         f"size {block}")
        if offset % align:
            raise r.fail(f"data offset {offset} is not a multiple of the alignment {align}")
        nbytes = math.prod(shape) // block * type_size
        start = data_start + offset
        if start + nbytes > r.size:
            raise r.fail(f"data ({nbytes} bytes at offset {start}) extends past the end of "
                         f"the file ({r.size} bytes)")
        tensors[name] = GGUFTensorInfo(name, shape, qtype, start, nbytes)
    return metadata, tensors


def _tensor_entry(r: _Reader, i: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    """(name, shape in torch order, type, offset from the data start) of tensor ``i``."""
    r.where = f"tensor #{i}"
    name = r.string("name")
    r.where = f"tensor {name!r}"
    (n_dims,) = r.unpack("<I", 4, "n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise r.fail(f"n_dims must be in [1, {MAX_DIMS}], got {n_dims}")
    dims = r.unpack(f"<{n_dims}Q", 8 * n_dims, "dims")
    if any(d < 1 for d in dims):
        raise r.fail(f"every dim must be >= 1, got {list(dims)}")
    if math.prod(dims) > r.size * 8:  # more elements than any type packs into the file
        raise r.fail(f"dims {list(dims)} hold more elements than the file can")
    raw_type, offset = r.unpack("<IQ", 12, "type and offset")
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise r.fail(f"unknown tensor type {raw_type}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise r.fail(f"tensor type {qtype.name} has no known block size")
    if offset > r.size:
        raise r.fail(f"data offset {offset} is past the end of the file ({r.size} bytes)")
    return name, tuple(reversed(dims)), qtype, offset
