"""A minimal streaming HTTP/1.1 client for the serving benchmark: POST JSON, yield SSE
``data:`` payloads as they arrive.

The benchmark client shares the machine with the server it measures, so its own CPU
cost per streamed chunk matters: this reads the socket with asyncio streams and parses
chunked transfer encoding and SSE framing directly (a few microseconds per event),
where a general-purpose HTTP client spends about half a millisecond.  One connection
per request (``Connection: close``); ``http://`` and ``https://`` URLs.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    """The server answered with a status other than 200."""


async def post_sse(url: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
    """POST ``body`` as JSON to ``url``; yield each SSE event's ``data:`` payload (bytes)."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if secure else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    reader, writer = await asyncio.open_connection(
        host, port, ssl=ssl.create_default_context() if secure else None
    )
    try:
        payload = json.dumps(body).encode()
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in header_lines if line)}
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if status != 200:
            text = await _read_body(reader, headers, chunked)
            raise HTTPStatusError(f"HTTP {status}: {text[:200]!r}")
        buffer = b""
        async for piece in body_pieces(reader, chunked):
            buffer += piece
            while (end := buffer.find(b"\n\n")) >= 0:
                event, buffer = buffer[:end], buffer[end + 2:]
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].strip()
    finally:
        writer.close()


async def body_pieces(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    if not chunked:  # streamed until the server closes the connection
        while piece := await reader.read(65536):
            yield piece
        return
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF after each chunk


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str],
                     chunked: bool) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return b"".join([p async for p in body_pieces(reader, chunked)])
