"""DiskKVStore: a directory of KV block files, shared by processes, bounded in size.

Layout: ``<root>/<model identity>/<chain hash, 32 hex>.kvb`` (``block_file`` format).
Several engines (processes) may use one root at once, for one model or several:

* writes are atomic: a temp file in the same directory (``.<name>.<pid>.<n>.tmp``) is
  renamed over the final name, so a reader sees a whole file or none; two processes
  writing the same block write the same bytes;
* a read verifies the file (``block_file.decode``) and refreshes its mtime, the LRU
  clock (atime is unreliable under ``relatime`` / ``noatime``); a bad file is logged,
  removed and counted, never loaded; a file removed by another process is a miss;
* the size bound (``max_bytes``, all identities together) is kept by the writing
  processes: each counts what it wrote since it last scanned the root, and when that
  estimate passes the bound (or every ``RESCAN_WRITES`` writes) it scans, then deletes the
  oldest files (mtime) down to ``LOW_WATER`` of the bound; temp files of writers that
  died are removed by the scan after ``STALE_TMP_S``;
* errors never fail a request: a root that cannot be created is a warning and the
  store is off (``enabled`` False); a write that fails (disk full, read-only,
  permissions) is a warning, retried once after an eviction when the disk is full, and
  after ``MAX_WRITE_FAILURES`` failures in a row writing stops (memory-only, warned).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from roseinfer.kvcache.block_file import BlockFileError, BlockHeader, decode, encode

logger = logging.getLogger("roseinfer.kvcache")

SUFFIX = ".kvb"
LOW_WATER = 0.9
RESCAN_WRITES = 256
STALE_TMP_S = 600.0
MAX_WRITE_FAILURES = 8


@dataclass(slots=True)
class DiskStats:
    """Counters of one process's use of the store (engine thread: reads; writer
    thread: writes)."""

    hits: int = 0  # blocks loaded from disk
    misses: int = 0  # lookups that found no block on disk
    read_bytes: int = 0
    written_blocks: int = 0
    written_bytes: int = 0
    rejected: int = 0  # files found bad (corrupt, truncated, foreign) and not loaded
    write_errors: int = 0
    dropped: int = 0  # blocks not written: the write queue was full
    evicted: int = 0  # files deleted to keep the size bound


def key_name(key: int) -> str:
    """The file stem of a chain hash (any int; 128 bits are kept)."""
    return format(key & ((1 << 128) - 1), "032x")


class DiskKVStore:
    def __init__(self, root: Path, identity: str, max_bytes: int,
                 stats: DiskStats | None = None) -> None:
        self.root = Path(root)
        self.identity = identity
        self.max_bytes = max_bytes
        self.stats = stats or DiskStats()
        self.dir = self.root / identity
        self.enabled = True
        self.writable = True
        self._counter = itertools.count()
        self._estimate = 0  # bytes in the root at the last scan + written since
        self._writes_since_scan = 0
        self._failures = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("KV disk cache off: cannot create %s (%s); prefixes are cached in "
                           "memory only", self.dir, exc)
            self.enabled = self.writable = False
            return
        if not os.access(self.dir, os.W_OK | os.X_OK):
            logger.warning("KV disk cache %s is not writable: blocks are read from it but "
                           "none are written", self.dir)
            self.writable = False
        self._scan_and_evict()

    def path(self, key: int) -> Path:
        return self.dir / (key_name(key) + SUFFIX)

    def has(self, key: int) -> bool:
        return self.enabled and self.path(key).is_file()

    def touch(self, key: int) -> bool:
        """Mark a block as recently used (its mtime is the LRU clock); False if its file
        is gone."""
        try:
            os.utime(self.path(key))
        except FileNotFoundError:
            return False
        except OSError:
            pass  # a read-only store: the file is there
        return True

    # ------------------------------------------------------------------ read
    def read(self, expected: BlockHeader, key: int, payload_bytes: int) -> memoryview | None:
        """The block's payload if its file is there and valid; None (a miss) otherwise."""
        if not self.enabled:
            return None
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > payload_bytes + (2 << 20):
                    raise BlockFileError(f"too large ({size} bytes)")
                data = bytearray(size)
                got = f.readinto(data)
            if got != size:
                raise BlockFileError(f"short read ({got} of {size} bytes)")
            payload = decode(data, expected, payload_bytes)
        except FileNotFoundError:
            return None
        except BlockFileError as exc:
            self.stats.rejected += 1
            logger.warning("KV disk cache: ignoring %s: %s", path, exc)
            self._remove(path)
            return None
        except OSError as exc:
            logger.warning("KV disk cache: cannot read %s: %s", path, exc)
            return None
        self.stats.read_bytes += size
        self.touch(key)
        return payload

    # ----------------------------------------------------------------- write
    def write(self, header: BlockHeader, key: int, payload: memoryview) -> bool:
        """Write one block atomically (writer thread); False if it was not written."""
        if not self.writable:
            return False
        path = self.path(key)
        if path.exists():
            return True  # another engine (or an earlier run) wrote it: same bytes
        parts = encode(header, payload)
        size = sum(len(p) for p in parts)
        if self._estimate + size > self.max_bytes or self._writes_since_scan >= RESCAN_WRITES:
            self._scan_and_evict(size)
        for attempt in range(2):
            try:
                self._write_atomic(path, parts)
                break
            except OSError as exc:
                if attempt == 0 and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._scan_and_evict(size, force=True)
                    continue
                self._write_failed(path, exc)
                return False
        self._failures = 0
        self._estimate += size
        self._writes_since_scan += 1
        self.stats.written_blocks += 1
        self.stats.written_bytes += size
        return True

    def _write_atomic(self, path: Path, parts: list[bytes | memoryview]) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(self._counter)}.tmp")
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except BaseException:
            self._remove(tmp)
            raise

    def _write_failed(self, path: Path, exc: OSError) -> None:
        self.stats.write_errors += 1
        self._failures += 1
        if self._failures >= MAX_WRITE_FAILURES:
            self.writable = False
            logger.warning("KV disk cache: %d writes failed in a row (last: %s); no more "
                           "blocks are written to %s (prefixes stay cached in memory)",
                           self._failures, exc, self.dir)
        elif self._failures == 1:
            logger.warning("KV disk cache: cannot write %s: %s (the block stays in memory "
                           "only)", path, exc)

    # ------------------------------------------------------------ size bound
    def _scan_and_evict(self, incoming: int = 0, force: bool = False) -> None:
        """Measure the root; delete the oldest block files until ``incoming`` more bytes
        fit under ``LOW_WATER`` of the bound (all of the root's identities count)."""
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        try:
            subdirs = [d for d in self.root.iterdir() if d.is_dir()]
        except OSError:
            return
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TMP_S:
                        self._remove(Path(entry.path))
                    continue
                if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    files.append((st.st_mtime, st.st_size, Path(entry.path)))
        total = sum(size for _, size, _ in files)
        self._writes_since_scan = 0
        if total + incoming > self.max_bytes or force:
            target = LOW_WATER * self.max_bytes - incoming
            files.sort(key=lambda f: f[0])
            for _, size, path in files:
                if total <= target:
                    break
                if self._remove(path):
                    total -= size
                    self.stats.evicted += 1
        self._estimate = total

    @staticmethod
    def _remove(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError:
            return False
