"""A byte-level GGUF writer for the header tests (imported by test_gguf_header*.py):
unlike gguf.GGUFWriter it writes any value it is given (nested arrays, bad types, bad
UTF-8) and records where each count / length / type field of the header lies, so tests
can overwrite them. Its test: a valid file it writes reads the same through
gguf.GGUFReader and through roseinfer.model.gguf_header."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from roseinfer.model.gguf_header import GGUFTensorInfo, parse_header

SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
              12: "d"}
STRING, ARRAY = 8, 9
U8, I32, U32, F32 = 0, 5, 4, 6


@dataclass
class Fields:
    """Offsets of the header's fields, by kind: ``u64`` (counts and lengths), ``u32``
    (value / item / tensor types, n_dims), ``dims`` (u64 tensor dims), ``offsets``
    (u64 tensor data offsets), plus where the alignment value is."""

    u64: list[int] = field(default_factory=list)
    u32: list[int] = field(default_factory=list)
    dims: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    alignment: int | None = None
    header_end: int = 0


class _Out:
    def __init__(self, fields: Fields) -> None:
        self.buf = bytearray()
        self.fields = fields

    def put(self, fmt: str, *values: Any, kind: str | None = None) -> None:
        if kind is not None:
            getattr(self.fields, kind).append(len(self.buf))
        self.buf += struct.pack("<" + fmt, *values)

    def raw_string(self, data: bytes) -> None:
        self.put("Q", len(data), kind="u64")
        self.buf += data

    def value(self, vtype: int, value: Any) -> None:
        if vtype in SCALAR_FMT:
            self.put(SCALAR_FMT[vtype], value)
        elif vtype == STRING:
            self.raw_string(value if isinstance(value, bytes) else value.encode())
        elif isinstance(value, bytes):  # raw bytes after an unknown type
            self.buf += value
        else:  # (item type, items)
            etype, items = value
            self.put("I", etype, kind="u32")
            self.put("Q", len(items), kind="u64")
            for item in items:
                self.value(etype, item)


def gguf_bytes(metadata: list[tuple[bytes | str, int, Any]],
               tensors: list[tuple[bytes | str, tuple[int, ...], int, bytes]],
               alignment: int | None = 32) -> tuple[bytes, Fields]:
    """A GGUF v3 file: ``metadata`` as (key, value type, value; arrays are (item type,
    items)); ``tensors`` as (name, dims in GGUF order, type id, data). ``alignment``
    None leaves ``general.alignment`` out (the default, 32, applies)."""
    fields = Fields()
    out = _Out(fields)
    kvs = list(metadata)
    if alignment is not None:
        kvs.append(("general.alignment", U32, alignment))
    out.buf += b"GGUF"
    out.put("I", 3)
    out.put("Q", len(tensors), kind="u64")
    out.put("Q", len(kvs), kind="u64")
    for key, vtype, value in kvs:
        out.raw_string(key if isinstance(key, bytes) else key.encode())
        out.put("I", vtype, kind="u32")
        if key == "general.alignment":
            fields.alignment = len(out.buf)
        out.value(vtype, value)
    align = alignment or 32
    offset = 0
    placed = []
    for name, dims, qtype, data in tensors:
        out.raw_string(name if isinstance(name, bytes) else name.encode())
        out.put("I", len(dims), kind="u32")
        for d in dims:
            out.put("Q", d, kind="dims")
        out.put("I", qtype, kind="u32")
        out.put("Q", offset, kind="offsets")
        placed.append((offset, data))
        offset += (len(data) + align - 1) // align * align
    fields.header_end = len(out.buf)
    out.buf += bytes(-len(out.buf) % align)
    start = len(out.buf)
    for off, data in placed:
        out.buf += bytes(start + off - len(out.buf)) + data
    return bytes(out.buf), fields


def sample_file() -> tuple[bytes, Fields]:
    """A small valid file with every value kind: scalars, strings, a vocabulary, numeric
    and nested arrays, and three tensors (F32, F16 and Q8_0)."""
    q8 = np.zeros((2, 34), dtype=np.uint8)  # 2 rows of one Q8_0 block (fp16 scale + 32 i8)
    q8[:, 2:] = np.arange(32, dtype=np.uint8)
    q8[:, :2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    metadata = [
        ("general.architecture", STRING, "llama"), ("llama.block_count", U32, 2),
        ("llama.rope.freq_base", F32, 10000.0), ("general.flag", 7, True),
        ("general.big", 10, 2**40), ("general.neg", 1, -3),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "bé", "", "<s>"] * 8)),
        ("tokenizer.ggml.token_type", ARRAY, (I32, list(range(32)))),
        ("general.nested", ARRAY, (ARRAY, [(U8, [1, 2]), (STRING, ["x"])])),
    ]
    tensors = [("a.weight", (8, 2), 0, np.arange(16, dtype=np.float32).tobytes()),
               ("b.weight", (4,), 1, np.ones(4, dtype=np.float16).tobytes()),
               ("c.weight", (32, 2), 8, q8.tobytes())]
    return gguf_bytes(metadata, tensors)


def parse_bytes(data: bytes, path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return parse_header(mm, path)


def test_writer_output_reads_the_same_through_gguf_reader(tmp_path: Path) -> None:
    data, fields = sample_file()
    metadata, tensors = parse_bytes(data, tmp_path / "s.gguf")
    reader = gguf.GGUFReader(tmp_path / "s.gguf")
    want = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("GGUF.") and k != "general.nested"}  # gguf can't: nested
    assert {k: v for k, v in metadata.items() if k != "general.nested"} == want
    assert metadata["general.nested"] == [[1, 2], ["x"]]
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in reader.tensors] == [
        (i.name, i.qtype, i.offset, i.nbytes) for i in tensors.values()]
    assert tensors["c.weight"].shape == (2, 32) and fields.header_end < tensors["a.weight"].offset
