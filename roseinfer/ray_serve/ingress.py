"""``Ingress``: the one HTTP endpoint in front of the engine replicas.

Ray Serve's HTTP proxy hands each request to this deployment (one replica). It reads
the body, computes the prompt's prefix block hashes (``prefix_keys``, off the event
loop), and forwards method, path, headers and body to an engine replica through a
streaming ``DeploymentHandle`` call; ``PrefixAffinityRouter`` picks the replica. The
replica's answer streams back item by item: status and headers first, then the body
chunks as the replica's app sends them (SSE events one by one). The ingress answers
the client once the first body chunk is there (a stream's headers come with its
first event), which is what lets it re-send a call that got nothing yet.

Failures of the replica itself (its process died, Ray lost it):
- before the first body byte was ready, the call is sent again (``max_retries``
  times; Ray Serve drops the dead replica from the router), so a non-streaming
  request or a stream still waiting for its first token does not notice;
- after that, an SSE stream ends with an OpenAI-shaped error event (code
  ``replica_failed``) and ``data: [DONE]``, as roseinfer's own streams end on an
  engine failure; any other body is cut short (the client sees an incomplete
  response). Either way the client gets an answer, never a hang.
When no replica can take the call, the answer is an OpenAI-shaped 503.

``GET /ray/replicas`` answers each replica's identity and engine counters (prefix
cache queries and hits among them), gathered through the router's ``replica_slot``.

Before anything is read or parsed, the head is checked (``ingress_guard``): the API
key (``/ray/replicas`` included) and the size limit by ``Content-Length``; a body
without one is counted as it arrives and refused with a 413 at the limit. A relayed
stream whose client reads nothing for the stall timeout is ended, which cancels the
replica's call (and so aborts its request).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from roseinfer.ray_serve.asgi_bridge import ForwardedRequest, ResponseHead
from roseinfer.ray_serve.ingress_guard import (
    BodyTooLarge,
    IngressLimits,
    read_body,
    refuse_head,
    too_large,
)
from roseinfer.ray_serve.prefix_keys import PrefixKeys
from roseinfer.ray_serve.router import SLOT_KWARG
from roseinfer.server.errors import error_body

logger = logging.getLogger("roseinfer.ray_serve")
STATS_PATH = "/ray/replicas"
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})
REPLICA_GONE = (RayActorError,)  # ActorDiedError and ActorUnavailableError among them


class RelayedResponse(Response):
    """Sends a replica's head and body chunks as they come (headers kept raw); a send
    pending for ``stall_timeout`` s (the client reads nothing) ends the relay."""

    def __init__(self, head: ResponseHead, chunks: AsyncIterator[bytes],
                 stall_timeout: float | None = None) -> None:
        self.status_code = head.status
        self.raw_headers = [(k, v) for k, v in head.headers if k.lower() not in HOP_BY_HOP]
        self.chunks = chunks
        self.stall_timeout = stall_timeout or None
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with asyncio.timeout(self.stall_timeout) as deadline:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for chunk in self.chunks:
                    deadline.reschedule(self._later())
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
                    deadline.reschedule(None)  # waiting for the replica is not a stall
                deadline.reschedule(self._later())
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            logger.warning("client %s read nothing for %.0f s: relay ended",
                           scope.get("client"), self.stall_timeout)
        finally:
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()  # the relay's finally cancels the replica's call

    def _later(self) -> float | None:
        if self.stall_timeout is None:
            return None
        return asyncio.get_running_loop().time() + self.stall_timeout


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse(error_body(message, kind, None, code), status_code=status)


def _sse_error(message: str) -> bytes:
    body = error_body(message, "server_error", None, "replica_failed")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class Ingress:
    """The HTTP entry point (deployed by ``app.build``)."""

    def __init__(self, replicas: DeploymentHandle, model: str | None, block_size: int,
                 num_replicas: int, max_retries: int, weight_cache: bool | None = None,
                 limits: IngressLimits | None = None) -> None:
        from roseinfer.model.loader import resolve_model_path
        from roseinfer.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_model_path(resolve_model_path(model), weight_cache)
        self.keys = PrefixKeys(tokenizer, block_size)
        self.replicas = replicas
        self.num_replicas = num_replicas
        self.max_retries = max_retries
        self.limits = limits or IngressLimits()

    async def __call__(self, request: Request) -> Response:
        path = _app_path(request.scope)
        refusal = refuse_head(request, path, self.limits)
        if refusal is not None:
            return refusal
        if path == STATS_PATH and request.method == "GET":
            return JSONResponse({"replicas": await self.replica_stats()})
        try:
            body = await read_body(request, self.limits.max_body_bytes)
        except BodyTooLarge:
            return too_large(self.limits.max_body_bytes)
        hashes = await run_in_threadpool(self.keys.for_body, path, body)
        forwarded = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                                     tuple(request.headers.raw), body, hashes)
        return await self.forward(forwarded)

    async def forward(self, request: ForwardedRequest) -> Response:
        """Send ``request`` to a replica; re-send it while nothing was answered yet."""
        failure: BaseException | None = None
        for _ in range(1 + self.max_retries):
            call = self.replicas.options(stream=True).forward.remote(request)
            try:
                head = await call.__anext__()
                first = await _next_chunk(call)
            except asyncio.CancelledError:  # the client left while the replica worked
                call.cancel()
                raise
            except REPLICA_GONE as exc:
                logger.warning("replica gone before answering (%s); sending again",
                               _first_line(exc))
                failure = exc
                continue
            except Exception as exc:  # noqa: BLE001 - a bug in the replica: a 500, not a hang
                logger.exception("replica failed")
                call.cancel()
                return _error(500, f"the replica failed: {_first_line(exc)}", "replica_failed")
            if not isinstance(head, ResponseHead):
                call.cancel()
                return _error(502, "the replica answered without a head", "bad_gateway")
            return RelayedResponse(head, _relay(call, head, first),
                                   self.limits.stream_stall_timeout_s)
        return _error(503, f"no replica could answer: {_first_line(failure)}",
                      "replica_unavailable")

    async def replica_stats(self) -> list[dict[str, Any]]:
        """Each live replica's ``EngineReplica.stats()`` (one call per router slot)."""
        seen: dict[str, dict[str, Any]] = {}
        for slot in range(self.num_replicas):
            try:
                stats = await self.replicas.stats.remote(**{SLOT_KWARG: slot})
            except REPLICA_GONE:
                continue
            seen.setdefault(stats["replica_id"], stats)
        return sorted(seen.values(), key=lambda s: s["replica_id"])


def _first_line(exc: BaseException | None) -> str:
    """An exception's first line: Ray's messages go on with actor ids, pids and IPs."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _app_path(scope: Scope) -> str:
    """The path below the application's route prefix (what roseinfer's routes expect)."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


async def _next_chunk(call: DeploymentResponseGenerator) -> bytes | None:
    try:
        return await call.__anext__()
    except StopAsyncIteration:
        return None


async def _relay(call: DeploymentResponseGenerator, head: ResponseHead,
                 first: bytes | None) -> AsyncIterator[bytes]:
    """The body: ``first``, then the rest; a replica lost mid-stream ends an SSE stream
    with an error event (other bodies are cut short)."""
    done = first is None
    try:
        if first is not None:
            yield first
        while not done:
            try:
                chunk = await call.__anext__()
            except StopAsyncIteration:
                done = True
                break
            except Exception as exc:  # the replica died (REPLICA_GONE) or its call failed
                done = True
                if not head.is_event_stream:
                    raise
                logger.warning("replica failed mid-stream: %s", exc)
                yield _sse_error(f"the replica serving this request failed: {_first_line(exc)}")
                break
            yield chunk
    finally:
        if not done:  # the client left: stop the replica's work too
            call.cancel()
