"""The KV pool: how many blocks it has, and its memory.

Size (``num_kv_blocks``), first match wins:

* ``EngineConfig.num_kv_blocks``;
* ``EngineConfig.kv_cache_memory_gb`` (a budget in GiB);
* by default, what the model and the machine allow, like vLLM's
  ``gpu_memory_utilization`` and llama.cpp's ``-c``: ``kv_cache_memory_fraction`` of the
  memory still available once the weights are loaded (``MemAvailable`` of
  /proc/meminfo, less the file pages this process maps, e.g. GGUF weights used from
  the mmapped file, which the kernel would count as reclaimable), capped by what
  ``max_num_seqs`` sequences of ``max_model_len`` tokens can use (on a CUDA device: a
  fraction of that device's free memory).  Logged at start.

On CPU the pool's memory is an anonymous mapping per layer (``allocate_kv_caches``):
zero pages the kernel only backs when a block is first written, so a large default
pool costs memory as it fills, not at start (on other devices: ``torch.zeros``); while
the engine is idle, ``kv_backing`` backs the next ``kv_cache_prefault_gb`` GiB of blocks
ahead of their first write.  The
mapping is private and advised ``MADV_HUGEPAGE``: with transparent huge pages in
``madvise`` mode it is backed 2 MiB at a time, which spares attention the TLB misses of
4 KiB pages (docs/kv-cache.md: float16's op ~10% faster at batch 64).  A shared
anonymous mapping (Python's default) would never get huge pages in that mode.
"""

from __future__ import annotations

import logging
import math
import mmap
from pathlib import Path

import torch
from torch import Tensor

from roseinfer.config import EngineConfig
from roseinfer.model.config import ModelConfig
from roseinfer.model.kv_int8 import row_width

logger = logging.getLogger("roseinfer.runner")
_GIB = 1 << 30


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers (an int8 cache's scales included)."""
    elem = torch.empty((), dtype=dtype).element_size()
    row = row_width(config.head_dim, dtype)
    return 2 * config.num_layers * block_size * config.num_kv_heads * row * elem


def _meminfo_kib(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory_bytes() -> int:
    """Memory this process can still take: MemAvailable less its own mapped file pages
    (weights used from a memory-mapped file are in use, not reclaimable)."""
    avail = _meminfo_kib(Path("/proc/meminfo"), "MemAvailable")
    if avail is None:
        import psutil

        return int(psutil.virtual_memory().available)
    mapped = _meminfo_kib(Path("/proc/self/status"), "RssFile") or 0
    return max(0, (avail - mapped) * 1024)


def available_device_bytes(device: torch.device | None) -> int:
    """Free memory where the pool will live: the accelerator's own (``mem_get_info``) for a
    CUDA device, else this machine's (``available_memory_bytes``)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory_bytes()


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, kv_dtype: torch.dtype,
                  available: int | None = None, device: torch.device | None = None) -> int:
    """The KV pool size in blocks (module docstring; under tensor parallelism: rank 0's
    blocks, the largest).  ``available``: bytes, instead of measuring them on ``device``
    (a CUDA device's free memory, else the machine's)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model_config, config.block_size, kv_dtype)
    if config.kv_cache_memory_gb is not None:
        return max(1, int(config.kv_cache_memory_gb * _GIB) // per_block)
    ctx = model_config.max_position_embeddings
    max_len = min(config.max_model_len or ctx, ctx)
    wanted = config.max_num_seqs * math.ceil(max_len / config.block_size)
    free = available_device_bytes(device) if available is None else available
    free //= config.tensor_parallel_size  # every rank holds a pool of this many blocks
    fits = int(config.kv_cache_memory_fraction * free) // per_block
    blocks = max(1, min(wanted, fits))
    logger.info(
        "KV pool: %d blocks of %d tokens = %.2f GiB (%s: %.0f%% of %.1f GiB available after "
        "the weights, at most %d sequences x %d tokens = %d blocks; kv_cache_memory_gb or "
        "num_kv_blocks choose another size)", blocks, config.block_size, blocks * per_block / _GIB,
        "capped by the sequences" if wanted <= fits else "bounded by memory",
        100 * config.kv_cache_memory_fraction, free / _GIB, config.max_num_seqs, max_len, wanted)
    return blocks


def allocate_kv_caches(model_config: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """One zeroed tensor per layer, [2 (K, V), slots, kv_heads, head_dim] (int8: rows of
    head_dim + 4, the scale inside: ``roseinfer.model.kv_int8``)."""
    shape = (2, num_blocks * block_size, model_config.num_kv_heads,
             row_width(model_config.head_dim, dtype))
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device)
                for _ in range(model_config.num_layers)]
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return [torch.frombuffer(anonymous_pages(nbytes), dtype=dtype).view(shape)
            for _ in range(model_config.num_layers)]


def touch_blocks(kv_caches: list[Tensor], block_ids: list[int], block_size: int) -> None:
    """Write zeros into the slots of ``block_ids`` in every layer's cache, so their pages
    are backed before a timed run takes them (benchmarks: a long-running server's blocks
    were written before, and llama.cpp zeroes its whole cache at start).  Unused blocks
    only: what a block held before it is written again is never read."""
    if not block_ids:
        return
    ids = torch.tensor(block_ids, dtype=torch.long)
    for cache in kv_caches:
        blocks = cache.view(cache.shape[0], -1, block_size, *cache.shape[2:])
        blocks[:, ids.to(cache.device)] = 0


def anonymous_pages(nbytes: int) -> mmap.mmap:
    """Private anonymous memory, zero-filled and backed when first written, advised
    ``MADV_HUGEPAGE`` where the OS has it (advice: ignored where THP is off)."""
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    return pages
