"""Answering a request before the app has read its body (a refused key, Host or Origin,
a body over the limit), without the client seeing a connection reset instead.

Closing a socket that still holds unread request data makes the kernel reset the
connection, and the client would see that reset instead of the 4xx body; so the rest
of the body is read and discarded first, up to ``drain_limit`` bytes. A longer body is
cut off with the connection (``Connection: close``).
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from roseinfer.server.errors import APIError


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case bytes), as text."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def drain(scope: Scope, receive: Receive, read: int, drain_limit: int) -> bool:
    """Read and discard the rest of the body (``read`` bytes of it already read); False
    when it was left unread (longer than ``drain_limit``, or waiting for a 100)."""
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > drain_limit:
        return False
    expect = (header(scope, b"expect") or "").lower()
    if expect == "100-continue" and read == 0:
        return False  # the client sends no body before a 100: nothing is pending
    while read <= drain_limit:
        message = await receive()
        if message["type"] == "http.disconnect":
            return True
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


async def answer(error: APIError, scope: Scope, receive: Receive, send: Send,
                 drained: bool) -> None:
    """Send ``error``; the connection closes after it unless the body was all read."""
    if not drained or error.status_code == 413:
        error.headers["Connection"] = "close"
    await error.response()(scope, receive, send)


async def reject(error: APIError, scope: Scope, receive: Receive, send: Send,
                 drain_limit: int) -> None:
    """Answer ``error`` to a request whose body was not read yet: drain it first."""
    await answer(error, scope, receive, send, await drain(scope, receive, 0, drain_limit))
