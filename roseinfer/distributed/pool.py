"""Rank 0's worker processes: start, start-up handshake, liveness, stop.

Local workers are plain subprocesses, ``python -m roseinfer.cli tp-worker`` (``start``):
a fresh interpreter that never imports the user's ``__main__`` (multiprocessing's spawn
did, so a script without ``if __name__ == "__main__":`` re-ran itself in every worker).
Each gets the group's secret in its environment, never on its command line, and rank 0's
pid to watch (``worker.join_main``).  Its stderr is copied through to rank 0's, and the
last lines are kept (``_Tail``) for the error of a worker that died while starting.

``wait_ready`` polls rank 0's store for each worker's signed ``ready/<rank>`` (naming the
spec it read) or ``error/<rank>`` (its traceback, re-raised here as a ``RuntimeError``),
while checking that the processes live, then sets ``go`` so every rank joins the process
groups together.  A value not signed with the secret is a ``StoreAuthError``.

Ranks above ``num_local`` join from other hosts: the pool waits for their ``ready/<rank>``
too, but sees their death only through the collectives (a closed socket at once, a
silent host after ``distributed_timeout_s``).

Liveness of the local workers is ``Popen.poll`` (a ``waitpid`` with ``WNOHANG``: a few
microseconds, from any thread).  ``close`` (idempotent; also run by ``weakref.finalize``
when the pool is collected or at interpreter exit) sends ``STOP`` when the workers are
idle and healthy - it takes the step lock, so never in the middle of a step - and waits
for them to exit; anything still alive after that is terminated, then killed.
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from roseinfer.distributed.auth import SECRET_ENV, SignedStore
from roseinfer.distributed.errors import WorkerDiedError

logger = logging.getLogger("roseinfer.distributed")
TAIL_LINES = 40  # of a worker's stderr, shown when it dies while starting


class _Tail:
    """Copies a worker's stderr to ours, line by line, keeping the last lines."""

    def __init__(self, stream: IO[bytes], rank: int) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True,
                                       name=f"roseinfer-tp-stderr-{rank}")
        self.thread.start()

    def _pump(self, stream: IO[bytes]) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace")
                self.lines.append(line.rstrip("\n"))
                try:
                    sys.stderr.write(line)
                except (OSError, ValueError):  # our stderr closed: keep the tail only
                    pass

    def text(self, wait_s: float = 1.0) -> str:
        self.thread.join(wait_s)  # the rest of a dead worker's output
        return "\n".join(self.lines)


@dataclass
class _PoolState:
    """What ``close`` needs; held by the finalizer, so it must not refer to the pool."""

    procs: list[subprocess.Popen[bytes]]
    lock: threading.Lock  # held during each step
    stop: Callable[[], None] | None = None  # broadcasts STOP (set once the group exists)
    healthy: bool = True  # False after a failed step: no more collectives
    closed: bool = field(default=False)


class WorkerPool:
    def __init__(self, procs: list[subprocess.Popen[bytes]], size: int) -> None:
        self.state = _PoolState(procs, threading.Lock())
        self.size = size  # ranks in all, remote ones included
        self.tails: list[_Tail] = []
        self._finalizer = weakref.finalize(self, _close, self.state)

    @classmethod
    def start(cls, init_method: str, host: str, secret: str, size: int, num_local: int,
              ) -> WorkerPool:
        """Start ranks 1..``num_local`` here; the ranks above join from other hosts
        (``roseinfer tp-worker``), seen only through the store and the collectives."""
        pool = cls([], size)
        env = dict(os.environ)
        env[SECRET_ENV] = secret
        try:
            for rank in range(1, num_local + 1):
                proc = subprocess.Popen(
                    [sys.executable, "-m", "roseinfer.cli", "tp-worker",
                     "--distributed-init-method", init_method, "--rank", str(rank),
                     "--host", host, "--parent-pid", str(os.getpid())],
                    env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
                pool.state.procs.append(proc)
                assert proc.stderr is not None
                pool.tails.append(_Tail(proc.stderr, rank))
        except BaseException:
            pool.mark_failed()
            pool.close()
            raise
        return pool

    @property
    def lock(self) -> threading.Lock:
        return self.state.lock

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.state.procs]

    def dead(self, timeout: float = 0.0) -> list[str]:
        """'rank r (pid, exit code)' for each worker that has exited (waiting up to
        ``timeout`` s for one to, e.g. after a collective saw a peer's socket close)."""
        return [f"rank {r} (pid {p.pid}, exit code {p.returncode})"
                for r, p in self._exited(timeout)]

    def _exited(self, timeout: float = 0.0) -> list[tuple[int, subprocess.Popen[bytes]]]:
        deadline = time.monotonic() + timeout
        while True:
            gone = [(r, p) for r, p in enumerate(self.state.procs, start=1)
                    if p.poll() is not None]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.01)

    def check(self) -> None:
        """``WorkerDiedError`` if any worker has exited."""
        dead = self.dead()
        if dead:
            raise WorkerDiedError(f"tensor-parallel worker {', '.join(dead)} has exited")

    def wait_ready(self, store: SignedStore, spec_digest: str, timeout_s: float) -> None:
        """Until every worker has loaded its shard; then let all ranks join the groups."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(1, self.size))
        while waiting:
            for rank in sorted(waiting):
                self._raise_reported(store, rank)
                if store.check([f"ready/{rank}"]):
                    ready = store.get_json(f"ready/{rank}")
                    if ready != {"rank": rank, "spec": spec_digest}:
                        raise RuntimeError(f"tensor-parallel worker rank {rank} is ready with "
                                           f"another spec than this engine's: {ready!r}")
                    waiting.discard(rank)
            exited = self._exited() if waiting else []
            for rank, _ in exited:
                self._raise_reported(store, rank)  # written just before it exited
            if exited:
                tails = "\n".join(f"[rank {r}] {self.tails[r - 1].text()}" for r, _ in exited)
                raise RuntimeError(f"tensor-parallel worker {', '.join(self.dead())} exited "
                                   f"while starting; its stderr ended with:\n{tails}")
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers {sorted(waiting)} not ready "
                                   f"after {timeout_s:.0f} s")
            if waiting:
                time.sleep(0.02)
        store.set_json("go", {"spec": spec_digest})

    @staticmethod
    def _raise_reported(store: SignedStore, rank: int) -> None:
        """Rank ``rank``'s own error (its traceback), if it wrote one."""
        if not store.check([f"error/{rank}"]):
            return
        report = store.get_json(f"error/{rank}")  # StoreAuthError if forged
        why = report.get("error") if isinstance(report, dict) else None
        if not isinstance(why, str):
            why = repr(report)
        raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start:\n{why}")

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
    alive = all(p.poll() is None for p in procs)
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
        _wait(p, max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        if not _wait(p, 2.0):
            p.kill()
            _wait(p, 1.0)


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """True once ``proc`` has exited (reaped) within ``timeout`` s."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True
