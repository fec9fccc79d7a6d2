"""BlockManager: the KV block pool — allocation, reference counts, prefix cache.

Every block is in exactly one of three states:

- used:   ref_count > 0 (in some request's block table);
- cached: ref_count == 0 but it holds a full block registered in the prefix
          cache, so a later request with the same prefix can reuse it;
- free:   ref_count == 0 and holds nothing worth keeping.

Cached and free blocks both sit in ``_free_queue`` (an ordered dict used as an
LRU list: evict from the front, release to the back). A fresh allocation takes
the front block and drops its cache entry, so cached blocks are evicted least
recently used first and a block in use is never evicted.

Prefix caching: the i-th full block of a sequence is keyed by a chain hash of
(hash of block i-1, token ids of block i; block 0's parent is the request's
``prefix_salt``: its LoRA adapter's, None for the base model): 128 bits of BLAKE2b, the same in every
process (the disk cache and the Ray router name blocks by it). A lookup walks the chain
and stops at the first miss; a hit is confirmed against the stored parent hash and
token ids, so a hash collision can never reuse wrong K/V.

Disk tier (``disk``, a ``KVSpill``; ``roseinfer.kvcache.tier``, with ``kv_cache_dir``):
a registered block that is evicted from memory is offered to it first, and so is every
registered block when the engine is idle (``persist``). A lookup that misses in memory
goes on on disk: each further block found there is loaded into a fresh block of the
pool (taken from the LRU front, never one of this lookup's own hits), registered like a
computed one, and returned as a hit.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from roseinfer.engine.request import Request

HashFn = Callable[[int | None, tuple[int, ...]], int]


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block given its parent's hash (None for the first block): a
    128-bit BLAKE2b of the parent's hash and the token ids, stable across processes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\x00" * 17 if parent is None else b"\x01" + parent.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class KVSpill(Protocol):
    """Where registered blocks go when memory lets them go, and come back from
    (``roseinfer.kvcache.tier.KVDiskTier``)."""

    def save(self, block_id: int, key: int, parent: int | None, tokens: tuple[int, ...],
             evicted: bool = True) -> None: ...

    def contains(self, key: int) -> bool: ...

    def load(self, block_id: int, key: int, parent: int | None,
             tokens: tuple[int, ...]) -> bool: ...


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while registered in the prefix cache
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = chain_hash,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Blocks in _free_queue that hold a hash (kept as they come and go: the stats read
        # it after every step, and counting a pool of thousands took ~0.3 ms a read).
        self._num_cached_free = 0
        # One past the largest block id ever taken: fresh blocks go in id order, so the
        # pool's pages past it were never written (KVBacking backs them ahead of use).
        self.high_water = 0
        # Prefix-cache counters (tokens), read by metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.disk: KVSpill | None = None  # the disk tier (kv_cache_dir), set by the engine

    # ------------------------------------------------------------------ state
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user (free or cached): what an allocation can take."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Unused blocks that still hold a reusable prefix."""
        return self._num_cached_free

    def next_fresh_blocks(self, n: int) -> list[int]:
        """The first ``n`` blocks an allocation would take now (the LRU front)."""
        return list(itertools.islice(self._free_queue, n))

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ prefix hash
    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else request.prefix_salt
            hashes.append(self._hash_fn(parent, tuple(tokens[i * bs:(i + 1) * bs])))

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of ``request`` (not yet referenced).

        At least one token is always left to compute, so the last position has
        logits: a full hit is cut back by one block.  A sequence that records prompt
        logprobs takes hits only over positions whose logprobs it already has (after
        a preemption): every other prompt position needs its logits computed.
        """
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(request)
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if request.records_prompt_logprobs:
            # Logits at position p give the entry of position p + 1.
            max_blocks = min(max_blocks, max(0, request.num_prompt_logprobs - 1) // bs)
        hits: list[int] = []
        parent: int | None = request.prefix_salt  # the adapter's (None: base model)
        tokens = request.all_token_ids
        for i, h in enumerate(request.block_hashes[:max_blocks]):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tuple(tokens[i * bs:(i + 1) * bs]):
                return hits  # hash collision: not the same content
            hits.append(block_id)
            parent = h
        if self.disk is not None and len(hits) < max_blocks:
            hits += self._load_from_disk(request, hits, max_blocks)
        return hits

    def _load_from_disk(self, request: Request, hits: list[int], max_blocks: int) -> list[int]:
        """Blocks ``len(hits)``.. of the request found on disk, loaded into the pool as
        cached blocks (in chain order, stopping at the first miss)."""
        disk = self.disk
        assert disk is not None
        for block_id in hits:  # the next loads take the LRU front: never these
            if self.blocks[block_id].ref_count == 0:
                self._free_queue.move_to_end(block_id)
        protected = set(hits)
        loaded: list[int] = []
        bs = self.block_size
        tokens = request.all_token_ids
        start = len(hits)
        parent = request.block_hashes[start - 1] if start else None
        for i in range(start, max_blocks):
            h = request.block_hashes[i]
            if h in self._cached or not self._free_queue:
                break  # in memory with other content (a collision), or no block to fill
            if next(iter(self._free_queue)) in protected or not disk.contains(h):
                break
            block_id = self._take_fresh_block()
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            if not disk.load(block_id, h, parent, block_tokens):
                self._release(block_id)  # unregistered: back to the front of the LRU
                break
            block = self.blocks[block_id]
            block.block_hash, block.parent_hash, block.token_ids = h, parent, block_tokens
            self._cached[h] = block_id
            self._release(block_id)  # cached, most recently used
            loaded.append(block_id)
            protected.add(block_id)
            parent = h
        return loaded

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_queried_tokens
        self.prefix_hits += num_hit_tokens

    # ------------------------------------------------------------- allocation
    def can_allocate(self, request: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        needed = self._num_new_blocks(request, num_new_tokens, cached)
        reusable_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return needed + reusable_free <= len(self._free_queue)

    def allocate(self, request: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens.

        ``cached`` (only for a request with no blocks yet) are prefix-cache hits
        to take a reference on; the request's computed count moves past them.
        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        if not self.can_allocate(request, num_new_tokens, cached):
            return False
        if cached:
            assert not request.block_table, "cached blocks only for a fresh request"
            for block_id in cached:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._free_queue[block_id]
                    self._num_cached_free -= block.block_hash is not None
                block.ref_count += 1
                request.block_table.append(block_id)
            request.num_computed_tokens = len(cached) * self.block_size
        for _ in range(self._num_new_blocks(request, num_new_tokens, ())):
            request.block_table.append(self._take_fresh_block())
        return True

    def _num_new_blocks(self, request: Request, num_new_tokens: int, cached: Sequence[int]) -> int:
        have = len(request.block_table) + len(cached)
        computed = len(cached) * self.block_size if cached else request.num_computed_tokens
        return max(0, self.blocks_needed(computed + num_new_tokens) - have)

    def _take_fresh_block(self) -> int:
        block_id, _ = self._free_queue.popitem(last=False)
        self.high_water = max(self.high_water, block_id + 1)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached prefix
            self._num_cached_free -= 1
            if self.disk is not None:  # (its K/V are copied out before the slot is reused)
                self.disk.save(block_id, block.block_hash, block.parent_hash, block.token_ids)
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.parent_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def free(self, request: Request) -> None:
        """Drop the request's references; tail blocks go to the front of the LRU."""
        for block_id in reversed(request.block_table):
            self._release(block_id)
        request.block_table = []
        request.num_offered_blocks = 0

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens: those allocated for
        speculative drafts that were rejected (their slots hold K/V of tokens that are
        not in the sequence, and no block with such slots is ever registered: the prefix
        cache only takes blocks full of computed, i.e. accepted, tokens)."""
        keep = self.blocks_needed(request.num_computed_tokens)
        while len(request.block_table) > keep:
            self._release(request.block_table.pop())

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.block_hash is None:
                self._free_queue[block_id] = None
                self._free_queue.move_to_end(block_id, last=False)
            else:
                self._free_queue[block_id] = None  # cached: most recently used
                self._num_cached_free += 1

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(request.block_hashes))
        tokens = request.all_token_ids
        for i in range(request.num_offered_blocks, num_full):  # only blocks new since last call
            block = self.blocks[request.block_table[i]]
            h = request.block_hashes[i]
            if block.block_hash is not None or h in self._cached:
                continue  # already registered (ours, or an identical block of another request)
            block.block_hash = h
            block.parent_hash = request.block_hashes[i - 1] if i else request.prefix_salt
            block.token_ids = tuple(tokens[i * bs:(i + 1) * bs])
            self._cached[h] = block.block_id
        request.num_offered_blocks = max(request.num_offered_blocks, num_full)

    def persist(self) -> None:
        """Offer every registered block, in use or cached, to the disk tier (the engine
        is idle or shutting down)."""
        if self.disk is None:
            return
        for block in self.blocks:
            if block.block_hash is not None:
                self.disk.save(block.block_id, block.block_hash, block.parent_hash,
                               block.token_ids, evicted=False)

    def reset_prefix_cache(self) -> None:
        """Forget every unused cached block (used ones keep their entries)."""
        for block_id in list(self._free_queue):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._cached.pop(block.block_hash, None)
                self._num_cached_free -= 1
                block.block_hash = None
                block.parent_hash = None
                block.token_ids = ()
