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


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> Payload:
    """Usage as Anthropic counts it: ``input_tokens`` are the prompt tokens not read from
    the cache, ``cache_read_input_tokens`` those the prefix cache served (memory or
    disk), so the whole prompt is their sum. ``cache_creation_input_tokens`` is 0:
    roseinfer caches every prompt's full blocks on its own, never a billed cache write
    that ``cache_control`` asks for."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def message(message_id: str, model: str, content: list[Payload], stop_reason: str | None,
            stop_sequence: str | None, prompt_tokens: int, output_tokens: int,
            cached_tokens: int = 0) -> Payload:
    return {"id": message_id, "type": "message", "role": "assistant", "content": content,
            "model": model, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(prompt_tokens, output_tokens, cached_tokens)}


def message_start(message_id: str, model: str, prompt_tokens: int) -> Payload:
    """The stream's first event, sent before the request is scheduled: the prefix cache
    has not been looked up yet, so the whole prompt counts as ``input_tokens`` here;
    ``message_delta`` carries the final split."""
    return {"type": "message_start",
            "message": message(message_id, model, [], None, None, prompt_tokens, 0)}


def message_delta(stop_reason: str, stop_sequence: str | None, prompt_tokens: int,
                  output_tokens: int, cached_tokens: int) -> Payload:
    """The final delta; its usage counts are totals (they replace message_start's)."""
    return {"type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage(prompt_tokens, output_tokens, cached_tokens)}


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
