"""Fuzz the GGUF header reader: valid small files mutated (truncated, bytes flipped, counts
/ lengths / dims / offsets overwritten with huge or odd values, alignment 0 and odd,
unknown value and tensor types, deep arrays) either parse or raise one ValueError naming
the file — nothing else — and parsing never allocates more than a small multiple of the
file's size (tracemalloc peak). Files that parse are read tensor by tensor through
GGUFFile the same way."""

from __future__ import annotations

import mmap
import struct
import sys
import tracemalloc
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from test_gguf_header_writer import ARRAY, U8, Fields, gguf_bytes, sample_file  # noqa: E402

from roseinfer.model.gguf_header import parse_header  # noqa: E402
from roseinfer.model.gguf_loader import GGUFFile  # noqa: E402

ODD_U64 = [0, 1, 31, 2**31, 2**32, 2**40, 2**62, 2**63, 2**64 - 32, 2**64 - 1]
ODD_U32 = [0, 1, 4, 5, 8, 9, 12, 13, 34, 39, 41, 42, 2**31, 2**32 - 1]
PEAK_FACTOR, PEAK_SLACK = 16, 64 * 1024  # bytes allocated per file byte, plus a constant


def deep_file(depth: int) -> tuple[bytes, Fields]:
    """One metadata entry: ``depth`` nested arrays (written flat), then a tensor."""
    data, fields = gguf_bytes([("general.deep", ARRAY, (U8, []))],
                              [("t", (4,), 0, bytes(16))], alignment=None)
    start = fields.u64[2] + 8 + len("general.deep") + 4  # the array value
    end = start + 12
    nested = struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", U8, 0)
    shift = len(nested) - 12
    fields.u64 = [o if o < start else o + shift for o in fields.u64 if o < start or o >= end]
    fields.u32 = [o if o < start else o + shift for o in fields.u32 if o < start or o >= end]
    fields.dims = [o + shift for o in fields.dims]
    fields.offsets = [o + shift for o in fields.offsets]
    fields.header_end += shift
    body = data[:start] + nested + data[end:fields.header_end - shift]
    return body + bytes(-len(body) % 32) + bytes(16), fields


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data, fields = draw(st.one_of(st.just(sample_file()),
                                  st.integers(1, 8).map(deep_file)))
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):  # positions past the magic and version, mostly
        op = draw(st.sampled_from(["truncate", "byte", "u64", "u32", "dim", "offset",
                                   "alignment", "junk"]))
        if op == "truncate":  # never to nothing: an empty file cannot even be mmapped
            if len(out) > 1:
                del out[draw(st.integers(min(8, len(out) - 1), len(out) - 1)):]
        elif op == "byte":
            out[draw(st.integers(min(8, len(out) - 1), len(out) - 1))] = draw(
                st.integers(0, 255))
        elif op == "junk":
            at = draw(st.integers(min(8, len(out)), max(len(out) - 8, 8)))
            out[at:at + 8] = draw(st.binary(min_size=8, max_size=8))
        else:
            offsets = {"u64": fields.u64, "u32": fields.u32, "dim": fields.dims,
                       "offset": fields.offsets,
                       "alignment": [fields.alignment] if fields.alignment else []}[op]
            if not offsets:
                continue
            at = draw(st.sampled_from(offsets))
            fmt = "I" if op in ("u32", "alignment") else "Q"
            odd = ODD_U32 if fmt == "I" else ODD_U64 + [len(out), len(out) + 1]
            value = draw(st.one_of(st.sampled_from(odd),
                                   st.integers(0, 2**32 - 1 if fmt == "I" else 2**64 - 1)))
            if at + struct.calcsize(fmt) <= len(out):
                struct.pack_into("<" + fmt, out, at, value)
    return bytes(out)


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(data=mutated())
def test_mutated_headers_parse_or_raise_value_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        tracemalloc.start()
        try:
            parse_header(mm, path)
        except ValueError as exc:
            assert str(path) in str(exc), exc
            part = str(exc).partition("malformed GGUF ")[2].split(" ")[0]
            event(f"refused: {part or 'magic / version'}")
            return
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < PEAK_FACTOR * len(data) + PEAK_SLACK, (peak, len(data))
    event("parsed")
    gf = GGUFFile(path)
    for info in gf.tensors.values():
        try:
            gf.read_tensor(info)
        except ValueError as exc:
            assert str(path) in str(exc) and repr(info.name) in str(exc), exc
