"""The ingress's own checks, before it reads or parses a request body.

The ingress tokenizes prompts (chat template included) to route them, so a request it
reads is work done before any replica's ``GuardMiddleware`` sees it. These checks run
first, on the head alone: the API key (``/health`` and ``/ping`` stay open; everything
else, ``/ray/replicas`` and ``/metrics`` included, needs it when a key is set; ``/metrics``
is open with ``public_metrics``) and the
size limit by ``Content-Length`` (413 at once). A body without a length is counted as
it arrives and cut off at the limit. Early answers close the connection: the body the
client may still be sending is never read.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse

from roseinfer.server.errors import error_body

PUBLIC_PATHS = frozenset({"/health", "/ping"})


@dataclass(frozen=True, slots=True)
class IngressLimits:
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    stream_stall_timeout_s: float = 60.0  # relayed streams: a client reading nothing
    public_metrics: bool = False  # /metrics open without the key (--public-metrics)


class BodyTooLarge(Exception):
    """The body went over the limit while it was read."""


def _refusal(status: int, message: str, code: str, **headers: str) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error", None, code),
                        status_code=status, headers={"Connection": "close", **headers})


def too_large(limit: int) -> JSONResponse:
    return _refusal(413, f"The request body is larger than {limit} bytes.",
                    "request_too_large")


def refuse_head(request: Request, path: str, limits: IngressLimits) -> JSONResponse | None:
    """401 or 413 from the request's head alone, or None to go on."""
    public = path in PUBLIC_PATHS or (limits.public_metrics and path == "/metrics")
    if limits.api_key is not None and not public:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if (scheme.lower() != "bearer" or not token
                or not hmac.compare_digest(token.strip().encode(), limits.api_key.encode())):
            return _refusal(401, "Invalid or missing API key: send 'Authorization: Bearer "
                            "<key>'.", "invalid_api_key", **{"WWW-Authenticate": "Bearer"})
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > limits.max_body_bytes:
        return too_large(limits.max_body_bytes)
    return None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, counted as it arrives; ``BodyTooLarge`` once it passes ``limit``."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)
