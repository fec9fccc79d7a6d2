"""KVDiskTier: moves full KV blocks between the pool and the disk store.

The block manager calls it (``BlockManager.disk``) on the engine thread:

* ``save(...)`` when a registered block leaves memory (evicted for another use) and
  when the engine is idle or shuts down (``BlockManager.persist``): the block's K/V
  are copied out of the pool at once (the pool slot may be overwritten by the next
  step) and handed to the background writer; a block already on disk is only touched
  when it leaves memory (its mtime is the store's LRU clock), one already queued or
  known to be on disk when idle is skipped;
* ``contains(key)`` / ``load(block_id, key, parent, tokens)`` on a prefix-cache miss in
  memory: the file is read and verified (identity, chain hash, parent, token ids, dtype,
  shape, CRC) and its K/V copied into the given fresh block of the pool, byte for byte
  what was computed, so loading gives bitwise the logits computing gives.

Pool tensors are one per layer, ``[2, slots, kv_heads, head_dim]``; a block's payload is
``[layers, 2, block_size, kv_heads, head_dim]`` in the pool's dtype.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from roseinfer.config import EngineConfig
from roseinfer.kvcache.block_file import BlockHeader
from roseinfer.kvcache.identity import model_identity
from roseinfer.kvcache.store import DiskKVStore, DiskStats, key_name
from roseinfer.kvcache.writer import BlockWriter
from roseinfer.model.config import ModelConfig

logger = logging.getLogger("roseinfer.kvcache")

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.int8: "int8"}
DEFAULT_PENDING_BYTES = 256 << 20
MAX_KNOWN = 1 << 20


class KVDiskTier:
    def __init__(self, store: DiskKVStore, kv_caches: Sequence[Tensor], block_size: int,
                 max_pending_bytes: int = DEFAULT_PENDING_BYTES) -> None:
        self.store = store
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        two, _, heads, head_dim = self.kv_caches[0].shape
        assert two == 2, "pool tensors are [2, slots, kv_heads, head_dim]"
        self.shape = (len(self.kv_caches), 2, block_size, heads, head_dim)
        self.dtype = self.kv_caches[0].dtype
        self.dtype_name = _DTYPE_NAMES[self.dtype]
        self.payload_bytes = math.prod(self.shape) * self.dtype.itemsize
        self._queued: set[int] = set()  # keys handed to the writer, not yet written
        self._known: set[int] = set()  # keys this process wrote, loaded or found on disk
        self.writer = BlockWriter(store, max_pending_bytes, on_done=self._written)

    @property
    def stats(self) -> DiskStats:
        return self.store.stats

    def header(self, key: int, parent: int | None, tokens: tuple[int, ...]) -> BlockHeader:
        return BlockHeader(self.store.identity, key_name(key),
                           None if parent is None else key_name(parent), tuple(tokens),
                           self.dtype_name, self.shape)

    # ------------------------------------------------------------------ save
    def save(self, block_id: int, key: int, parent: int | None, tokens: tuple[int, ...],
             evicted: bool = True) -> None:
        """Offer one registered block (its K/V final) to the disk; no I/O here but a stat
        and a touch. A block this process knows is on disk is skipped when the engine is
        idle (``evicted`` False: no syscalls for the whole pool), and touched (its LRU
        clock) when it leaves memory."""
        if not self.store.writable or key in self._queued:
            return
        if key in self._known:
            if not evicted:
                return
            if self.store.touch(key):
                return
            self._known.discard(key)  # deleted since (size bound, another process)
        elif self.store.has(key):
            self.store.touch(key)
            self._remember(key)
            return
        payload = memoryview(self._snapshot(block_id))
        self._queued.add(key)
        if not self.writer.submit(self.header(key, parent, tokens), key, payload):
            self._queued.discard(key)

    def _written(self, key: int, ok: bool) -> None:
        """The writer's report (writer thread; set operations are atomic)."""
        if ok:
            self._remember(key)
        self._queued.discard(key)

    def _remember(self, key: int) -> None:
        if len(self._known) >= MAX_KNOWN:
            self._known.clear()  # a bound on memory: later offers just stat again
        self._known.add(key)

    def _snapshot(self, block_id: int) -> torch.Tensor:
        """A copy of the block's K/V, flat bytes [payload_bytes] uint8 (numpy view)."""
        s = block_id * self.block_size
        kv = torch.stack([c[:, s:s + self.block_size] for c in self.kv_caches])  # [L,2,bs,H,D]
        return kv.reshape(-1).view(torch.uint8).cpu().numpy()

    # ------------------------------------------------------------------ load
    def contains(self, key: int) -> bool:
        """Whether the block is on disk (a stat); a miss is counted."""
        found = self.store.has(key)
        if not found:
            self.stats.misses += 1
        return found

    def load(self, block_id: int, key: int, parent: int | None, tokens: tuple[int, ...]) -> bool:
        """Fill pool block ``block_id`` from the disk; False (nothing written) on a miss
        or a bad file."""
        payload = self.store.read(self.header(key, parent, tokens), key, self.payload_bytes)
        if payload is None:
            self.stats.misses += 1
            return False
        kv = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).view(self.shape)
        s = block_id * self.block_size
        for layer, cache in enumerate(self.kv_caches):
            cache[:, s:s + self.block_size].copy_(kv[layer])
        self.stats.hits += 1
        self._remember(key)
        return True

    def flush(self, timeout: float) -> bool:
        return self.writer.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.writer.close(timeout)


def open_disk_tier(config: EngineConfig, kv_caches: Sequence[Tensor], model_config: ModelConfig,
                   weights: Path | str | None, quantization: str, dtype: torch.dtype
                   ) -> KVDiskTier | None:
    """The disk tier of ``config.kv_cache_dir`` for this model and pool; None when it is
    off (not asked for, or the weights have no identity: a warning)."""
    if config.kv_cache_dir is None:
        return None
    if weights is None:
        logger.warning("KV disk cache off: the weights have no identity to name blocks by")
        return None
    kv_dtype = kv_caches[0].dtype
    identity = model_identity(weights, model_config, quantization=quantization, dtype=dtype,
                              kv_dtype=kv_dtype, block_size=config.block_size)
    store = DiskKVStore(Path(config.kv_cache_dir).expanduser(), identity,
                        int(config.kv_cache_dir_size))
    if not store.enabled:
        return None
    logger.info("KV disk cache: %s (model identity %s, at most %.2f GiB)", config.kv_cache_dir,
                identity, int(config.kv_cache_dir_size) / (1 << 30))
    return KVDiskTier(store, kv_caches, config.block_size)
