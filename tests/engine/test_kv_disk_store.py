"""The KV disk store without a model: block files are verified (corrupt, truncated,
foreign, other block: never loaded), the size bound holds (LRU by mtime), several
processes share one directory, and failing disks only turn writing off."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roseinfer.config import EngineConfig
from roseinfer.kvcache.block_file import BlockHeader, encode
from roseinfer.kvcache.store import MAX_WRITE_FAILURES, DiskKVStore
from roseinfer.kvcache.writer import BlockWriter

PAYLOAD = 4096
ROOT = Path(__file__).resolve().parents[2]


def header(store: DiskKVStore, key: int, parent: int | None = None,
           tokens: tuple[int, ...] = (1, 2, 3, 4)) -> BlockHeader:
    return BlockHeader(store.identity, f"{key:032x}",
                       None if parent is None else f"{parent:032x}", tokens, "float16",
                       (2, 2, 4, 2, 64))


def payload(key: int) -> memoryview:
    return memoryview(bytes((key * 7 + i) % 251 for i in range(PAYLOAD)))


def put(store: DiskKVStore, key: int) -> None:
    assert store.write(header(store, key), key, payload(key))


def test_round_trip_and_rejections(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskKVStore(tmp_path, "model-a", 1 << 30)
    for key in range(1, 6):
        put(store, key)
    assert bytes(store.read(header(store, 1), 1, PAYLOAD)) == bytes(payload(1))
    assert (store.path(1).stat().st_size - PAYLOAD) % 64 == 0  # the payload starts aligned
    assert store.read(header(store, 99), 99, PAYLOAD) is None  # absent: a plain miss
    data = bytearray(store.path(2).read_bytes())
    data[-100] ^= 1  # one bit of the payload
    store.path(2).write_bytes(data)
    store.path(3).write_bytes(store.path(3).read_bytes()[:-10])  # truncated
    with caplog.at_level(logging.WARNING, "roseinfer.kvcache"):
        assert store.read(header(store, 2), 2, PAYLOAD) is None
        assert store.read(header(store, 3), 3, PAYLOAD) is None
        # The right file, asked as another block: other tokens, parent, or model.
        assert store.read(header(store, 4, tokens=(9, 9, 9, 9)), 4, PAYLOAD) is None
        assert store.read(header(store, 5, parent=7), 5, PAYLOAD) is None
        foreign = DiskKVStore(tmp_path, "model-b", 1 << 30)
        foreign.path(1).write_bytes(store.path(1).read_bytes())  # model-a's block
        assert foreign.read(header(foreign, 1), 1, PAYLOAD) is None
    assert store.stats.rejected == 4 and foreign.stats.rejected == 1
    assert "checksum" in caplog.text and "truncated" in caplog.text and "identity" in caplog.text
    assert not store.path(2).exists() and not foreign.path(1).exists()  # bad files removed
    assert store.stats.hits == 0  # counted by the tier, on loads


def test_size_bound_evicts_least_recently_used(tmp_path: Path) -> None:
    size = len(b"".join(bytes(p) for p in encode(header(DiskKVStore(tmp_path, "x", 1), 0),
                                                  payload(0))))
    store = DiskKVStore(tmp_path, "m", 6 * size)
    now = time.time()
    for key in range(1, 7):
        put(store, key)
        os.utime(store.path(key), (now - 100 + key, now - 100 + key))  # 1 oldest ... 6
    store.touch(1)  # read recently: the newest now
    put(store, 7)  # over the bound: the oldest go, down to 90% with room for 7
    on_disk = sorted(int(p.stem, 16) for p in store.dir.glob("*.kvb"))
    assert on_disk == [1, 4, 5, 6, 7]
    assert sum(p.stat().st_size for p in store.dir.glob("*.kvb")) <= store.max_bytes
    assert store.stats.evicted == 2


_WRITER = """
import sys
from pathlib import Path
from roseinfer.kvcache.block_file import BlockHeader
from roseinfer.kvcache.store import DiskKVStore
root, me = Path(sys.argv[1]), int(sys.argv[2])
store = DiskKVStore(root, "shared", int(sys.argv[3]))
for i in range(60):
    key = i % 40 if me == 0 else 20 + i % 40  # keys 20..39 written by both
    h = BlockHeader("shared", f"{key:032x}", None, (key,), "float16", (1,))
    body = memoryview(bytes((key + j) % 256 for j in range(4096)))
    store.write(h, key, body)
    got = store.read(h, key, 4096)
    assert got is None or bytes(got) == bytes(body), key
print("ok", store.stats.rejected)
"""


def test_processes_share_a_directory(tmp_path: Path) -> None:
    limit = 30 * 4300  # fewer blocks than the two write: both evict while the other writes
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(me), str(limit)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for me in (0, 1)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.split() == ["ok", "0"]  # no process ever saw a partial file
    store = DiskKVStore(tmp_path, "shared", limit)
    files = list(store.dir.glob("*.kvb"))
    assert files and not list(store.dir.glob(".*.tmp"))
    for path in files:
        key = int(path.stem, 16)
        h = BlockHeader("shared", path.stem, None, (key,), "float16", (1,))
        assert store.read(h, key, 4096) is not None
    assert sum(p.stat().st_size for p in store.dir.glob("*.kvb")) <= limit * 1.2


def test_uncreatable_root_turns_the_store_off(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING, "roseinfer.kvcache"):
        store = DiskKVStore(tmp_path / "file" / "kv", "m", 1 << 20)
    assert not store.enabled and not store.writable and "memory only" in caplog.text
    assert not store.write(header(store, 1), 1, payload(1))
    assert store.read(header(store, 1), 1, PAYLOAD) is None and not store.has(1)


def test_full_disk_evicts_once_then_stops_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    store = DiskKVStore(tmp_path, "m", 1 << 30)
    put(store, 1)
    calls = []

    def full(path: Path, parts: list) -> None:
        calls.append(path)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write_atomic", full)
    with caplog.at_level(logging.WARNING, "roseinfer.kvcache"):
        for key in range(2, 2 + MAX_WRITE_FAILURES):
            assert not store.write(header(store, key), key, payload(key))
    assert len(calls) == 2 * MAX_WRITE_FAILURES  # each: a try, an eviction, a retry
    assert not store.writable and store.stats.write_errors == MAX_WRITE_FAILURES
    assert "No space left" in caplog.text and "no more blocks are written" in caplog.text
    assert not store.write(header(store, 50), 50, payload(50))
    assert len(calls) == 2 * MAX_WRITE_FAILURES  # not even tried


def test_writer_queue_is_bounded_and_flushes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    store = DiskKVStore(tmp_path, "m", 1 << 30)
    real_write = store.write
    gate = __import__("threading").Event()

    def slow(*args: object) -> bool:
        assert gate.wait(30)
        return real_write(*args)

    monkeypatch.setattr(store, "write", slow)
    done: list[int] = []
    writer = BlockWriter(store, max_pending_bytes=3 * PAYLOAD,
                         on_done=lambda key, ok: done.append(key) if ok else None)
    accepted = [writer.submit(header(store, k), k, payload(k)) for k in range(1, 7)]
    assert accepted[:3] == [True] * 3 and not all(accepted)  # full: dropped, never waits
    assert store.stats.dropped == accepted.count(False)
    assert not writer.flush(0.05)  # bounded wait
    gate.set()
    assert writer.flush(30)
    assert sorted(done) == [k for k, ok in zip(range(1, 7), accepted, strict=True) if ok]
    writer.close()
    assert not writer.submit(header(store, 9), 9, payload(9))


def test_config_checks_the_options() -> None:
    assert EngineConfig(kv_cache_dir="/tmp/kv", kv_cache_dir_size="1.5G").kv_cache_dir_size == (
        3 << 29)
    assert EngineConfig(kv_cache_dir_size="500M").kv_cache_dir_size == 500 << 20
    assert EngineConfig(kv_cache_dir_size=4096).kv_cache_dir_size == 4096
    for bad, why in [(dict(kv_cache_dir_size="lots"), "kv_cache_dir_size"),
                     (dict(kv_cache_dir_size=0), "kv_cache_dir_size"),
                     (dict(kv_cache_dir="/tmp/kv", enable_prefix_caching=False),
                      "enable_prefix_caching"),
                     (dict(kv_cache_dir="/tmp/kv", tensor_parallel_size=2),
                      "tensor_parallel_size")]:
        with pytest.raises(ValueError, match=why):
            EngineConfig(**bad)
