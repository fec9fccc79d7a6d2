"""What the server's handlers hold of a request in flight: its stream of outputs, the
command that submits it, the errors it can end with, and per-step latency records.

``RequestStream`` is filled by ``AsyncEngine`` (see ``async_engine.py``) on the event
loop and read by the handler; ``abort()`` hands the abort back to the engine thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from roseinfer.engine.async_engine import AsyncEngine


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or failed beyond recovery)."""


class EngineStepError(RuntimeError):
    """A step of the engine raised while this request was in flight."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; retry later."""


class RequestRejectedError(ValueError):
    """The engine refused a request that passed the handler's validation."""


class RequestTooLargeError(RequestRejectedError):
    """The request alone has more sequences (prompts x n) than the waiting queue holds."""


class RequestFailedError(RuntimeError):
    """This request failed while the engine stepped it (the others carry on)."""


@dataclass(frozen=True, slots=True)
class PendingRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class StepTimings:
    """Latencies observed in one step, handed to observers (metrics)."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)


StepObserver = Callable[[StepTimings], None]


class RequestStream:
    """Async iterator over the outputs of one or more requests submitted together.

    Yields ``RequestOutput`` objects (``request_id`` tells them apart) and stops once
    every request finished. ``abort()`` (idempotent) cancels the unfinished ones.
    """

    def __init__(self, engine: AsyncEngine, request_ids: Sequence[str],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self.request_ids = tuple(request_ids)
        self._unfinished = set(request_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.loop = loop
        self._closed = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        if not self._closed:
            self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished or self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._closed = True
            self.abort()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        """Abort every unfinished request of this stream (safe to call many times)."""
        self._closed = True
        if self._unfinished:
            self._engine.abort(list(self._unfinished))
            self._unfinished.clear()
