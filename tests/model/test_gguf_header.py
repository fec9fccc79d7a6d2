"""Malformed GGUF headers are one ValueError naming the file and the field (metadata key,
tensor name or header part): truncation anywhere, huge counts and lengths, bad alignment,
unknown types, deep nesting, bad UTF-8, duplicates, bad tensor dims / types / offsets;
what the loader does after the header fails the same way; the default model's header
still parses fast."""

from __future__ import annotations

import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_gguf_header_writer import (  # noqa: E402
    ARRAY,
    STRING,
    U8,
    U32,
    gguf_bytes,
    parse_bytes,
    sample_file,
)

from roseinfer.model.gguf_header import MAX_ARRAY_DEPTH, parse_header  # noqa: E402
from roseinfer.model.gguf_loader import GGUFFile  # noqa: E402
from roseinfer.model.loader import default_model_path  # noqa: E402

HUGE = [2**64 - 1, 2**63, 2**40]
F32_4 = np.zeros(4, dtype=np.float32).tobytes()


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<" + fmt, out, offset, value)
    return bytes(out)


def refused(tmp_path: Path, data: bytes, *fragments: str) -> str:
    path = tmp_path / "bad.gguf"
    with pytest.raises(ValueError) as err:
        parse_bytes(data, path)
    message = str(err.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def one_kv(key: str, vtype: int, value: object) -> tuple[bytes, list[int]]:
    """A file with one metadata entry and no tensors; the u64 offsets (n_tensors, n_kv,
    key length, then the value's counts / lengths)."""
    data, fields = gguf_bytes([(key, vtype, value)], [], alignment=None)
    return data, fields.u64


def one_tensor(dims: tuple[int, ...], qtype: int = 0, data: bytes = F32_4,
               name: bytes | str = "t.weight", alignment: int | None = 32
               ) -> tuple[bytes, object]:
    return gguf_bytes([], [(name, dims, qtype, data)], alignment=alignment)


def test_every_truncation_of_the_header_is_refused(tmp_path: Path) -> None:
    data, fields = sample_file()
    for cut in range(1, fields.header_end):  # (an empty file cannot be mmapped at all)
        message = refused(tmp_path, data[:cut])
        assert "GGUF" in message


def test_truncated_tensor_data_is_refused(tmp_path: Path) -> None:
    data, _ = sample_file()
    refused(tmp_path, data[:-1], "tensor 'c.weight'", "past the end")


@pytest.mark.parametrize("value", [0, 3, 48, 2**31 + 1])
def test_alignment_must_be_a_power_of_two(tmp_path: Path, value: int) -> None:
    data, fields = one_tensor((4,))
    refused(tmp_path, patched(data, fields.alignment, "I", value), "general.alignment",
            "power of two")


def test_alignment_must_be_an_integer(tmp_path: Path) -> None:
    data, _ = gguf_bytes([("general.alignment", STRING, "32")], [], alignment=None)
    refused(tmp_path, data, "general.alignment")


@pytest.mark.parametrize("which, where", [(0, "header counts"), (1, "header counts"),
                                          (2, "metadata key #0")])
@pytest.mark.parametrize("value", HUGE)
def test_huge_header_counts(tmp_path: Path, which: int, where: str, value: int) -> None:
    data, u64 = one_kv("general.name", STRING, "x")
    refused(tmp_path, patched(data, u64[which], "Q", value), where)


@pytest.mark.parametrize("vtype, value", [(STRING, "x"), (ARRAY, (STRING, ["a", "b"])),
                                          (ARRAY, (U32, [1, 2])), (ARRAY, (ARRAY, [(U8, [1])]))])
@pytest.mark.parametrize("value_huge", HUGE)
def test_huge_value_lengths_name_the_key(tmp_path: Path, vtype: int, value: object,
                                         value_huge: int) -> None:
    data, u64 = one_kv("tokenizer.ggml.tokens", vtype, value)
    for offset in u64[3:]:  # every count / length inside the value
        refused(tmp_path, patched(data, offset, "Q", value_huge), "'tokenizer.ggml.tokens'")


@pytest.mark.parametrize("vtype, value", [(13, b"\0"), (2**32 - 1, b""), (ARRAY, (13, [])),
                                          (ARRAY, (ARRAY, [(77, [])]))])
def test_unknown_value_types_name_the_key(tmp_path: Path, vtype: int, value: object) -> None:
    data, _ = one_kv("general.odd", vtype, value)
    refused(tmp_path, data, "'general.odd'", "unknown")


@pytest.mark.parametrize("depth", [MAX_ARRAY_DEPTH + 1, 100_000])
def test_deep_arrays_are_refused_without_recursion(tmp_path: Path, depth: int) -> None:
    data, u64 = one_kv("general.deep", ARRAY, (U8, []))
    value_start = u64[2] + 8 + len("general.deep") + 4
    # depth - 1 arrays of one array each, then an empty u8 array (written flat: the
    # writer recurses)
    nested = struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", U8, 0)
    refused(tmp_path, data[:value_start] + nested, "'general.deep'", "nested")
    ok = (U8, [7])
    for _ in range(MAX_ARRAY_DEPTH - 1):
        ok = (ARRAY, [ok])
    metadata, _ = parse_bytes(one_kv("general.deep", ARRAY, ok)[0], tmp_path / "ok.gguf")
    assert str(metadata["general.deep"]) == "[" * MAX_ARRAY_DEPTH + "7" + "]" * MAX_ARRAY_DEPTH


@pytest.mark.parametrize("make, where", [
    (lambda: one_kv(b"bad\xff", U8, 1)[0], "metadata key #0"),
    (lambda: one_kv("general.s", STRING, b"\xc3")[0], "'general.s'"),
    (lambda: one_kv("tokenizer.ggml.tokens", ARRAY, (STRING, [b"ok", b"\xed\xa0\x80"]))[0],
     "'tokenizer.ggml.tokens'"),
    (lambda: one_tensor((4,), name=b"t\x80")[0], "tensor #0"),
])
def test_strings_must_be_utf8(tmp_path: Path, make: Callable[[], bytes], where: str) -> None:
    refused(tmp_path, make(), where, "UTF-8")


def test_duplicates_are_refused(tmp_path: Path) -> None:
    data, _ = gguf_bytes([("general.a", U8, 1), ("general.a", U8, 2)], [])
    refused(tmp_path, data, "'general.a'", "duplicate")
    data, _ = gguf_bytes([], [("t", (4,), 0, F32_4), ("t", (4,), 0, F32_4)])
    refused(tmp_path, data, "tensor 't'", "duplicate")


@pytest.mark.parametrize("n_dims", [0, 5, 2**32 - 1])
def test_n_dims_bounded(tmp_path: Path, n_dims: int) -> None:
    data, fields = one_tensor((4,))
    refused(tmp_path, patched(data, fields.u32[-2], "I", n_dims), "tensor 't.weight'", "n_dims")


@pytest.mark.parametrize("dim", [0, 2**63, 2**64 - 1, 2**40])
def test_dims_validated(tmp_path: Path, dim: int) -> None:
    data, fields = one_tensor((4, 1))
    refused(tmp_path, patched(data, fields.dims[1], "Q", dim), "tensor 't.weight'")


@pytest.mark.parametrize("qtype", [4, 5, 99, 2**32 - 1])
def test_unknown_tensor_types(tmp_path: Path, qtype: int) -> None:
    data, _ = one_tensor((4,), qtype=qtype)
    refused(tmp_path, data, "tensor 't.weight'", "type")


def test_rows_must_hold_whole_blocks(tmp_path: Path) -> None:
    data, _ = one_tensor((16,), qtype=8, data=bytes(34))  # Q8_0 blocks are 32 values
    refused(tmp_path, data, "tensor 't.weight'", "block size 32")


@pytest.mark.parametrize("offset, why", [(4, "multiple of the alignment"),
                                         (2**64 - 32, "past the end"), (64, "past the end")])
def test_offsets_validated(tmp_path: Path, offset: int, why: str) -> None:
    data, fields = one_tensor((4,))
    refused(tmp_path, patched(data, fields.offsets[0], "Q", offset), "tensor 't.weight'", why)


def test_a_type_gguf_cannot_dequantize_is_a_value_error_naming_the_tensor(
        tmp_path: Path) -> None:
    data, _ = one_tensor((32,), qtype=9, data=bytes(40))  # Q8_1: sizes known, no dequantizer
    path = tmp_path / "q81.gguf"
    path.write_bytes(data)
    gf = GGUFFile(path)
    with pytest.raises(ValueError, match=r"tensor 't\.weight' has type Q8_1") as err:
        gf.read_tensor(gf.tensors["t.weight"])
    assert str(path) in str(err.value)


def test_valid_tensors_read_back(tmp_path: Path) -> None:
    data, _ = sample_file()
    path = tmp_path / "ok.gguf"
    path.write_bytes(data)
    gf = GGUFFile(path)
    assert gf.read_tensor(gf.tensors["a.weight"]).flatten().tolist() == list(range(16))
    q8 = gf.read_tensor(gf.tensors["c.weight"])
    assert q8.shape == (2, 32) and q8[1].tolist() == [0.5 * i for i in range(32)]


def test_default_model_header_parses_fast() -> None:
    import mmap

    path = default_model_path()
    best = float("inf")
    for _ in range(3):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            start = time.perf_counter()
            metadata, tensors = parse_header(mm, path)
            best = min(best, time.perf_counter() - start)
            del metadata, tensors
    assert best < 1.0, best  # ~0.15 s measured on 2 shared cores (GGUFReader: ~4 s)


def test_an_empty_file_is_the_same_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf: malformed GGUF header: the file is empty"):
        GGUFFile(empty)
