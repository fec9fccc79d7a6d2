"""Back the KV pool's next blocks with memory while the engine is idle.

On CPU the pool is anonymous memory that the kernel backs when a block is first written
(``kv_pool.anonymous_pages``). That first write is slow: the kernel zeroes each page,
and on a virtual machine the host may have to back it too. On a 2-core Zen 5 VM it ran
at 0.4-5 GB/s, against ~30 GB/s for memory written before, and the served workload (16
streams, every block new) ran 6-14% slower on fresh blocks than on blocks backed
beforehand (docs/kv-cache.md, "Backing the pool ahead of use"). llama.cpp pays this once
at start by zeroing its whole cache; vLLM preallocates.

``KVBacking`` is one thread that asks the kernel to back (``madvise(MADV_POPULATE_WRITE)``,
Linux 5.14+) the blocks from the block manager's high-water mark to ``window`` blocks
past it: fresh blocks are taken in block-id order, so these are the next ones the engine
will write. Backing changes no byte of the pool. The thread works only while the engine
has no request (``busy``), one call of at most 2 MiB at a time, at the lowest CPU
priority (nice 19): after start and between bursts, never competing with a step. The
pool's memory thus grows at most ``window`` blocks ahead of what the engine has used,
never to the whole pool at once. Where the kernel lacks the call, the thread stops at its
first attempt and every block is backed when first written, as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from torch import Tensor

logger = logging.getLogger("roseinfer.runner")

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); mmap.MADV_POPULATE_WRITE from Python 3.12
_CALL_BYTES = 2 << 20  # one madvise call at most: the kernel holds the mm's lock for it
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def backing_supported(caches: list[Tensor]) -> bool:
    """Whether ``KVBacking`` can run on these caches: Linux, CPU tensors."""
    return sys.platform == "linux" and bool(caches) and all(c.device.type == "cpu"
                                                            for c in caches)


class KVBacking:
    """The background thread of the module docstring. ``caches``: the pool, one tensor a
    layer of shape [2 (K, V), slots, ...]; ``high_water``: one past the largest block id
    the engine has taken; ``busy``: whether the engine has requests (both read from this
    thread without a lock: hints, rechecked before every call); ``window``: blocks to
    keep backed past the high-water mark."""

    def __init__(self, caches: list[Tensor], block_size: int, num_blocks: int,
                 high_water: Callable[[], int], busy: Callable[[], bool], window: int) -> None:
        self._caches = caches  # kept alive while the thread may touch their memory
        self._num_blocks = num_blocks
        self._high_water = high_water
        self._busy = busy
        self._window = max(0, min(window, num_blocks))
        # each half (K or V) of a layer: (base address, bytes per block)
        self._halves = [(c[h].data_ptr(), block_size * c[h][0].numel() * c.element_size())
                        for c in caches for h in range(c.shape[0])]
        per_block = max(b for _, b in self._halves)
        self._chunk = max(1, _CALL_BYTES // per_block)  # blocks per call and half
        self.backed = 0  # blocks [0, backed) are backed or were written by the engine
        self.error: str | None = None  # why the thread stopped early, if it did
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="roseinfer-kv-backing",
                                        daemon=True)

    def start(self) -> KVBacking:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (after its current call, a few milliseconds) and wait for it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def wait_until(self, blocks: int, timeout: float) -> bool:
        """Wait until the first ``blocks`` blocks are backed (or the thread ended);
        whether they are. For tests and benchmarks."""
        deadline = time.monotonic() + timeout
        while self.backed < blocks and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.backed >= blocks

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:  # this thread only (Linux nice values are per thread)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        began, reported = time.monotonic(), False
        while not self._stop.is_set():
            high = min(self._high_water(), self._num_blocks)  # read once a pass
            self.backed = max(self.backed, high)
            if self.backed >= self._num_blocks:
                return
            target = min(self._num_blocks, high + self._window)
            if self.backed >= target or self._busy():
                if not reported and self.backed >= target:
                    reported = True
                    logger.info("KV pool: its first %d blocks backed with memory in %.2f s",
                                self.backed, time.monotonic() - began)
                self._stop.wait(0.1)
                continue
            end = min(target, self.backed + self._chunk)
            for base, per_block in self._halves:  # K and V of every layer
                if self._stop.is_set() or self._busy():  # the chunk again once idle
                    break
                start = base + self.backed * per_block
                aligned = start - start % _PAGE
                if madvise(aligned, base + end * per_block - aligned, MADV_POPULATE_WRITE):
                    self.error = os.strerror(ctypes.get_errno())
                    logger.debug("KV pool backing stopped: madvise: %s", self.error)
                    return
            else:
                self.backed = end


def start_kv_backing(caches: list[Tensor], block_size: int, num_blocks: int,
                     high_water: Callable[[], int], busy: Callable[[], bool],
                     window_gb: float) -> KVBacking | None:
    """A started ``KVBacking`` keeping ``window_gb`` GiB of blocks backed ahead of
    ``high_water`` while not ``busy``; None where it cannot run (not Linux, not CPU) or
    ``window_gb`` is 0."""
    if window_gb <= 0 or not backing_supported(caches):
        return None
    per_block = sum(c.element_size() * c.numel() for c in caches) // num_blocks
    window = int(window_gb * (1 << 30)) // max(1, per_block)
    if window < 1:  # less than a block
        return None
    return KVBacking(caches, block_size, num_blocks, high_water, busy, window).start()
