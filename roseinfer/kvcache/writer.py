"""BlockWriter: writes block files on a background thread, off the engine's path.

The engine thread hands over finished snapshots (``submit``: header, key, payload
bytes); a bounded queue (by bytes) holds them. When it is full the block is dropped
(counted; it stays in memory and is offered again when the engine is next idle), so the
engine never waits for the disk. ``flush`` waits (bounded) until the queue is empty;
``close`` flushes and stops the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from roseinfer.kvcache.block_file import BlockHeader
from roseinfer.kvcache.store import DiskKVStore

logger = logging.getLogger("roseinfer.kvcache")

Job = tuple[BlockHeader, int, memoryview]


class BlockWriter:
    def __init__(self, store: DiskKVStore, max_pending_bytes: int,
                 on_done: Callable[[int, bool], None] = lambda key, ok: None) -> None:
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self._on_done = on_done  # called (writer thread) with each key and whether written
        self._jobs: deque[Job] = deque()
        self._pending = 0  # bytes queued or being written
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="roseinfer-kv-writer",
                                        daemon=True)
        self._thread.start()

    def submit(self, header: BlockHeader, key: int, payload: memoryview) -> bool:
        """Queue one block; False (dropped, counted) when the queue is full or closed."""
        with self._cond:
            if self._closed or self._pending + len(payload) > self.max_pending_bytes:
                self.store.stats.dropped += 1
                return False
            self._jobs.append((header, key, payload))
            self._pending += len(payload)
            self._cond.notify_all()
        return True

    @property
    def pending_bytes(self) -> int:
        return self._pending

    def flush(self, timeout: float) -> bool:
        """Wait until every queued block is written (True) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to ``timeout``), then stop; idempotent."""
        if not self.flush(timeout):
            logger.warning("KV disk cache: %d bytes of blocks not written at shutdown "
                           "(timed out after %.0f s)", self._pending, timeout)
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                header, key, payload = self._jobs.popleft()
                self._busy = True
            ok = False
            try:
                ok = self.store.write(header, key, payload)
            except Exception:  # never let the writer die: the engine must not notice
                logger.exception("KV disk cache: writing block %s failed", header.key)
            self._on_done(key, ok)
            with self._cond:
                self._busy = False
                self._pending -= len(payload)
                self._cond.notify_all()
