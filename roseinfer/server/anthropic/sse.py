"""The Messages API's response shapes and its Server-Sent Events.

A message is ``{"id": "msg_...", "type": "message", "role": "assistant", "content",
"model", "stop_reason", "stop_sequence", "usage"}``. A stream is ``message_start`` (the
message with no content, ``stop_reason`` null), ``ping``, the blocks' ``content_block_*``
events, ``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage.output_tokens``)
and ``message_stop``; more ``ping`` events keep a quiet stream alive (``keepalive``).
Every event has an ``event:`` line naming its ``type`` (the SDK
skips events without one). A failure after the stream began is an ``error`` event in
Anthropic's error shape, and the stream ends there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from roseinfer.server.anthropic.blocks import Payload

T = TypeVar("T")
PING: Payload = {"type": "ping"}
PING_INTERVAL_S = 10.0  # a ping when nothing else was sent for this long (a long prefill)
MESSAGE_STOP: Payload = {"type": "message_stop"}


def event(payload: Payload) -> str:
    """One SSE event: ``event: <type>`` and its JSON."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n"


def usage(input_tokens: int, output_tokens: int) -> Payload:
    """Usage as the SDK reads it: roseinfer reuses cached prefixes without a cache
    write or read billed apart, so both cache counts are 0."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def message(message_id: str, model: str, content: list[Payload], stop_reason: str | None,
            stop_sequence: str | None, input_tokens: int, output_tokens: int) -> Payload:
    return {"id": message_id, "type": "message", "role": "assistant", "content": content,
            "model": model, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(input_tokens, output_tokens)}


def message_start(message_id: str, model: str, input_tokens: int) -> Payload:
    return {"type": "message_start",
            "message": message(message_id, model, [], None, None, input_tokens, 0)}


def message_delta(stop_reason: str, stop_sequence: str | None, input_tokens: int,
                  output_tokens: int) -> Payload:
    """The final delta; its usage counts are totals (they replace message_start's)."""
    return {"type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage(input_tokens, output_tokens)}


def error_event(body: dict[str, Any]) -> str:
    """An ``error`` event carrying Anthropic's error body (``errors.error_body``)."""
    return event(body)


async def keepalive(items: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """``items``, with a None each time ``interval`` seconds pass without one (the
    caller sends a ``ping`` then). The pending item is awaited, never cancelled, unless
    the consumer stops first."""
    iterator = aiter(items)
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await pending
