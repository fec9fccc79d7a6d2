"""create_app(async_engine, settings) -> FastAPI: routes, errors, guard, lifespan.

Everything the handlers need sits on ``app.state.server`` (a ``ServerState``).
The guard middleware runs before routing and body parsing: it answers 401 when
an API key is configured and the bearer token is missing or wrong, and 413 when
the body is over the size limit (by Content-Length, or while reading a chunked
body, which it buffers and then replays to the app). Before such an early answer it
reads and discards the rest of the body (up to ``drain_limit`` bytes): closing a
socket that still holds unread request data makes the kernel reset the connection,
and the client would see that reset instead of the 413/401 body.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server import routes_misc, routes_openai, routes_ui
from roseinfer.server.errors import APIError, install_error_handlers
from roseinfer.server.metrics import ServerMetrics
from roseinfer.server.state import ServerSettings, ServerState
from roseinfer.server.ui import STATIC_DIR
from roseinfer.server.ui.assets import UiAssets

# Open without an API key: probes and scrapers.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/ping"})
# An early 401/413 first drains this much of the body (at least 4x the size limit);
# a longer body is cut off with the connection (the client may then see a reset).
MIN_DRAIN_BYTES = 64 << 20


class GuardMiddleware:
    """API-key check and body-size limit, in front of the whole app."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.api_key = settings.api_key
        self.ui = settings.ui  # the UI's page and files are public too (routes_ui)
        self.max_body = settings.max_body_bytes
        self.drain_limit = max(MIN_DRAIN_BYTES, 4 * settings.max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and not self._public(scope["path"]):
            if not self._authorized(scope):
                error = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer "
                                 "<key>'.", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await self._reject(error, scope, receive, send)
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = _header(scope, b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                await self._reject(self._too_large(), scope, receive, send)
                return
            body, drained = await self._read_body(scope, receive)
            if body is None:
                await self._answer(self._too_large(), scope, receive, send, drained)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _public(self, path: str) -> bool:
        return path in PUBLIC_PATHS or (self.ui and routes_ui.is_public(path))

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        return hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes | None, bool]:
        """(the body, True), or (None, whether the rest was drained) when it is too large."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), True
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_body:
                return None, not more or await self._drain(scope, receive, size)
            chunks.append(chunk)
            if not more:
                return b"".join(chunks), True

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than {self.max_body} bytes.",
                        code="request_too_large")

    async def _reject(self, error: APIError, scope: Scope, receive: Receive,
                      send: Send) -> None:
        """Answer ``error`` before reading the body: drain it first, so that the client
        gets the answer rather than a reset."""
        await self._answer(error, scope, receive, send, await self._drain(scope, receive, 0))

    @staticmethod
    async def _answer(error: APIError, scope: Scope, receive: Receive, send: Send,
                      drained: bool) -> None:
        if not drained or error.status_code == 413:
            error.headers["Connection"] = "close"
        await error.response()(scope, receive, send)

    async def _drain(self, scope: Scope, receive: Receive, read: int) -> bool:
        """Read and discard the rest of the body; False when it was left unread."""
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.drain_limit:
            return False
        expect = (_header(scope, b"expect") or "").lower()
        if expect == "100-continue" and read == 0:
            return False  # the client sends no body before a 100: nothing is pending
        while read <= self.drain_limit:
            message = await receive()
            if message["type"] == "http.disconnect":
                return True
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect

    return replay


def create_app(async_engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    """The HTTP app over a (started or not yet started) AsyncEngine."""
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="roseinfer", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    metrics = ServerMetrics(async_engine, settings.served_model_names[0])
    app.state.server = ServerState(async_engine, settings, metrics)
    install_error_handlers(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_misc.router)
    if settings.ui:
        app.include_router(routes_ui.build_router(UiAssets(STATIC_DIR)))
    app.add_middleware(GuardMiddleware, settings=settings)
    return app
