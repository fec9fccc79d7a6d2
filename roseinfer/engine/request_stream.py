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
from typing import Protocol

from roseinfer.lora.request import LoRARequest
from roseinfer.outputs import RequestOutput
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams


class Aborter(Protocol):
    """What a stream needs of its engine (``AsyncEngine``): a thread-safe abort."""

    def abort(self, request_ids: str | Sequence[str]) -> None: ...


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
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: base model)
    pooling: PoolingParams | None = None  # an embedding request


@dataclass(slots=True)
class StepTimings:
    """Latencies observed in one step, handed to observers (metrics)."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)


StepObserver = Callable[[StepTimings], None]


class _Coalesced:
    """One request's outputs that the reader has not taken yet, merged into one: the
    latest output with every earlier delta (text, token ids, logprobs) in front of its
    own. Text pieces are joined once, when taken."""

    __slots__ = ("latest", "texts", "ids", "lps", "chars", "count")

    def __init__(self, out: RequestOutput) -> None:
        self.latest = out
        self.count = 0  # outputs merged here
        self.texts: dict[int, list[str]] = {}
        self.ids: dict[int, list[int]] = {}
        self.lps: dict[int, list] = {}
        self.chars = 0
        self._record(out)

    def _record(self, out: RequestOutput) -> None:
        self.count += 1
        for c in out.outputs:
            self.texts.setdefault(c.index, []).append(c.delta_text)
            self.ids.setdefault(c.index, []).extend(c.delta_token_ids)
            if c.delta_logprobs:
                self.lps.setdefault(c.index, []).extend(c.delta_logprobs)
            self.chars += len(c.delta_text)

    def add(self, out: RequestOutput) -> None:
        self.latest = out
        self._record(out)

    def take(self) -> RequestOutput:
        out = self.latest
        for c in out.outputs:
            pieces = self.texts.get(c.index, ())
            if len(pieces) > 1:
                c.delta_text = "".join(pieces)
                c.delta_token_ids = self.ids[c.index]
                if c.delta_logprobs is not None:
                    c.delta_logprobs = self.lps.get(c.index, [])
        return out


class RequestStream:
    """Async iterator over the outputs of one or more requests submitted together.

    Yields ``RequestOutput`` objects (``request_id`` tells them apart) and stops once
    every request finished. ``abort()`` (idempotent) cancels the unfinished ones.

    Bounded: the engine thread never waits for the reader. Outputs the reader has not
    taken yet are merged per request (``_Coalesced``), so at most one item per request
    waits here, holding the unsent deltas only (linear in the output, never the whole
    text once per step); a slow reader gets fewer, larger deltas.

    Backpressure: ``taken(request_id)`` counts the outputs the reader has taken; the
    engine thread compares it with what it delivered and holds a request whose reader
    has fallen behind (``AsyncEngine``), so a client that does not read stops costing
    decode steps. Each take tells the engine (``AsyncEngine.note_read``).
    """

    def __init__(self, engine: Aborter, request_ids: Sequence[str],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self.request_ids = tuple(request_ids)
        self._unfinished = set(request_ids)
        self._pending: dict[str, _Coalesced] = {}  # request id -> its untaken outputs
        # outputs taken by the reader, per request: written on the event loop, read by the
        # engine thread (a fixed dict: only its int values change)
        self._taken: dict[str, int] = dict.fromkeys(self.request_ids, 0)
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.loop = loop
        self._closed = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    @property
    def pending_items(self) -> int:
        """Merged outputs waiting for the reader (at most one per request)."""
        return len(self._pending)

    @property
    def pending_tokens(self) -> int:
        """Token ids waiting for the reader."""
        return sum(len(ids) for p in self._pending.values() for ids in p.ids.values())

    @property
    def pending_chars(self) -> int:
        """Characters of text waiting for the reader."""
        return sum(p.chars for p in self._pending.values())

    def taken(self, request_id: str) -> int:
        """How many of the request's outputs the reader has taken (merged ones count
        each)."""
        return self._taken.get(request_id, 0)

    def _put(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        if self._closed:
            return
        if isinstance(item, BaseException):
            self._error = self._error or item
        elif (pending := self._pending.get(item.request_id)) is not None:
            pending.add(item)
        else:
            self._pending[item.request_id] = _Coalesced(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if not self._unfinished or self._closed:
                raise StopAsyncIteration
            if self._pending:
                pending = self._pending.pop(next(iter(self._pending)))
                item = pending.take()
                if item.finished:
                    self._unfinished.discard(item.request_id)
                elif item.request_id in self._taken:
                    self._taken[item.request_id] += pending.count
                    self._engine.note_read()
                return item
            if self._error is not None:
                self._closed = True
                self.abort()
                raise self._error
            self._ready.clear()
            await self._ready.wait()

    def abort(self) -> None:
        """Abort every unfinished request of this stream (safe to call many times)."""
        self._closed = True
        self._pending.clear()
        if self._unfinished:
            self._engine.abort(list(self._unfinished))
            self._unfinished.clear()
