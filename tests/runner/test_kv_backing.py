"""The KV pool's next blocks backed with memory while the engine is idle
(``roseinfer/runner/kv_backing.py``): which pages, when, and that no value changes."""

from __future__ import annotations

import ctypes
import os
import sys
import time

import pytest
import torch

from roseinfer.config import EngineConfig
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.request import Request
from roseinfer.model.config import ModelConfig
from roseinfer.runner.kv_backing import KVBacking, start_kv_backing
from roseinfer.runner.kv_pool import allocate_kv_caches
from roseinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="mincore / MADV_POPULATE_WRITE")

# Per layer and half (K or V), a block is 16 slots x 2 heads x 512 x 2 bytes = 32 KiB:
# a 2 MiB huge page holds 64 blocks.
MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=512,
                    intermediate_size=128, max_position_embeddings=1024)
BS, BLOCKS, BLOCK_BYTES = 16, 1024, 32 << 10
SLACK = 64  # blocks: one huge page past a backed range may be backed with it
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_blocks(caches: list[torch.Tensor], lo: int, hi: int) -> list[float]:
    """Per layer and half, the share of the pages of blocks [lo, hi) in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    shares = []
    for cache in caches:
        for half in cache:
            start = half.data_ptr() + lo * BLOCK_BYTES
            end = half.data_ptr() + hi * BLOCK_BYTES
            first = start - start % PAGE
            pages = -(-(end - first) // PAGE)
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(first, end - first, vec) == 0, os.strerror(ctypes.get_errno())
            shares.append(sum(v & 1 for v in vec) / pages)
    return shares


def backing(caches: list[torch.Tensor], high: list[int], busy: list[bool],
            window: int) -> KVBacking:
    return KVBacking(caches, BS, BLOCKS, lambda: high[0], lambda: busy[0], window).start()


def wait_backed(kb: KVBacking, blocks: int) -> None:
    if not kb.wait_until(blocks, timeout=30.0):
        if kb.error is not None:
            kb.stop()
            pytest.skip(f"this kernel cannot back pages ahead (madvise: {kb.error})")
        raise AssertionError(f"{kb.backed} of {blocks} blocks backed")


def test_backs_a_window_past_the_high_water_mark() -> None:
    caches = allocate_kv_caches(MODEL, BLOCKS, BS, torch.float16, torch.device("cpu"))
    assert caches[0][0].numel() * 2 == BLOCKS * BLOCK_BYTES
    high, busy = [0], [False]
    kb = backing(caches, high, busy, window=128)
    try:
        wait_backed(kb, 128)
        time.sleep(0.3)  # it must stop there
        assert kb.backed == 128
        assert min(resident_blocks(caches, 0, 128)) == 1.0
        assert max(resident_blocks(caches, 128 + SLACK, BLOCKS)) == 0.0
        high[0] = 512  # the engine took blocks up to 511 (and wrote them itself)
        wait_backed(kb, 640)
        assert min(resident_blocks(caches, 512, 640)) == 1.0
        assert max(resident_blocks(caches, 640 + SLACK, BLOCKS)) == 0.0
        assert max(resident_blocks(caches, 128 + SLACK, 512 - SLACK)) == 0.0  # skipped
    finally:
        kb.stop()
    assert not kb.running


def test_waits_while_the_engine_is_busy() -> None:
    caches = allocate_kv_caches(MODEL, BLOCKS, BS, torch.float16, torch.device("cpu"))
    high, busy = [0], [True]
    kb = backing(caches, high, busy, window=256)
    try:
        time.sleep(0.5)
        assert kb.backed == 0 and kb.running
        assert max(resident_blocks(caches, 0, BLOCKS)) == 0.0
        busy[0] = False
        wait_backed(kb, 256)
        assert min(resident_blocks(caches, 0, 256)) == 1.0
    finally:
        kb.stop()


def test_backing_changes_no_value() -> None:
    """Blocks written before (here: 0-99, partly inside the window) keep their values; the
    rest stay zero."""
    caches = allocate_kv_caches(MODEL, BLOCKS, BS, torch.float16, torch.device("cpu"))
    for i, cache in enumerate(caches):
        cache[:, : 100 * BS] = torch.arange(100 * BS, dtype=torch.float16).view(1, -1, 1, 1) + i
    kb = backing(caches, [0], [False], window=BLOCKS)
    try:
        wait_backed(kb, BLOCKS)
    finally:
        kb.stop()
    for i, cache in enumerate(caches):
        want = torch.arange(100 * BS, dtype=torch.float16).view(1, -1, 1, 1) + i
        assert torch.equal(cache[:, : 100 * BS], want.expand(2, -1, *cache.shape[2:]))
        assert not cache[:, 100 * BS:].any()


def test_start_only_where_it_can_run() -> None:
    caches = allocate_kv_caches(MODEL, BLOCKS, BS, torch.float16, torch.device("cpu"))
    assert start_kv_backing(caches, BS, BLOCKS, lambda: 0, lambda: False, 0.0) is None
    assert start_kv_backing([], BS, BLOCKS, lambda: 0, lambda: False, 1.0) is None
    kb = start_kv_backing(caches, BS, BLOCKS, lambda: 0, lambda: False, 4 / 1024)
    assert kb is not None
    try:  # 4 MiB of a pool whose block is 128 KiB over both layers, K and V: 32 blocks
        wait_backed(kb, 32)
        time.sleep(0.2)
        assert kb.backed == 32
    finally:
        kb.stop()


def test_block_manager_high_water_mark() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.high_water == 0
    a = Request("a", list(range(10)), SamplingParams(max_tokens=4))
    assert bm.allocate(a, 10)  # blocks 0-2
    assert bm.high_water == 3
    bm.free(a)  # back to the queue: taken again before any fresh block
    b = Request("b", list(range(100, 104)), SamplingParams(max_tokens=4))
    assert bm.allocate(b, 4)
    assert b.block_table[0] < 3 and bm.high_water == 3


def test_engine_option() -> None:
    with pytest.raises(ValueError, match="kv_cache_prefault_gb"):
        EngineConfig(kv_cache_prefault_gb=-1.0)
    from tests.engine.tiny_models import engine_from_hf, tiny_hf_llama

    hf = tiny_hf_llama()
    off = engine_from_hf(hf, kv_cache_prefault_gb=0.0, num_kv_blocks=64, device="cpu")
    assert off.kv_backing is None
    on = engine_from_hf(hf, kv_cache_prefault_gb=1.0, num_kv_blocks=64, device="cpu")
    assert on.kv_backing is not None
    wait_backed(on.kv_backing, 64)  # the whole (small) pool: the window is larger
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    outs = []
    for engine in (off, on):
        engine.add_request("r", list(range(3, 40)), params)
        done = []
        for _ in range(64):
            done += [o for o in engine.step() if o.finished]
            if not engine.has_unfinished_requests():
                break
        outs.append([(c.token_ids, c.logprobs) for o in done for c in o.outputs])
    assert outs[0] == outs[1] and outs[0][0][0]
    on.shutdown()
    assert not on.kv_backing.running
