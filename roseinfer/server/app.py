"""create_app(async_engine, settings) -> FastAPI: routes, errors, guard, lifespan.

Everything the handlers need sits on ``app.state.server`` (a ``ServerState``).
The guard middleware runs before routing and body parsing: it answers 401 when
an API key is configured and the bearer token is missing or wrong, and 413 when
the body is over the size limit (by Content-Length, or while reading a chunked
body, which it buffers and then replays to the app).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server import routes_misc, routes_openai
from roseinfer.server.errors import APIError, install_error_handlers
from roseinfer.server.metrics import ServerMetrics
from roseinfer.server.state import ServerSettings, ServerState

# Open without an API key: probes and scrapers.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/ping"})


class GuardMiddleware:
    """API-key check and body-size limit, in front of the whole app."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.api_key = settings.api_key
        self.max_body = settings.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS:
            if not self._authorized(scope):
                await APIError(401, "Invalid or missing API key: send 'Authorization: Bearer "
                               "<key>'.", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"}).response()(
                                   scope, receive, send)
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = _header(scope, b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                await self._too_large(scope, receive, send)
                return
            body = await self._read_body(receive)
            if body is None:
                await self._too_large(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        return hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = APIError(413, f"The request body is larger than {self.max_body} bytes.",
                            code="request_too_large", headers={"Connection": "close"}).response()
        await response(scope, receive, send)


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
    app.add_middleware(GuardMiddleware, settings=settings)
    return app
