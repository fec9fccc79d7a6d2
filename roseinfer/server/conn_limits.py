"""Connection limits uvicorn lacks: a deadline for each request's head and body, and a
cap on open connections answered with the OpenAI-shaped 503.

uvicorn closes a keep-alive connection idle ``timeout_keep_alive`` seconds after a
response, but has no read timeout: a client that sends half its headers, or a body one
byte at a time, or nothing at all after connecting, holds its socket forever. Its
``limit_concurrency`` counts connections and tasks alike and answers a plain-text 503
one connection early. So ``serve`` runs uvicorn with a protocol of ours
(``server_config``): uvicorn's own HTTP protocol (httptools when installed, else h11)
plus ``_LimitsMixin``:

* a timer of ``request_timeout`` seconds starts when a connection opens and when a
  response ends (for the next request; the idle keep-alive timer usually closes it
  first), and when a request's first byte arrives if none is running; it stops when
  the request's body is complete. When it fires, a client that sent part of a request
  gets a 408 (OpenAI error body) and the connection closes; one that sent nothing is
  closed silently. It never cuts a response: a request received whole and being
  answered (a long stream) has no timer, and while reading is paused by flow control
  (a pipelined request waiting for the one before) the deadline is pushed back;
* a connection opened while ``max_connections`` others are open answers its request
  with a 503 (``Retry-After``, ``Connection: close``) after reading its body;
* each accepted socket's kernel send buffer is capped at ``send_buffer_bytes`` (64 KiB;
  Linux autotunes it up to 4 MiB otherwise) and the transport's own buffer pauses
  writing past ``write_buffer_bytes`` (16 KiB; asyncio's default is 64 KiB), so a
  client that stops reading fills them after kilobytes, uvicorn's flow control pauses
  the stream's ``send()``, the engine holds the request (backpressure: its reader is
  behind, ``engine/async_engine.py``) and the stream-stall timeout (``streaming.py``)
  sees it: the memory a stalled client can pin is bounded too. Token streams need a
  few KB/s, far below what 64 KiB in flight carries.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from roseinfer.server.early_answer import reject
from roseinfer.server.errors import APIError, error_body

logger = logging.getLogger("roseinfer.server")
OVER_CAPACITY_DRAIN_BYTES = 4 << 20


@dataclass(frozen=True)
class ConnectionLimits:
    request_timeout: float = 30.0  # s for a request's head and body to arrive
    max_connections: int | None = 512  # open connections; past it a 503
    send_buffer_bytes: int | None = 64 << 10  # each socket's SO_SNDBUF (None: the kernel's)
    write_buffer_bytes: int | None = 16 << 10  # the transport's high-water mark (None: 64 KiB)

    def __post_init__(self) -> None:
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


def _timeout_response(seconds: float) -> bytes:
    body = error_body(f"The request's headers and body did not arrive within {seconds:g} s.",
                      code="request_timeout")
    data = json.dumps(body).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(data)).encode() + b"\r\n\r\n"
            + data)


def _over_capacity_app(limit: int) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        error = APIError(503, f"The server has {limit} open connections, its limit "
                         "(--max-connections). Retry later.", code="too_many_connections",
                         headers={"Retry-After": "1", "Connection": "close"})
        await reject(error, scope, receive, send, OVER_CAPACITY_DRAIN_BYTES)

    return app


class _LimitsMixin:
    """The request deadline and the connection cap, over a uvicorn HTTP protocol."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._got_bytes = False  # part of a request arrived since the last one was whole

    # ------------------------------------------------------------ uvicorn's hooks
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if self.limits.send_buffer_bytes is not None and sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
            except OSError:  # not a TCP socket (a Unix socket in tests): keep its buffer
                pass
        if self.limits.write_buffer_bytes is not None:
            transport.set_write_buffer_limits(high=self.limits.write_buffer_bytes)
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) > cap:
            logger.warning("%d connections open, over --max-connections %d: answering 503",
                           len(self.connections), cap)
            self.app = _over_capacity_app(cap)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request, if one comes before keep-alive closes us

    # --------------------------------------------------------------- the deadline
    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.limits.request_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _request_received(self) -> None:
        """The request's head and body are all here: no deadline while it is answered."""
        self._got_bytes = False
        self._disarm()

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.flow is not None and self.flow.read_paused:
            self._arm()  # we stopped reading (flow control, pipelining): not the client's fault
            return
        cycle = self.cycle
        if cycle is not None and not cycle.more_body and not cycle.response_complete:
            return  # received whole, being answered; on_response_complete re-arms
        if self._got_bytes and (cycle is None or cycle.response_complete
                                or not cycle.response_started):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app's next receive() sees a disconnect
                cycle.message_event.set()
            self.transport.write(_timeout_response(self.limits.request_timeout))
        self.transport.close()


class LimitedH11Protocol(_LimitsMixin, H11Protocol):
    """uvicorn's h11 protocol with ``ConnectionLimits``."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request
        self._sync()

    def _sync(self) -> None:
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.DONE or state is h11.MUST_CLOSE:
            self._request_received()
        elif state is h11.SEND_BODY:
            self._arm()


@functools.cache
def _httptools_protocol() -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with ``ConnectionLimits`` (ImportError without it)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(_LimitsMixin, HttpToolsProtocol):
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._request_received()

    return LimitedHttpToolsProtocol


def protocol_class(impl: str = "auto") -> type[asyncio.Protocol]:
    """``auto``: httptools when installed (as uvicorn picks), else h11."""
    if impl in ("auto", "httptools"):
        try:
            return _httptools_protocol()
        except ImportError:
            if impl == "httptools":
                raise
    if impl != "auto" and impl != "h11":
        raise ValueError(f"unknown HTTP implementation {impl!r}")
    return LimitedH11Protocol


def server_config(app: Any, limits: ConnectionLimits, impl: str = "auto",
                  **uvicorn_kw: Any) -> Any:
    """``uvicorn.Config`` for ``app`` with our protocol (uvicorn's ``limit_concurrency``
    left off: ``max_connections`` replaces it)."""
    import uvicorn

    http = functools.partial(protocol_class(impl), limits=limits)
    return uvicorn.Config(app, http=http, limit_concurrency=None, **uvicorn_kw)  # type: ignore[arg-type]
