"""Host and Origin checks, and CORS, in front of every route (the API, the web UI,
``/metrics``, ``/health``): the defence against DNS rebinding and cross-site requests
when no API key is set.

Pure ASGI (Starlette's BaseHTTPMiddleware would buffer streamed responses). It runs
outermost, before the API-key check, so that a CORS preflight (which never carries
the key) is answered here. The rules are ``AccessSettings``'s (``access.py``); a refusal
is a 403 with the OpenAI error body, sent after draining the request body
(``early_answer``).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from roseinfer.server.access import AccessSettings
from roseinfer.server.early_answer import header, reject
from roseinfer.server.errors import APIError

ALLOW_METHODS = b"GET, POST, OPTIONS"
DEFAULT_ALLOW_HEADERS = b"authorization, content-type"
PREFLIGHT_MAX_AGE_S = b"600"
# Header names a preflight may ask for: tokens separated by commas (RFC 9110 field names).
_HEADER_LIST = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*$")


class HostGuardMiddleware:
    """Refuses foreign Host names and Origins; adds CORS headers for listed origins."""

    def __init__(self, app: ASGIApp, access: AccessSettings, drain_limit: int) -> None:
        self.app = app
        self.access = access
        self.drain_limit = drain_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = header(scope, b"host")
        if not self.access.host_allowed(host):
            error = APIError(403, f"Host {host!r} is not served here: this server answers "
                             "loopback names and those given with --allowed-hosts.",
                             code="host_not_allowed")
            await reject(error, scope, receive, send, self.drain_limit)
            return
        origin = header(scope, b"origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if not self.access.origin_allowed(origin, host):
            error = APIError(403, f"Origin {origin!r} may not use this server: list it with "
                             "--allowed-origins to allow cross-origin requests from it.",
                             code="origin_not_allowed")
            await reject(error, scope, receive, send, self.drain_limit)
            return
        cors = self.access.origin_listed(origin)
        if scope["method"] == "OPTIONS" and header(scope, b"access-control-request-method"):
            await self._preflight(origin, scope, receive, send)
            return
        if not cors:
            await self.app(scope, receive, send)
            return
        extra = [(b"access-control-allow-origin", origin.encode("latin-1")),
                 (b"vary", b"Origin")]

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, origin: str, scope: Scope, receive: Receive, send: Send) -> None:
        """204 with what the browser may send (methods, the headers it asked for)."""
        asked = (header(scope, b"access-control-request-headers") or "").strip().encode(
            "latin-1")
        allow_headers = asked if asked and _HEADER_LIST.match(asked) else DEFAULT_ALLOW_HEADERS
        await send({"type": "http.response.start", "status": 204, "headers": [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-methods", ALLOW_METHODS),
            (b"access-control-allow-headers", allow_headers),
            (b"access-control-max-age", PREFLIGHT_MAX_AGE_S),
            (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
        ]})
        await send({"type": "http.response.body", "body": b""})
