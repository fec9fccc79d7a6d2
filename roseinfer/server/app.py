"""create_app(async_engine, settings) -> FastAPI: routes, errors, guards, lifespan.

Everything the handlers need sits on ``app.state.server`` (a ``ServerState``).
Two pure-ASGI guards run before routing and body parsing. Outermost, the
``HostGuardMiddleware`` (host_guard.py) refuses foreign Host names and Origins and
answers CORS preflights. Then the ``GuardMiddleware`` answers 401 when an API key is
configured and the bearer token (or Anthropic's ``x-api-key``) is missing or wrong
(``/health`` and ``/ping`` stay open, ``/metrics`` too with
``AccessSettings.public_metrics``, and the UI's page and files), and 413 when the body
is over the size limit (by Content-Length, or while reading a chunked body, which it
buffers and then replays to the app); on the Anthropic routes both answer in
Anthropic's error shape. Early answers drain the body first (``early_answer``). A
client that disconnects before its body is complete never reaches the app.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.server import (
    routes_chat,
    routes_embeddings,
    routes_lora,
    routes_misc,
    routes_openai,
    routes_ui,
)
from roseinfer.server.anthropic import routes as anthropic_routes
from roseinfer.server.anthropic.errors import shaped_for
from roseinfer.server.early_answer import answer, drain, header, reject
from roseinfer.server.errors import APIError, install_error_handlers
from roseinfer.server.host_guard import HostGuardMiddleware
from roseinfer.server.lora_registry import LoRASettings
from roseinfer.server.metrics import ServerMetrics
from roseinfer.server.prompt_gate import PromptGate
from roseinfer.server.responses_api import routes as routes_responses
from roseinfer.server.responses_api.store import ResponseStore
from roseinfer.server.state import ServerSettings, ServerState
from roseinfer.server.ui import STATIC_DIR
from roseinfer.server.ui.assets import UiAssets

# Open without an API key: probes (and /metrics with AccessSettings.public_metrics).
PUBLIC_PATHS = frozenset({"/health", "/ping"})
METRICS_PATH = "/metrics"
# An early 401/403/413 first drains this much of the body (at least 4x the size limit);
# a longer body is cut off with the connection (the client may then see a reset).
MIN_DRAIN_BYTES = 64 << 20


def drain_limit(settings: ServerSettings) -> int:
    return max(MIN_DRAIN_BYTES, 4 * settings.max_body_bytes)


class GuardMiddleware:
    """API-key check and body-size limit, in front of the app (behind the Host guard)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.api_key = settings.api_key
        self.ui = settings.ui  # the UI's page and files are public too (routes_ui)
        self.public_metrics = settings.access.public_metrics
        self.max_body = settings.max_body_bytes
        self.drain_limit = drain_limit(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and not self._public(scope["path"]):
            if not self._authorized(scope):
                error = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer "
                                 "<key>' (or 'x-api-key: <key>').", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await reject(shaped_for(scope["path"], error), scope, receive, send,
                             self.drain_limit)
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = header(scope, b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                await reject(self._too_large(scope), scope, receive, send, self.drain_limit)
                return
            body, drained, gone = await self._read_body(scope, receive)
            if gone:
                return  # the client left (or timed out) before its body was complete
            if body is None:
                await answer(self._too_large(scope), scope, receive, send, drained)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _public(self, path: str) -> bool:
        return (path in PUBLIC_PATHS or (path == METRICS_PATH and self.public_metrics)
                or (self.ui and routes_ui.is_public(path)))

    def _authorized(self, scope: Scope) -> bool:
        """A right ``Authorization: Bearer`` token or Anthropic's ``x-api-key``."""
        scheme, _, token = (header(scope, b"authorization") or "").partition(" ")
        keys = [header(scope, b"x-api-key"), token if scheme.lower() == "bearer" else None]
        return any(hmac.compare_digest(key.strip().encode(), self.api_key.encode())
                   for key in keys if key)

    async def _read_body(self, scope: Scope,
                         receive: Receive) -> tuple[bytes | None, bool, bool]:
        """(body, True, False); (None, whether the rest was drained, False) when it is too
        large; (None, True, True) when the client disconnected first."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, True, True
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_body:
                drained = not more or await drain(scope, receive, size, self.drain_limit)
                return None, drained, False
            chunks.append(chunk)
            if not more:
                return b"".join(chunks), True, False

    def _too_large(self, scope: Scope) -> APIError:
        return shaped_for(scope["path"], APIError(
            413, f"The request body is larger than {self.max_body} bytes.",
            code="request_too_large"))


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect

    return replay


def create_app(async_engine: AsyncEngine, settings: ServerSettings | None = None,
               lora: LoRASettings | None = None) -> FastAPI:
    """The HTTP app over a (started or not yet started) AsyncEngine; ``lora``: the
    adapters and run-time loading rules when the engine has ``enable_lora``."""
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
    app.state.prompt_gate = PromptGate()
    app.state.responses_store = ResponseStore(settings.responses_store_size,
                                              settings.responses_store_bytes)
    install_error_handlers(app)
    app.include_router(routes_chat.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_embeddings.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_misc.router)
    app.include_router(anthropic_routes.router)
    routes_lora.install(app, async_engine, lora)  # /v1/*_lora_adapter with enable_lora
    if settings.ui:
        app.include_router(routes_ui.build_router(UiAssets(STATIC_DIR)))
    app.add_middleware(GuardMiddleware, settings=settings)
    app.add_middleware(HostGuardMiddleware, access=settings.access,  # outermost
                       drain_limit=drain_limit(settings))
    return app
