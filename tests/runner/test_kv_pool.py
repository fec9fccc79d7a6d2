"""The KV pool's size (explicit, budget, or the model and machine's default) and its
lazily backed memory on CPU (``roseinfer/runner/kv_pool.py``)."""

from __future__ import annotations

import logging
import mmap
import os

import psutil
import pytest
import torch

from roseinfer.config import EngineConfig
from roseinfer.model.config import ModelConfig
from roseinfer.runner.kv_pool import (
    allocate_kv_caches,
    available_memory_bytes,
    kv_bytes_per_block,
    num_kv_blocks,
    touch_blocks,
)

MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, max_position_embeddings=1024)
F16 = torch.float16
PER_BLOCK = kv_bytes_per_block(MODEL, 16, F16)  # 2 * 2 layers * 16 * 2 heads * 16 * 2 B


def test_explicit_sizes_win() -> None:
    assert PER_BLOCK == 4096
    assert num_kv_blocks(EngineConfig(num_kv_blocks=7, kv_cache_memory_gb=1.0), MODEL, F16) == 7
    assert num_kv_blocks(EngineConfig(kv_cache_memory_gb=1 / 1024), MODEL, F16) == 256


def test_default_follows_sequences_and_memory(caplog: pytest.LogCaptureFixture) -> None:
    cfg = EngineConfig(max_num_seqs=4, max_model_len=100)
    with caplog.at_level(logging.INFO, logger="roseinfer.runner"):
        # Plenty of memory: 4 sequences of 100 tokens = 4 * 7 blocks.
        assert num_kv_blocks(cfg, MODEL, F16, available=1 << 30) == 28
    assert "KV pool: 28 blocks" in caplog.text and "capped by the sequences" in caplog.text
    # Little memory: half of 40 blocks' bytes.
    assert num_kv_blocks(cfg, MODEL, F16, available=40 * PER_BLOCK) == 20
    frac = EngineConfig(max_num_seqs=4, max_model_len=100, kv_cache_memory_fraction=0.25)
    assert num_kv_blocks(frac, MODEL, F16, available=40 * PER_BLOCK) == 10
    # Without max_model_len: the model's context (1,024 tokens = 64 blocks per sequence).
    assert num_kv_blocks(EngineConfig(max_num_seqs=2), MODEL, F16, available=1 << 30) == 128
    # Under tensor parallelism every rank holds a pool: the memory is shared.
    tp = EngineConfig(max_num_seqs=4, max_model_len=100, tensor_parallel_size=2)
    assert num_kv_blocks(tp, MODEL, F16, available=40 * PER_BLOCK) == 10
    assert 0 < available_memory_bytes() <= psutil.virtual_memory().total


def test_config_validation() -> None:
    assert EngineConfig().kv_cache_memory_gb is None
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
            EngineConfig(kv_cache_memory_fraction=bad)
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        EngineConfig(kv_cache_memory_gb=0.0)


def test_cpu_pool_is_zero_and_backed_as_written() -> None:
    """A 512 MiB pool costs (almost) nothing until blocks are written."""
    blocks = (256 << 20) // (PER_BLOCK // 2)  # per layer: 256 MiB
    proc = psutil.Process()
    before = proc.memory_info().rss
    caches = allocate_kv_caches(MODEL, blocks, 16, F16, torch.device("cpu"))
    assert len(caches) == 2 and caches[0].shape == (2, blocks * 16, 2, 16)
    assert caches[0].dtype == F16 and caches[0].is_contiguous()
    assert proc.memory_info().rss - before < (32 << 20)
    caches[1][0, :4096].fill_(1.5)  # 128 KiB written
    assert caches[1][0, :4096].eq(1.5).all() and caches[1][1, :8].eq(0).all()
    assert proc.memory_info().rss - before < (64 << 20)


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists("/proc/self/smaps"),
                    reason="needs Linux's MADV_HUGEPAGE and /proc/self/smaps")
def test_touch_blocks_zeroes_those_blocks_only() -> None:
    """touch_blocks writes zeros into the named blocks' slots of every layer, K and V,
    and leaves every other slot as it was."""
    caches = allocate_kv_caches(MODEL, 6, 4, torch.float16, torch.device("cpu"))
    for c in caches:
        c.fill_(1.5)
    touch_blocks(caches, [4, 1], 4)
    for c in caches:
        blocks = c.view(2, 6, 4, *c.shape[2:])
        for b in range(6):
            want = 0.0 if b in (1, 4) else 1.5
            assert bool((blocks[:, b] == want).all()), b


def test_cpu_pool_is_private_and_advised_huge_pages() -> None:
    """Each layer's pool is a private mapping advised MADV_HUGEPAGE ("hg"): a shared one
    ("sh") never gets transparent huge pages in THP's madvise mode."""
    caches = allocate_kv_caches(MODEL, 4096, 16, F16, torch.device("cpu"))
    for cache in caches:
        flags = _vm_flags(cache.data_ptr())
        assert "hg" in flags and "sh" not in flags, flags


def test_default_pool_on_cuda_is_sized_by_the_device_memory(monkeypatch) -> None:
    """A CUDA pool takes its share of the device's free memory, not of the host's."""
    from roseinfer.runner import kv_pool

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 2 << 30))
    monkeypatch.setattr(kv_pool, "available_memory_bytes", lambda: 1 << 40)
    assert kv_pool.available_device_bytes(torch.device("cuda", 0)) == 1 << 30
    assert kv_pool.available_device_bytes(torch.device("cpu")) == 1 << 40
