"""AsyncEngine: one background thread steps the LLMEngine; asyncio code streams outputs.

Threading model
---------------
* Every call into the ``LLMEngine`` (add, abort, step, stats) happens on ONE engine
  thread; ``AsyncEngine.launch`` also builds the engine there, so every OpenMP region
  of the process runs on that thread (see ``launch``). Handlers never touch the
  engine: ``add_request(s)`` / ``abort`` append a command to a lock-protected list
  and notify a condition variable.
* The engine thread applies pending commands between steps, steps while work
  exists, and blocks on the condition when idle (no spinning).
* Outputs of one step are handed to the event loop in ONE ``call_soon_threadsafe``
  call, which puts each into the ``asyncio.Queue`` of its request's stream.
* A failure that belongs to one request (``LLMEngine.step`` isolates those: its
  output then carries ``error``) ends that request's stream with a
  ``RequestFailedError``; the others carry on.
* If ``step()`` itself raises, the traceback is logged, every stream in flight
  receives an ``EngineStepError``, and all requests are aborted so their blocks
  return to the pool. If even that fails, the pool does not come back whole, or the
  model cannot run at all (``ModelFailedError``), the engine is marked dead:
  ``healthy`` turns False and new requests get ``EngineDeadError``.  So does a failure
  the engine notices between steps (``LLMEngine.failure``: a tensor-parallel worker
  that exited while idle); ``shutdown`` also stops the engine's worker processes.
* Admission counts sequences (prompts x n): a submission is queued whole or not at
  all (``QueueFullError``), and one larger than the whole bound is refused
  (``RequestTooLargeError``).

* Backpressure: a stream's reader (the HTTP handler) takes outputs as fast as its
  client reads them. Before each step, a request with ``max_unread_outputs`` or more
  outputs delivered but not taken is held (``LLMEngine.hold``): it keeps its KV blocks
  but gets no row in the batch, so a client that stops reading stops costing decode
  steps for everybody else (the stall timeout then aborts it, ``server/streaming.py``).
  Its reader's next take (``note_read``) wakes the loop; if only held requests are left,
  the loop waits for that instead of spinning.

* While busy, a stats line (running/waiting, KV usage, prompt and generation
  throughput, prefix-cache hit rate; with speculative decoding a second line with its
  acceptance) is logged every ``log_stats_interval`` s.
* ``snapshot()`` (the web dashboard's view, ``engine/snapshot.py``) asks the engine
  thread for an ``EngineSnapshot``: it is taken there between two steps (waking an idle
  loop) and handed back through the event loop; nothing is built while nobody asks.

Callers validate and tokenize BEFORE ``add_request``, so bad input never reaches
the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from roseinfer.engine.engine import LLMEngine
from roseinfer.engine.fault_isolation import ModelFailedError
from roseinfer.engine.request_stream import (
    EngineDeadError,
    EngineStepError,
    PendingRequest,
    QueueFullError,
    RequestFailedError,
    RequestRejectedError,
    RequestStream,
    RequestTooLargeError,
    StepObserver,
    StepTimings,
)
from roseinfer.engine.snapshot import (
    EngineSnapshot,
    LiveCounters,
    SnapshotExchange,
    take_snapshot,
)
from roseinfer.engine.stats import EngineStats, log_stats
from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
SNAPSHOT_TIMEOUT_S = 2.0  # a snapshot asked for during a longer step: the previous one
MAX_UNREAD_OUTPUTS = 8  # outputs a reader may leave untaken before its request is held
READER_WAIT_S = 0.5  # only held requests left: re-check this often (a take also wakes)


@dataclass(slots=True)
class _Tracked:
    stream: RequestStream
    arrival: float
    last_token_time: float | None = None
    delivered: int = 0  # outputs handed to the stream


class AsyncEngine:
    """Owns an ``LLMEngine`` and the thread that steps it."""

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None,
                 log_stats_interval: float = 10.0,
                 max_unread_outputs: int | None = MAX_UNREAD_OUTPUTS) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.log_stats_interval = log_stats_interval
        self.max_unread_outputs = max_unread_outputs  # None: never hold a request
        self._held: frozenset[str] = frozenset()  # engine thread only
        self._blocked_on_readers = False  # guarded by _cond: only held requests are left
        self._cond = threading.Condition()
        self._adds: list[tuple[PendingRequest, RequestStream]] = []  # guarded by _cond
        self._aborts: list[str] = []  # guarded by _cond
        self._in_transit = 0  # sequences taken from _adds, not yet visible in the stats
        self._stopping = False
        self._dead: BaseException | None = None
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._observers: list[StepObserver] = []
        self._stats = engine.get_stats()  # a snapshot copy
        self._live = LiveCounters(self._stats)  # engine thread only
        self._observers.append(self._live.observe)
        self._snapshots = SnapshotExchange()  # its asks are guarded by _cond
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def launch(cls, build: Callable[[], LLMEngine], **options: Any) -> AsyncEngine:
        """Build the engine ON a new engine thread and step it there; return once it is
        built (a build error is re-raised here).  ``options`` go to the constructor.

        Why the engine thread must build it: every thread that runs an OpenMP region
        (loading and warming up a model does) keeps its own libgomp worker threads, and
        once all of them together outnumber the cores, libgomp cuts barrier spinning to
        almost nothing: each of the ~240 barriers of a decode step then sleeps and wakes
        through the kernel.  On 2 cores, a model loaded on one thread and stepped on
        another ran 16-sequence decode steps at 47.8 ms instead of 36.8 ms.
        """
        ready = threading.Event()
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                engine = cls(build(), **options)
                engine._thread = threading.current_thread()
                box["engine"] = engine
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
                return
            finally:
                ready.set()
            engine._run()

        thread = threading.Thread(target=target, name="roseinfer-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in box:
            thread.join()
            raise box["error"]
        return box["engine"]

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="roseinfer-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with ``EngineDeadError``.  Then the
        engine's processes (tensor-parallel workers) stop: with a message if the loop has
        ended, else (a step outlived ``timeout``) killed, which ends that step."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()

    @property
    def healthy(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return (alive and self._dead is None and not self._stopping
                and self.engine.failure is None)

    @property
    def dead_reason(self) -> BaseException | None:
        """Why the engine cannot serve: the loop's fatal error, or what the engine noticed
        between steps (a tensor-parallel worker that exited)."""
        return self._dead or self.engine.failure

    def add_observer(self, observer: StepObserver) -> None:
        self._observers.append(observer)

    # ------------------------------------------------------- handler side
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, arrival_time: float | None = None) -> RequestStream:
        """Queue one already-validated request; returns its async stream of outputs."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return self.add_requests([PendingRequest(request_id, prompt_token_ids, params,
                                                 arrival_time=arrival)])

    def add_requests(self, requests: Sequence[PendingRequest]) -> RequestStream:
        """Queue already-validated requests; returns their common async stream.

        Must be called from the event loop that will consume the stream.
        Raises ``QueueFullError``, ``RequestTooLargeError`` or ``EngineDeadError``
        (nothing is queued then): the sequences of all ``requests`` (n each) must fit
        in the waiting queue together.
        """
        stream = RequestStream(self, [r.request_id for r in requests], asyncio.get_running_loop())
        size = sum(r.params.n for r in requests)
        limit = self.max_waiting_requests
        if limit is not None and size > limit:
            raise RequestTooLargeError(
                f"this request has {size} sequences (prompts x n) but the waiting queue "
                f"holds at most {limit}")
        failure = self.engine.failure
        if failure is not None:
            raise EngineDeadError(f"the engine cannot run: {type(failure).__name__}: {failure}")
        with self._cond:
            if self._dead is not None or self._stopping or self._thread is None:
                raise EngineDeadError("the engine is not running")
            if limit is not None and self._num_waiting_locked() + size > limit:
                raise QueueFullError(f"the waiting queue is full ({limit} sequences)")
            self._adds.extend((r, stream) for r in requests)
            self._cond.notify()
        return stream

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Thread-safe: the abort is applied between two steps."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._cond:
            self._aborts.extend(ids)
            self._cond.notify()

    def note_read(self) -> None:
        """A stream's reader took outputs: wake the loop if it waits for readers."""
        if self._blocked_on_readers:
            with self._cond:
                self._cond.notify()

    def num_waiting(self) -> int:
        with self._cond:
            return self._num_waiting_locked()

    def _num_waiting_locked(self) -> int:
        queued = sum(r.params.n for r, _ in self._adds)
        return queued + self._in_transit + self._stats.num_waiting

    def stats(self) -> EngineStats:
        """Snapshot of the engine's stats (taken on the engine thread after each step)."""
        return self._stats

    async def snapshot(self, timeout: float = SNAPSHOT_TIMEOUT_S) -> EngineSnapshot:
        """A fresh ``EngineSnapshot``, taken on the engine thread between two steps.

        When the loop does not answer within ``timeout`` s (it is inside a long step) or
        is not running, the previous snapshot; ``EngineDeadError`` if there is none.
        """
        with self._cond:
            running = self._thread is not None and self._dead is None and not self._stopping
            waiter = self._snapshots.ask() if running else None
            self._cond.notify()
        return await self._snapshots.wait(waiter, timeout)

    # --------------------------------------------------------- engine thread
    def _run(self) -> None:
        last_log = time.monotonic()
        counters = (0, 0)
        try:
            while True:
                with self._cond:
                    idle = False
                    while (not self._adds and not self._aborts and not self._stopping
                           and not self._snapshots.asks
                           and (not self.engine.has_unfinished_requests()
                                or (self._blocked_on_readers and not self._holds_changed()))):
                        idle = True
                        self._cond.wait(READER_WAIT_S if self._blocked_on_readers else None)
                    self._blocked_on_readers = False
                    if idle:  # the stats log covers busy time only
                        last_log = time.monotonic()
                        counters = (self._stats.prompt_tokens_total,
                                    self._stats.generation_tokens_total)
                    if self._stopping:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    asks = self._snapshots.take_asks()
                    self._in_transit = sum(r.params.n for r, _ in adds)
                try:
                    self._apply(adds, aborts)
                    self._publish_stats()
                    self._snapshots.answer(asks, lambda: take_snapshot(
                        self.engine, self._live, time.monotonic()))
                    if self.engine.has_unfinished_requests():
                        self._update_holds()
                        self._step()
                        self._publish_stats()
                        if self._held and self.engine.last_step_tokens == 0:
                            with self._cond:
                                self._blocked_on_readers = True
                except ModelFailedError:
                    raise  # the model cannot run: the loop stops, the engine is dead
                except Exception as exc:  # a failed step must not take the server down
                    self._on_failure(exc, [stream for _, stream in adds])
                now = time.monotonic()
                if now - last_log >= self.log_stats_interval:
                    counters = self._log_stats(now - last_log, counters)
                    last_log = now
        except BaseException as exc:
            logger.exception("engine loop crashed")
            self._dead = exc
        finally:
            why = f": {type(self._dead).__name__}: {self._dead}" if self._dead else ""
            self._fail_all(EngineDeadError(f"the engine loop has stopped{why}"))
            try:
                self.engine.abort_all()
            except Exception:
                logger.exception("abort_all failed during engine shutdown")

    def _apply(self, adds: list[tuple[PendingRequest, RequestStream]], aborts: list[str]) -> None:
        for req, stream in adds:
            if stream._closed:
                continue
            try:
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.params,
                                        arrival_time=req.arrival_time,
                                        lora_request=req.lora_request,
                                        pooling=req.pooling)
            except ValueError as exc:
                self._deliver([(stream, RequestRejectedError(str(exc)))])
                continue
            self._tracked[req.request_id] = _Tracked(stream, req.arrival_time)
        for rid in aborts:
            self._tracked.pop(rid, None)
            self.engine.abort_request(rid)

    def _unread(self, request_id: str, tracked: _Tracked) -> bool:
        limit = self.max_unread_outputs
        return (limit is not None
                and tracked.delivered - tracked.stream.taken(request_id) >= limit)

    def _update_holds(self) -> None:
        """Hold the requests whose readers are ``max_unread_outputs`` behind."""
        held = frozenset(rid for rid, t in self._tracked.items() if self._unread(rid, t))
        if held != self._held:
            self._held = held
            self.engine.hold(held)

    def _holds_changed(self) -> bool:
        """True when a held request's reader has caught up (or it has ended)."""
        for rid in self._held:
            tracked = self._tracked.get(rid)
            if tracked is None or not self._unread(rid, tracked):
                return True
        return False

    def _on_failure(self, exc: Exception, streams: list[RequestStream]) -> None:
        logger.exception("engine step failed; failing %d request(s) in flight",
                         len(self._tracked))
        self._fail_all(EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}"),
                       streams)
        self._recover()

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        timings = StepTimings()
        items: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            if out.error is not None:  # this request alone failed
                self._tracked.pop(out.request_id, None)
                items.append((tracked.stream, RequestFailedError(out.error)))
                continue
            tracked.delivered += 1
            if out.finished:
                del self._tracked[out.request_id]
                timings.e2e.append(now - tracked.arrival)
            if tracked.last_token_time is None:
                timings.ttft.append(now - tracked.arrival)
            else:
                timings.itl.append(now - tracked.last_token_time)
            tracked.last_token_time = now
            items.append((tracked.stream, out))
        self._deliver(items)
        for observer in self._observers:
            try:
                observer(timings)
            except Exception:
                logger.exception("step observer failed")

    def _recover(self) -> None:
        """After a failed step: abort everything; mark dead if the pool is not whole."""
        try:
            self.engine.abort_all()
            bm = self.engine.block_manager
            if bm.num_free_blocks != bm.num_blocks:
                raise RuntimeError(f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked")
        except Exception as exc:
            logger.exception("engine cannot recover from the failed step")
            self._dead = exc
            with self._cond:
                self._stopping = True

    def _fail_all(self, error: BaseException, streams: Sequence[RequestStream] = ()) -> None:
        """Send ``error`` to every stream in flight (and ``streams``), once each."""
        with self._cond:
            pending, self._adds = self._adds, []
        candidates = [t.stream for t in self._tracked.values()]
        candidates += [stream for _, stream in pending] + list(streams)
        items: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        seen: set[int] = set()
        for stream in candidates:
            if id(stream) not in seen and not stream.finished:
                seen.add(id(stream))
                items.append((stream, error))
        self._tracked.clear()
        self._deliver(items)

    @staticmethod
    def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _publish_stats(self) -> None:
        snapshot = self.engine.get_stats()
        self._live.record_tokens(time.monotonic(), snapshot)
        with self._cond:
            self._stats = snapshot
            self._in_transit = 0

    def _log_stats(self, elapsed: float, previous: tuple[int, int]) -> tuple[int, int]:
        return log_stats(logger, self._stats, elapsed, previous)


def _put_all(batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream._put(item)
