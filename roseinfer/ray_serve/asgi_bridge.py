"""Run one HTTP request through an in-process ASGI app and stream its answer back.

A replica does not open a port: the ingress hands it the request as a plain record
(``ForwardedRequest``: method, path, headers, body) through a Ray Serve handle, and
``call_app`` plays the part of the HTTP server for roseinfer's own FastAPI app. It
yields a ``ResponseHead`` (status and headers) when the app starts its answer, then
each body chunk as the app sends it, so an SSE stream reaches the ingress chunk by
chunk. When the caller stops iterating early (the client left, Ray cancelled the
call), the app's ``receive`` answers ``http.disconnect``: roseinfer's handlers see
the client leave and abort the request in the engine, exactly as behind uvicorn.

Nothing here imports Ray: the bridge is tested with a plain FastAPI app.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

Headers = tuple[tuple[bytes, bytes], ...]
# After the answer ended (or the caller left) the app gets this long to finish.
APP_EXIT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """One HTTP request as the ingress received it (plus its routing key)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: Headers = ()
    body: bytes = b""
    # Chain hashes of the prompt's first full KV blocks (``prefix_keys``), read by the
    # request router; empty when the body has no prompt the router could tokenize.
    prefix_hashes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    headers: Headers

    def header(self, name: bytes) -> bytes | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def is_event_stream(self) -> bool:
        return (self.header(b"content-type") or b"").startswith(b"text/event-stream")


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": request.method, "scheme": "http",
        "path": request.path, "raw_path": request.path.encode("latin-1"),
        "query_string": request.query_string, "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }


async def call_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
    """Serve ``request`` with ``app``: a ``ResponseHead``, then the non-empty body chunks."""
    messages: asyncio.Queue[Message | BaseException | None] = asyncio.Queue()
    gone = asyncio.Event()  # the answer ended or the caller left: receive says disconnect
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            raise OSError("the caller is gone")  # what a server does on a closed socket
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader below
            await messages.put(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            await messages.put(None)

    task = asyncio.ensure_future(run())
    started = False
    try:
        while True:
            message = await messages.get()
            if message is None:
                if not started:
                    raise RuntimeError("the app returned without answering")
                return
            if isinstance(message, BaseException):
                raise message
            if message["type"] == "http.response.start":
                started = True
                yield ResponseHead(message["status"], tuple(
                    (bytes(k), bytes(v)) for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        await _finish(task)


async def _finish(task: asyncio.Future[None]) -> None:
    """Let the app wind down (it sees the disconnect and aborts its request)."""
    try:
        if not task.done():
            await asyncio.wait({task}, timeout=APP_EXIT_TIMEOUT_S)
    finally:
        if not task.done():
            task.cancel()
