"""One KV block on disk: its format, encoded and checked.

Layout (little-endian)::

    magic  b"RIKV"                                   4 bytes
    version                                          u32
    header length H                                  u32
    payload length P                                 u64
    CRC-32 of header + payload                       u32
    header: UTF-8 JSON {identity, key, parent, tokens, dtype, shape}, padded with
            spaces so the payload starts at a multiple of 64 bytes      H bytes
    payload: the block's K/V, [layers, 2 (K, V), block_size, kv_heads, head_dim]
             in the pool's dtype, C order                              P bytes

A file is accepted only when every field matches what the reader expects (same
identity, key, parent key, token ids, dtype and shape), its size is exactly 24 + H + P
and the CRC matches: a truncated, corrupt or foreign file is rejected, never loaded.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"RIKV"
VERSION = 1
_PREFIX = struct.Struct("<4sIIQI")  # magic, version, header len, payload len, crc32
_MAX_HEADER = 1 << 20
_ALIGN = 64


class BlockFileError(ValueError):
    """A block file that must not be loaded (the message says why)."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    identity: str  # the model identity digest (``identity.model_identity``)
    key: str  # the block's chain hash, hex
    parent: str | None  # the parent block's chain hash, hex (None: first block)
    tokens: tuple[int, ...]  # the block's token ids
    dtype: str  # "float16", "float32", ...
    shape: tuple[int, ...]  # [layers, 2, block_size, kv_heads, head_dim]

    def to_json(self) -> bytes:
        return json.dumps({"identity": self.identity, "key": self.key, "parent": self.parent,
                           "tokens": list(self.tokens), "dtype": self.dtype,
                           "shape": list(self.shape)}, separators=(",", ":")).encode()


def encode(header: BlockHeader, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The file's bytes, in pieces to write one after the other (no payload copy)."""
    head = header.to_json()
    head += b" " * (-(_PREFIX.size + len(head)) % _ALIGN)  # the payload starts aligned
    crc = zlib.crc32(payload, zlib.crc32(head))
    return [_PREFIX.pack(MAGIC, VERSION, len(head), len(payload), crc), head, payload]


def decode(data: bytes | bytearray, expected: BlockHeader, payload_bytes: int) -> memoryview:
    """The payload of a file's ``data`` if it is the block ``expected`` describes and
    intact; else ``BlockFileError``."""
    if len(data) < _PREFIX.size:
        raise BlockFileError(f"truncated: {len(data)} bytes")
    magic, version, head_len, pay_len, crc = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise BlockFileError(f"not a version-{VERSION} block file")
    if head_len > _MAX_HEADER or pay_len != payload_bytes:
        raise BlockFileError(f"unexpected sizes (header {head_len}, payload {pay_len})")
    if len(data) != _PREFIX.size + head_len + pay_len:
        raise BlockFileError(f"truncated or padded: {len(data)} bytes, expected "
                             f"{_PREFIX.size + head_len + pay_len}")
    view = memoryview(data)
    head = view[_PREFIX.size:_PREFIX.size + head_len]
    payload = view[_PREFIX.size + head_len:]
    if zlib.crc32(payload, zlib.crc32(head)) != crc:
        raise BlockFileError("checksum mismatch")
    try:
        fields = json.loads(bytes(head))
        got = BlockHeader(fields["identity"], fields["key"], fields["parent"],
                          tuple(fields["tokens"]), fields["dtype"], tuple(fields["shape"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise BlockFileError(f"bad header: {exc}") from None
    if got != expected:
        what = next(name for name in BlockHeader.__slots__
                    if getattr(got, name) != getattr(expected, name))
        raise BlockFileError(f"another block or model (its {what} differs)")
    return payload
