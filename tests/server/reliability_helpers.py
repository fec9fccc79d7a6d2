"""Helpers for the reliability tests: a raw asyncio HTTP/1.1 client that can hang up
at chosen points, checks of what a finished request must look like, and a starter for
`roseinfer serve` subprocesses with custom engine options.

The client speaks HTTP on bare asyncio streams (one connection per request,
``Connection: close``) so that a test controls exactly when the connection goes away:
right after the request was sent (before the first response byte), after a delay
(while waiting, prefilling or mid-stream) or after a number of SSE events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roseinfer.bench.sse_client import body_pieces
from tests.server.helpers import MODEL_NAME, ServerProcess, free_port

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass(frozen=True)
class Hangup:
    """When the client closes the connection on purpose.

    ``after_send``: as soon as the request is written (before any response byte);
    ``delay_s``: after that many seconds, whatever state the request is in;
    ``events``: after that many SSE ``data:`` events.
    """

    after_send: bool = False
    delay_s: float | None = None
    events: int | None = None


@dataclass
class Outcome:
    """What one raw request saw."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    events: list[bytes] = field(default_factory=list)
    hung_up: bool = False  # the client closed the connection before the response ended
    error: str = ""  # transport failure (not a hang-up of ours)
    elapsed_s: float = 0.0
    ttft_s: float | None = None  # first SSE event with text (streams only)


def parse_url(url: str) -> tuple[str, int]:
    hostport = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    return host, int(port)


async def _read_head(reader: asyncio.StreamReader, out: Outcome) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    out.status = int(status_line.split()[1])
    out.headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines if line)}
    return "chunked" in out.headers.get("transfer-encoding", "").lower()


async def _pieces(reader: asyncio.StreamReader, headers: dict[str, str], chunked: bool):  # noqa: ANN202
    if not chunked and "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
        return
    async for piece in body_pieces(reader, chunked):
        yield piece


def _has_text(data: bytes) -> bool:
    with contextlib.suppress(ValueError):
        for choice in json.loads(data).get("choices") or []:
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                return True
    return False


async def _read_response(reader: asyncio.StreamReader, out: Outcome, hangup: Hangup,
                         start: float) -> None:
    loop = asyncio.get_running_loop()
    chunked = await _read_head(reader, out)
    if "text/event-stream" not in out.headers.get("content-type", ""):
        out.body = b"".join([p async for p in _pieces(reader, out.headers, chunked)])
        return
    buffer = b""
    async for piece in _pieces(reader, out.headers, chunked):
        buffer += piece
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:end], buffer[end + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    out.events.append(data)
                    if out.ttft_s is None and _has_text(data):
                        out.ttft_s = loop.time() - start
            if hangup.events is not None and len(out.events) >= hangup.events:
                out.hung_up = True
                return


async def request(url: str, path: str, body: dict[str, Any] | None = None, *,
                  hangup: Hangup = Hangup(), timeout: float = 60.0,  # noqa: B008
                  method: str = "POST") -> Outcome:
    """Send one request on a fresh connection; hang up as ``hangup`` says."""
    host, port = parse_url(url)
    out = Outcome()
    loop = asyncio.get_running_loop()
    start = loop.time()
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        payload = json.dumps(body).encode() if body is not None else b""
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     "Content-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                     + payload)
        await writer.drain()
        if hangup.after_send:
            out.hung_up = True
            return out
        limit = timeout if hangup.delay_s is None else min(timeout, hangup.delay_s)
        try:
            await asyncio.wait_for(_read_response(reader, out, hangup, start), limit)
        except TimeoutError:
            if hangup.delay_s is None or hangup.delay_s >= timeout:
                raise
            out.hung_up = True
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
            ValueError, IndexError) as exc:
        out.error = repr(exc)
    finally:
        out.elapsed_s = loop.time() - start
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    return out


# ------------------------------------------------------------------ checks
def openai_error_problem(out: Outcome) -> str | None:
    """None if the body is ``{"error": {message, type, param, code}}`` with a message."""
    try:
        err = json.loads(out.body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {out.body[:200]!r}"
    if set(err) != OPENAI_ERROR_KEYS or not err["message"]:
        return f"bad error keys: {err!r}"
    return None


def overload_problem(out: Outcome) -> str | None:
    """None for a clean 503: Retry-After (whole seconds) and the OpenAI error body."""
    if out.status != 503:
        return f"status {out.status}"
    retry = out.headers.get("retry-after", "")
    if not retry.isdigit():
        return f"503 without a valid Retry-After: {retry!r}"
    return openai_error_problem(out)


def stream_problem(out: Outcome, num_choices: int) -> str | None:
    """None for a whole SSE stream: chunks, a finish_reason per choice, then [DONE]."""
    if not out.events or out.events[-1] != b"[DONE]":
        return f"stream did not end with [DONE]: {out.events[-3:]!r}"
    finished: dict[int, str] = {}
    for data in out.events[:-1]:
        try:
            event = json.loads(data)
        except ValueError:
            return f"event is not JSON: {data[:200]!r}"
        if "error" in event:
            return f"error event: {event['error']!r}"
        for choice in event.get("choices") or []:
            if choice.get("finish_reason") is not None:
                if choice["index"] in finished:
                    return f"choice {choice['index']} finished twice"
                finished[choice["index"]] = choice["finish_reason"]
    if sorted(finished) != list(range(num_choices)):
        return f"finish_reason for choices {sorted(finished)}, want {num_choices}"
    if not set(finished.values()) <= {"stop", "length"}:
        return f"unexpected finish reasons {finished!r}"
    return None


def json_problem(out: Outcome, num_choices: int) -> str | None:
    """None for a whole non-streaming answer: every choice with a finish_reason."""
    try:
        choices = json.loads(out.body)["choices"]
    except (ValueError, KeyError, TypeError):
        return f"not a completion body: {out.body[:200]!r}"
    if sorted(c["index"] for c in choices) != list(range(num_choices)):
        return f"choices {[c['index'] for c in choices]}, want {num_choices}"
    reasons = {c["finish_reason"] for c in choices}
    if not reasons <= {"stop", "length"}:
        return f"unexpected finish reasons {reasons!r}"
    return None


def outcome_problem(out: Outcome, stream: bool, num_choices: int) -> str | None:
    """None if a request that was not hung up ended properly or got a clean 503."""
    if out.error:
        return f"transport error {out.error}"
    if out.status == 503:
        return overload_problem(out)
    if out.status != 200:
        return f"status {out.status}: {out.body[:300]!r}"
    return stream_problem(out, num_choices) if stream else json_problem(out, num_choices)


# ------------------------------------------------------------------ servers
def start_serve(log: Path, *extra: str) -> ServerProcess:
    """`roseinfer serve` on the default model (fp16, 1 thread) plus ``extra`` options."""
    port = free_port()
    cmd = [sys.executable, "-m", "roseinfer.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", MODEL_NAME,
           "--num-threads", "1", "--quantization", "fp16", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return ServerProcess(f"http://127.0.0.1:{port}", proc, log)
