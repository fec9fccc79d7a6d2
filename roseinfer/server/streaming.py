"""Disconnect-aware responses: a client that goes away aborts its request at once.

``StreamResponse`` sends an async iterator of text chunks while a second task waits
for ``http.disconnect``; whichever ends first cancels the other, and ``on_close``
(the request's abort) always runs — also when the client leaves before the first
token, while the request is still waiting or prefilling. ``until_disconnect`` does
the same for non-streaming handlers.

A client that stops reading is a stall: uvicorn applies flow control, so once the
socket's buffer is above its high-water mark the ASGI ``send()`` stays pending. A send
not done within the stall timeout (``ServerSettings.stream_stall_timeout_s``,
``--stream-stall-timeout``) ends the stream: the request is aborted (its KV blocks
freed) and the abort counted (``roseinfer:stream_aborts_total{reason="stalled"}``).
While a send waits, nothing more is taken from the engine's stream, whose unsent
deltas are merged (``RequestStream``): what a slow client costs stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

T = TypeVar("T")
logger = logging.getLogger(__name__)

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


class StreamStalledError(Exception):
    """The client read nothing for the stall timeout: a send stayed pending."""


def _app_guard(scope: Scope) -> tuple[float | None, Callable[[str], None] | None]:
    """The stall timeout and abort counter of the app serving ``scope`` (its
    ``app.state.server``: settings and metrics), when it has them."""
    server = getattr(getattr(scope.get("app"), "state", None), "server", None)
    settings = getattr(server, "settings", None)
    metrics = getattr(server, "metrics", None)
    return (getattr(settings, "stream_stall_timeout_s", None),
            getattr(metrics, "stream_aborted", None))


class StreamResponse(Response):
    """Streams text chunks; stops and calls ``on_close`` as soon as the client leaves
    or stalls (``stall_timeout`` s without a completed send; None: the app's setting).
    ``on_abort(reason)`` hears why a stream ended early: ``"stalled"``/``"disconnected"``.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], *,
                 media_type: str = "text/event-stream",
                 headers: Mapping[str, str] | None = None,
                 stall_timeout: float | None = None,
                 on_abort: Callable[[str], None] | None = None) -> None:
        self.content = content
        self.on_close = on_close
        self.stall_timeout = stall_timeout
        self.on_abort = on_abort
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        self.init_headers({**base, **(headers or {})})

    async def _send(self, send: Send, message: Message) -> None:
        if self.stall_timeout is None or self.stall_timeout <= 0:
            await send(message)
            return
        try:
            async with asyncio.timeout(self.stall_timeout):
                await send(message)
        except TimeoutError:
            raise StreamStalledError from None

    async def _send_all(self, send: Send) -> None:
        await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
        async for chunk in self.content:
            await self._send(send, {"type": "http.response.body",
                                    "body": chunk.encode("utf-8"), "more_body": True})
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout, counter = _app_guard(scope)
        if self.stall_timeout is None:
            self.stall_timeout = timeout
        on_abort = self.on_abort or counter
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        reason = None
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not sender.done():
                reason = "disconnected"
            elif isinstance(sender.exception(), StreamStalledError):
                reason = "stalled"
                logger.warning("stream to %s stalled: nothing read for %.1f s; aborted",
                               scope.get("client"), self.stall_timeout)
            else:
                sender.result()  # re-raise a failure of the stream itself
        finally:
            await _cancel(sender, watcher)
            aclose = getattr(self.content, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            self.on_close()
            if reason is not None and on_abort is not None:
                on_abort(reason)
