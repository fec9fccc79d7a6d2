"""Disconnect-aware responses: a client that goes away aborts its request at once.

``StreamResponse`` sends an async iterator of text chunks while a second task waits
for ``http.disconnect``; whichever ends first cancels the other, and ``on_close``
(the request's abort) always runs — also when the client leaves before the first
token, while the request is still waiting or prefilling. ``until_disconnect`` does
the same for non-streaming handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnectedError(Exception):
    """The client closed the connection before the response was ready."""


def sse(payload: str | Mapping[str, Any]) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(*tasks: asyncio.Future[Any]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def until_disconnect(work: Awaitable[T], receive: Receive,
                           on_disconnect: Callable[[], None]) -> T:
    """Await ``work``; if the client disconnects first, cancel it, call
    ``on_disconnect`` and raise ``ClientDisconnectedError``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        on_disconnect()
        raise ClientDisconnectedError
    finally:
        await _cancel(task, watcher)


class StreamResponse(Response):
    """Streams text chunks; stops and calls ``on_close`` as soon as the client leaves."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], *,
                 media_type: str = "text/event-stream",
                 headers: Mapping[str, str] | None = None) -> None:
        self.content = content
        self.on_close = on_close
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        self.init_headers({**base, **(headers or {})})

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.content:
            await send({"type": "http.response.body", "body": chunk.encode("utf-8"),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if sender.done():
                sender.result()  # re-raise a failure of the stream itself
        finally:
            await _cancel(sender, watcher)
            aclose = getattr(self.content, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            self.on_close()
