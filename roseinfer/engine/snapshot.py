"""EngineSnapshot: an immutable picture of the engine for the web dashboard.

``take_snapshot`` reads the scheduler queues, the KV block pool and the requests of an
``LLMEngine``; it must run on the engine thread (``AsyncEngine`` calls it between two
steps when a reader asks: ``AsyncEngine.snapshot``). What it returns is frozen and
made only of numbers, strings and tuples, so any thread may read it; the percentiles
and the filled-in throughput series are computed by the reader (its methods), off the
engine thread.

``LiveCounters`` is what the engine thread records between snapshots: tokens run
through the model per one-second bucket (prefill and decode) and recent time-to-first-
token and inter-token latencies (fed by the step observer of ``AsyncEngine``).
``SnapshotExchange`` hands snapshots from the engine thread to asyncio readers.

Block states in ``block_map``: ``u`` in use (referenced by a request), ``c`` cached
(unused, but holds a full block of a prefix a later request can reuse), ``.`` free.
A pool larger than ``MAX_MAP_CELLS`` blocks is drawn with ``blocks_per_cell`` blocks
per cell: a cell is ``u`` if any of its blocks is in use, else ``c`` if any is cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from roseinfer.engine.block_manager import Block
from roseinfer.engine.request import Request, RequestStatus
from roseinfer.engine.request_stream import EngineDeadError, StepTimings
from roseinfer.engine.stats import EngineStats

if TYPE_CHECKING:
    from roseinfer.engine.engine import LLMEngine

logger = logging.getLogger(__name__)
HISTORY_S = 300  # seconds of throughput history (one bucket per second)
LATENCY_WINDOW_S = 300.0  # percentiles cover the samples of the last five minutes ...
MAX_TTFT_SAMPLES = 2048  # ... and at most this many of each kind
MAX_ITL_SAMPLES = 8192
MAX_MAP_CELLS = 4096  # cells of the block map
MAX_REQUEST_ROWS = 256  # requests listed one by one (the counts cover all of them)
USED, CACHED, FREE = "u", "c", "."


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """One sequence the scheduler holds (running or waiting)."""

    request_id: str
    group_id: str  # the user-facing request (n > 1 has one sequence per choice)
    state: str  # "prefill" | "decode" | "waiting" | "preempted"
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int  # tokens whose K/V are in the cache
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_blocks: int  # KV blocks it holds
    age_s: float  # since arrival
    num_preemptions: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    taken_at: float  # time.monotonic() on the engine thread
    # limits of the engine
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefix_caching: bool
    kv_cache_dtype: str  # the KV pool's element type ("float16", "int8", ...)
    quantization: str  # the weight format ("int8", "q4_0", "none", ...)
    # queues
    num_running: int
    num_waiting: int  # includes the preempted ones
    num_preempted: int
    requests: tuple[RequestSnapshot, ...]  # running first, then waiting (capped)
    # KV block pool: used + cached + free == num_blocks
    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    block_map: str
    blocks_per_cell: int
    # counters since start
    prompt_tokens_total: int
    generation_tokens_total: int
    computed_tokens_total: int
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    finished: tuple[tuple[str, int], ...]  # (finish reason, count)
    # recent history: (second, prefill tokens, decode tokens), (time, seconds)
    throughput: tuple[tuple[int, int, int], ...]
    ttft_samples: tuple[tuple[float, float], ...]
    itl_samples: tuple[tuple[float, float], ...]

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    def throughput_series(self, seconds: int = HISTORY_S) -> tuple[list[int], list[int]]:
        """(prefill, decode) tokens per second for the last ``seconds`` complete seconds
        before the snapshot, oldest first; a second without a step is 0."""
        end = int(self.taken_at)  # the current, incomplete second is left out
        prefill, decode = [0] * seconds, [0] * seconds
        for second, p, d in self.throughput:
            i = seconds - (end - second)
            if 0 <= i < seconds:
                prefill[i], decode[i] = p, d
        return prefill, decode

    def latency_percentiles(self, kind: str, quantiles: Sequence[float] = (50, 90, 99),
                            window_s: float = LATENCY_WINDOW_S) -> tuple[int, list[float | None]]:
        """(number of samples, their percentiles in seconds) of ``kind`` ("ttft" or
        "itl") within ``window_s`` before the snapshot; None without samples."""
        samples = self.ttft_samples if kind == "ttft" else self.itl_samples
        since = self.taken_at - window_s
        values = sorted(v for t, v in samples if t >= since)
        return len(values), [percentile(values, q) for q in quantiles]


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class LiveCounters:
    """Throughput buckets and latency samples; engine thread only (``take_snapshot``
    copies them into the snapshot)."""

    def __init__(self, stats: EngineStats) -> None:
        self._computed = stats.computed_tokens_total
        self._generated = stats.generation_tokens_total
        self.buckets: deque[list[int]] = deque(maxlen=HISTORY_S + 2)  # [second, prefill, decode]
        self.ttft: deque[tuple[float, float]] = deque(maxlen=MAX_TTFT_SAMPLES)
        self.itl: deque[tuple[float, float]] = deque(maxlen=MAX_ITL_SAMPLES)

    def record_tokens(self, now: float, stats: EngineStats) -> None:
        """Add the tokens computed since the last call to the bucket of ``now``.

        Decode = tokens generated; prefill = the other tokens run through the model
        (prompt tokens, recomputed ones after a preemption; prefix-cache hits are not).
        """
        computed, generated = stats.computed_tokens_total, stats.generation_tokens_total
        d_computed, d_generated = computed - self._computed, generated - self._generated
        self._computed, self._generated = computed, generated
        if d_computed < 0 or d_generated < 0 or (d_computed == 0 and d_generated == 0):
            return  # nothing new (or the counters were reset)
        second = int(now)
        if not self.buckets or self.buckets[-1][0] != second:
            self.buckets.append([second, 0, 0])
        bucket = self.buckets[-1]
        bucket[1] += max(0, d_computed - d_generated)
        bucket[2] += d_generated

    def observe(self, timings: StepTimings) -> None:
        """Step observer (``AsyncEngine.add_observer``): keep the step's latencies."""
        now = time.monotonic()
        self.ttft.extend((now, v) for v in timings.ttft)
        self.itl.extend((now, v) for v in timings.itl)


class SnapshotExchange:
    """Readers ask (``ask``, under the owner's lock, then ``wait``); the engine thread
    takes the asks (``take_asks``, under the lock) and answers them all with ONE snapshot
    built between two steps (``answer``), through each reader's event loop."""

    def __init__(self) -> None:
        self.asks: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[EngineSnapshot]]] = []
        self.last: EngineSnapshot | None = None  # written by the engine thread only

    def ask(self) -> asyncio.Future[EngineSnapshot]:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[EngineSnapshot] = loop.create_future()
        self.asks.append((loop, waiter))
        return waiter

    def take_asks(self) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future[EngineSnapshot]]]:
        asks, self.asks = self.asks, []
        return asks

    def answer(self, asks: Sequence[tuple[asyncio.AbstractEventLoop,
                                         asyncio.Future[EngineSnapshot]]],
               build: Callable[[], EngineSnapshot]) -> None:
        """Engine thread: build one snapshot for every ask (nothing when none)."""
        if not asks:
            return
        try:
            result: EngineSnapshot | BaseException = build()
            self.last = result
        except Exception as exc:  # a broken snapshot must not stop the engine
            logger.exception("engine snapshot failed")
            result = exc
        for loop, waiter in asks:
            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(_resolve, waiter, result)

    async def wait(self, waiter: asyncio.Future[EngineSnapshot] | None,
                   timeout: float) -> EngineSnapshot:
        """The answer to ``waiter``; the last snapshot when there is no answer within
        ``timeout`` s or no waiter (the loop is not running); EngineDeadError if none."""
        if waiter is not None:
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(waiter, timeout)
        if self.last is None:
            raise EngineDeadError("the engine is not running")
        return self.last


def _resolve(waiter: asyncio.Future[EngineSnapshot],
             result: EngineSnapshot | BaseException) -> None:
    if waiter.done():  # the reader gave up waiting
        return
    if isinstance(result, BaseException):
        waiter.set_exception(result)
    else:
        waiter.set_result(result)


def take_snapshot(engine: LLMEngine, live: LiveCounters, now: float) -> EngineSnapshot:
    """The engine's state now. ENGINE THREAD ONLY: it reads mutable engine state."""
    scheduler, bm = engine.scheduler, engine.block_manager
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    rows = [_request_row(r, now) for r in (running + waiting)[:MAX_REQUEST_ROWS]]
    block_map, per_cell = _block_map(bm.blocks)
    used, cached = bm.num_used_blocks, bm.num_cached_blocks
    stats = engine.stats
    return EngineSnapshot(
        taken_at=now,
        block_size=bm.block_size,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_model_len=scheduler.max_model_len,
        prefix_caching=bm.enable_prefix_caching,
        kv_cache_dtype=str(engine.kv_dtype).removeprefix("torch."),
        quantization=engine.quantization,
        num_running=len(running),
        num_waiting=len(waiting),
        num_preempted=sum(1 for r in waiting if r.status is RequestStatus.PREEMPTED),
        requests=tuple(rows),
        num_blocks=bm.num_blocks,
        num_used_blocks=used,
        num_cached_blocks=cached,
        num_free_blocks=bm.num_blocks - used - cached,
        block_map=block_map,
        blocks_per_cell=per_cell,
        prompt_tokens_total=stats.prompt_tokens_total,
        generation_tokens_total=stats.generation_tokens_total,
        computed_tokens_total=stats.computed_tokens_total,
        num_preemptions_total=stats.num_preemptions,
        prefix_cache_queries=bm.prefix_queries,
        prefix_cache_hits=bm.prefix_hits,
        finished=tuple(sorted(stats.finished.items())),
        throughput=tuple((s, p, d) for s, p, d in live.buckets),
        ttft_samples=tuple(live.ttft),
        itl_samples=tuple(live.itl),
    )


def _request_row(req: Request, now: float) -> RequestSnapshot:
    if req.status is RequestStatus.RUNNING:
        state = "decode" if req.num_tokens - req.num_computed_tokens <= 1 else "prefill"
    elif req.status is RequestStatus.PREEMPTED:
        state = "preempted"
    else:
        state = "waiting"
    return RequestSnapshot(
        request_id=req.request_id,
        group_id=req.group_id,
        state=state,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_computed_tokens=req.num_computed_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_blocks=len(req.block_table),
        age_s=max(0.0, now - req.arrival_time),
        num_preemptions=req.num_preemptions,
        max_tokens=req.params.max_tokens,
    )


def _block_map(blocks: Sequence[Block]) -> tuple[str, int]:
    """(one character per cell, blocks per cell) for the pool's blocks in id order."""
    states = "".join(USED if b.ref_count else CACHED if b.block_hash is not None else FREE
                     for b in blocks)
    per_cell = max(1, -(-len(states) // MAX_MAP_CELLS))
    if per_cell == 1:
        return states, 1
    cells = []
    for i in range(0, len(states), per_cell):
        part = states[i:i + per_cell]
        cells.append(USED if USED in part else CACHED if CACHED in part else FREE)
    return "".join(cells), per_cell
