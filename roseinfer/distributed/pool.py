"""Rank 0's worker processes: spawn, start-up handshake, liveness, stop.

Workers are started with torch.multiprocessing's spawn context (daemonic: never left
behind by a normal exit).  ``wait_ready`` polls rank 0's store for each worker's
``ready/<rank>`` (or ``error/<rank>``: the worker's exception, re-raised here as a
``RuntimeError``) while checking that the processes live, then sets ``go`` so every
rank joins the process groups together.

Ranks above ``num_local`` join from other hosts (``worker.join_main``): the pool
waits for their ``ready/<rank>`` too, but sees their death only through the
collectives (a closed socket at once, a silent host after ``distributed_timeout_s``).

Liveness of the local workers is read from the processes' sentinels (``multiprocessing.connection.wait``
with no timeout): a few microseconds, from any thread; only a worker already gone is
reaped (for its exit code).

``close`` (idempotent; also run by ``weakref.finalize`` when the pool is collected or
at interpreter exit) sends ``STOP`` when the workers are idle and healthy - it takes
the step lock, so never in the middle of a step - and waits for them to exit; anything
still alive after that is terminated, then killed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import torch.distributed as dist
import torch.multiprocessing as mp

from roseinfer.distributed.errors import WorkerDiedError
from roseinfer.distributed.worker import WorkerSpec, worker_main

logger = logging.getLogger("roseinfer.distributed")


@dataclass
class _PoolState:
    """What ``close`` needs; held by the finalizer, so it must not refer to the pool."""

    procs: list[BaseProcess]
    lock: threading.Lock  # held during each step
    stop: Callable[[], None] | None = None  # broadcasts STOP (set once the group exists)
    healthy: bool = True  # False after a failed step: no more collectives
    closed: bool = field(default=False)


class WorkerPool:
    def __init__(self, procs: list[BaseProcess]) -> None:
        self.state = _PoolState(procs, threading.Lock())
        self.size = len(procs) + 1  # ranks in all, remote ones included
        self._finalizer = weakref.finalize(self, _close, self.state)

    @classmethod
    def spawn(cls, spec: WorkerSpec, num_local: int) -> WorkerPool:
        """Start ranks 1..``num_local`` here; the ranks above join from other hosts
        (``roseinfer tp-worker``), seen only through the store and the collectives."""
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker_main, args=(spec, rank), daemon=True,
                             name=f"roseinfer-tp-rank-{rank}")
                 for rank in range(1, num_local + 1)]
        pool = cls([])
        pool.size = spec.plan.size
        for p in procs:
            p.start()
            pool.state.procs.append(p)
        return pool

    @property
    def lock(self) -> threading.Lock:
        return self.state.lock

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.state.procs if p.pid is not None]

    def dead(self, timeout: float = 0.0) -> list[str]:
        """'rank r (pid, exit code)' for each worker that has exited (waiting up to
        ``timeout`` s for one to, e.g. after a collective saw a peer's socket close)."""
        procs = self.state.procs
        gone = set(wait([p.sentinel for p in procs], timeout=timeout))
        dead = [(r, p) for r, p in enumerate(procs, start=1) if p.sentinel in gone]
        for _, p in dead:
            p.join(1.0)  # its sentinel closes a moment before it can be reaped
        return [f"rank {r} (pid {p.pid}, exit code {p.exitcode})" for r, p in dead]

    def check(self) -> None:
        """``WorkerDiedError`` if any worker has exited."""
        dead = self.dead()
        if dead:
            raise WorkerDiedError(f"tensor-parallel worker {', '.join(dead)} has exited")

    def wait_ready(self, store: dist.Store, timeout_s: float) -> None:
        """Until every worker has loaded its shard; then let all ranks join the groups."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(1, self.size))
        while waiting:
            for rank in sorted(waiting):
                if store.check([f"error/{rank}"]):
                    why = store.get(f"error/{rank}").decode(errors="replace")
                    raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start: "
                                       f"{why}")
                if store.check([f"ready/{rank}"]):
                    waiting.discard(rank)
            dead = self.dead()
            if waiting and dead:
                raise RuntimeError(f"tensor-parallel worker {', '.join(dead)} exited while "
                                   "starting")
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers {sorted(waiting)} not ready "
                                   f"after {timeout_s:.0f} s")
            if waiting:
                time.sleep(0.02)
        store.set("go", "1")

    def attach(self, stop: Callable[[], None]) -> None:
        """The group exists: ``close`` may now stop the workers with a message."""
        self.state.stop = stop

    def mark_failed(self) -> None:
        """After a failed step: no more collectives; ``close`` kills the workers."""
        self.state.healthy = False

    def close(self) -> None:
        self._finalizer()


def _close(state: _PoolState) -> None:
    if state.closed:
        return
    state.closed = True
    procs = state.procs
    stopped = False
    # Every local worker alive (remote ranks are assumed to be: STOP reaches them too).
    alive = not wait([p.sentinel for p in procs], timeout=0) if procs else True
    if state.stop is not None and state.healthy and alive and state.lock.acquire(timeout=2):
        try:
            state.stop()
            stopped = True
        except Exception as exc:  # noqa: BLE001 - they are killed below
            logger.warning("could not stop the tensor-parallel workers cleanly: %s", exc)
        finally:
            state.lock.release()
    deadline = time.monotonic() + (5.0 if stopped else 0.0)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
