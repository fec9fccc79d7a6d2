"""Block manager with a disk tier (a fake ``KVSpill``): evicted registered blocks are
offered to it, a memory miss goes on on disk, loads never evict the lookup's own hits,
a failed load stops the chain, and ``persist`` offers every registered block."""

from __future__ import annotations

from roseinfer.engine.block_manager import BlockManager, chain_hash
from roseinfer.engine.request import Request
from roseinfer.sampling_params import SamplingParams

BS = 4


class FakeDisk:
    def __init__(self) -> None:
        self.files: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.saved: list[int] = []
        self.loaded: list[tuple[int, int]] = []  # (block id, key)
        self.broken: set[int] = set()

    def save(self, block_id: int, key: int, parent: int | None, tokens: tuple[int, ...],
             evicted: bool = True) -> None:
        self.saved.append(key)
        self.files[key] = (parent, tokens)

    def contains(self, key: int) -> bool:
        return key in self.files

    def load(self, block_id: int, key: int, parent: int | None, tokens: tuple[int, ...]) -> bool:
        if key in self.broken or self.files.get(key) != (parent, tokens):
            return False
        self.loaded.append((block_id, key))
        return True


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def prefill(bm: BlockManager, r: Request) -> list[int]:
    cached = bm.find_cached_blocks(r)
    assert bm.allocate(r, r.num_tokens - len(cached) * BS, cached)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    return cached


def check(bm: BlockManager) -> None:
    used = sum(1 for b in bm.blocks if b.ref_count > 0)
    assert bm.num_free_blocks + used == bm.num_blocks
    for h, block_id in bm._cached.items():
        assert bm.blocks[block_id].block_hash == h


def test_chain_hash_is_stable_and_chained() -> None:
    a = chain_hash(None, (1, 2, 3, 4))
    assert a == chain_hash(None, (1, 2, 3, 4)) and 0 <= a < 1 << 128
    assert chain_hash(a, (5,)) != chain_hash(None, (5,)) != chain_hash(0, (5,))
    # A fixed value: the disk cache and the Ray router need it equal in every process.
    assert chain_hash(None, (1, 2, 3, 4)) == 0xCA658F67433A5C683EF79832080BF540


def test_evicted_blocks_go_to_disk_and_come_back() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    disk = FakeDisk()
    bm.disk = disk
    a = req("a", list(range(100, 113)))  # 3 full blocks + 1 token
    prefill(bm, a)
    bm.free(a)
    assert disk.saved == []  # cached in memory: nothing written yet
    b = req("b", list(range(200, 221)))  # 6 blocks: every cached block of a is evicted
    prefill(bm, b)
    assert sorted(disk.saved) == sorted(a.block_hashes[:3])
    assert list(disk.files[a.block_hashes[1]]) == [a.block_hashes[0], tuple(range(104, 108))]
    bm.free(b)
    a2 = req("a2", list(range(100, 113)) + [7, 8])
    hits = prefill(bm, a2)
    assert len(hits) == 3 and [k for _, k in disk.loaded] == a.block_hashes[:3]
    assert [bm.blocks[b].block_hash for b in hits] == a.block_hashes[:3]
    assert a2.num_computed_tokens == a2.num_tokens and a2.block_table[:3] == hits
    check(bm)
    bm.free(a2)
    disk.loaded.clear()
    assert len(bm.find_cached_blocks(req("a3", list(range(100, 113))))) == 3
    assert disk.loaded == []  # now in memory again


def test_loads_never_evict_the_lookups_own_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    disk = FakeDisk()
    bm.disk = disk
    tokens = list(range(50, 50 + 4 * BS + 1))
    bm.update_block_hashes(r := req("x", tokens))
    hashes = r.block_hashes
    parent = None
    for i, h in enumerate(hashes):  # every block on disk
        disk.files[h] = (parent, tuple(tokens[i * BS:(i + 1) * BS]))
        parent = h
    first = req("first", tokens[:2 * BS + 1])
    prefill(bm, first)  # its blocks 0, 1 stay cached in memory
    bm.free(first)
    other = req("other", list(range(900, 900 + BS + 1)))
    prefill(bm, other)  # cached later: first's blocks are now the LRU front
    bm.free(other)
    hits = bm.find_cached_blocks(req("y", tokens))
    # 2 in memory + 2 loaded into the 2 other blocks (evicting other's): the memory hits
    # survived although they were the least recently used.
    assert len(hits) == 4 and len(set(hits)) == 4
    assert [bm.blocks[b].block_hash for b in hits] == hashes[:4]
    check(bm)


def test_failed_load_stops_the_chain_and_frees_the_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    disk = FakeDisk()
    bm.disk = disk
    r = req("r", list(range(10, 10 + 4 * BS + 1)))
    bm.update_block_hashes(r)
    parent = None
    for i, h in enumerate(r.block_hashes):
        disk.files[h] = (parent, tuple(r.all_token_ids[i * BS:(i + 1) * BS]))
        parent = h
    disk.broken.add(r.block_hashes[2])  # corrupt on disk
    hits = bm.find_cached_blocks(r)
    assert [bm.blocks[b].block_hash for b in hits] == r.block_hashes[:2]
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    check(bm)


def test_persist_offers_every_registered_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    disk = FakeDisk()
    bm.disk = disk
    a, b = req("a", list(range(9))), req("b", list(range(30, 43)))
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)  # a: cached; b: in use
    bm.persist()
    assert sorted(disk.saved) == sorted(a.block_hashes[:2] + b.block_hashes[:3])
