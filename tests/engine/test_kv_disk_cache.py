"""The persistent prefix cache through the engine (tiny random model): after a restart
a prompt's blocks come from disk and its logits are bitwise those of a cold run (alone
or batched with others, chunked); corrupt and foreign blocks are ignored; a directory
that cannot be used leaves the engine serving from memory."""

from __future__ import annotations

import errno
import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from roseinfer.engine.block_manager import chain_hash
from roseinfer.kvcache.store import DiskKVStore, key_name
from tests.engine.invariance_helpers import (
    Arrival,
    RunResult,
    assert_same_logits,
    cpu_kernels,
    greedy,
    load_arrivals,
    make_engine,
    random_prompt,
    run_schedule,
    tiny_gqa_llama,
)

BS = 16
PROMPT_LEN = 150  # 9 full blocks (144 tokens) can come from disk; the rest is computed


@pytest.fixture(scope="module")
def hf_model():
    return tiny_gqa_llama(seed=3)


@pytest.fixture(autouse=True)
def kernels() -> Iterator[None]:
    """Batch invariance is a contract of the C++ kernels (skipped where they cannot be
    built)."""
    with cpu_kernels(True):
        yield


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return random_prompt(random.Random(11), PROMPT_LEN)


def run(hf_model, quant: str, prompt: list[int], *, load: bool = False,
        **options: object) -> tuple[RunResult, object]:
    """The target prompt (greedy, 6 tokens), with a few other requests when ``load``;
    prefill chunks of 64 tokens. Returns (result, engine stats); the engine is shut down."""
    engine = make_engine(hf_model, quant, max_num_batched_tokens=64, block_size=BS, **options)
    arrivals = [Arrival(1 if load else 0, "target", prompt, greedy(6))]
    if load:
        arrivals += load_arrivals(random.Random(5), 4, last_step=3)
    result = run_schedule(engine, arrivals)
    stats = engine.get_stats()
    engine.shutdown()
    return result, stats


def block_files(root: Path, prompt: list[int]) -> list[Path]:
    """The files of the prompt's full blocks, in chain order (one model in ``root``)."""
    (sub,) = [d for d in root.iterdir() if d.is_dir()]
    parent, paths = None, []
    for i in range(len(prompt) // BS):
        parent = chain_hash(parent, tuple(prompt[i * BS:(i + 1) * BS]))
        paths.append(sub / (key_name(parent) + ".kvb"))
    return paths


@pytest.mark.parametrize("quant", ["none", "auto", "auto/int8"])  # /int8: the int8 KV pool
def test_restart_gives_bitwise_the_cold_logits(hf_model, prompt, quant: str,
                                               tmp_path: Path) -> None:
    cold, _ = run(hf_model, quant, prompt)
    first, stats = run(hf_model, quant, prompt, kv_cache_dir=str(tmp_path))
    assert stats.kv_disk_hit_tokens == 0
    assert all(p.is_file() for p in block_files(tmp_path, prompt))  # written when idle
    warm, stats = run(hf_model, quant, prompt, load=True, kv_cache_dir=str(tmp_path))
    assert stats.kv_disk_hit_tokens == 144 and stats.kv_disk_read_bytes > 0
    assert warm.recorder.requests["target"].num_cached_tokens == 144
    assert warm.tokens["target"] == cold.tokens["target"] == first.tokens["target"]
    assert_same_logits(cold, warm, "restarted, from disk, batched")


def test_bad_and_foreign_blocks_are_ignored(hf_model, prompt, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    cold, _ = run(hf_model, "none", prompt)
    run(hf_model, "none", prompt, kv_cache_dir=str(tmp_path))
    files = block_files(tmp_path, prompt)
    data = bytearray(files[3].read_bytes())
    data[len(data) // 2] ^= 0x40
    files[3].write_bytes(data)  # block 3 corrupt: blocks 0-2 load, the rest is computed
    with caplog.at_level(logging.WARNING, "roseinfer.kvcache"):
        warm, stats = run(hf_model, "none", prompt, kv_cache_dir=str(tmp_path))
    assert "checksum" in caplog.text and stats.kv_disk_rejected == 1
    assert stats.kv_disk_hit_tokens == 3 * BS
    assert_same_logits(cold, warm, "after a corrupt block")
    # Another model on the same directory: its own identity, none of these blocks.
    other, stats = run(tiny_gqa_llama(seed=4), "none", prompt, kv_cache_dir=str(tmp_path))
    assert stats.kv_disk_hit_tokens == 0 and stats.kv_disk_rejected == 0
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


def test_an_int8_pool_never_loads_float16_blocks(hf_model, prompt, tmp_path: Path) -> None:
    """The KV dtype is part of the identity: blocks of an fp16 pool ("auto" weights) are
    not found by an engine with the int8 pool (whose rows carry their scales), and the
    other way round."""
    run(hf_model, "auto", prompt, kv_cache_dir=str(tmp_path))
    _, stats = run(hf_model, "auto/int8", prompt, kv_cache_dir=str(tmp_path))
    assert stats.kv_disk_hit_tokens == 0 and stats.kv_disk_rejected == 0
    _, stats = run(hf_model, "auto", prompt, kv_cache_dir=str(tmp_path))
    assert stats.kv_disk_hit_tokens == 144  # its own blocks are still there
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


def test_unusable_directory_serves_from_memory(hf_model, prompt, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    cold, _ = run(hf_model, "none", prompt)
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, "roseinfer.kvcache"):
        got, _ = run(hf_model, "none", prompt, kv_cache_dir=str(tmp_path / "file" / "kv"))
    assert "KV disk cache off" in caplog.text
    assert got.tokens == cold.tokens

    def full(self: DiskKVStore, path: Path, parts: list) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskKVStore, "_write_atomic", full)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "roseinfer.kvcache"):
        got, stats = run(hf_model, "none", prompt, load=True, kv_cache_dir=str(tmp_path / "d"))
    assert "No space left" in caplog.text and stats.kv_disk_written_bytes == 0
    assert got.tokens["target"] == cold.tokens["target"]
    assert all(len(t[0]) > 0 for t in got.tokens.values())  # every request served


def test_blocks_evicted_while_busy_reach_the_disk(hf_model, prompt, tmp_path: Path) -> None:
    """A's cached blocks are evicted by B (20-block pool) before the engine is ever idle:
    they reach the disk through eviction, and a restart loads all of them."""
    cold, _ = run(hf_model, "none", prompt)
    engine = make_engine(hf_model, "none", max_num_batched_tokens=64, block_size=BS,
                         num_kv_blocks=20, kv_cache_dir=str(tmp_path))
    other = random_prompt(random.Random(12), 250)
    run_schedule(engine, [Arrival(0, "a", prompt, greedy(1)), Arrival(1, "b", other, greedy(8))])
    a_hashes = [int(p.stem, 16) for p in block_files(tmp_path, prompt)]
    assert sum(h in engine.block_manager._cached for h in a_hashes) < len(a_hashes) - 3
    engine.shutdown()
    assert all(p.is_file() for p in block_files(tmp_path, prompt))
    warm, stats = run(hf_model, "none", prompt, kv_cache_dir=str(tmp_path))
    assert stats.kv_disk_hit_tokens == 144
    assert_same_logits(cold, warm, "from blocks written at eviction")
