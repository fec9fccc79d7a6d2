"""Block manager: allocation, ref counts, prefix-cache hits, LRU eviction, collisions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.request import Request
from roseinfer.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def check_accounting(bm: BlockManager) -> None:
    used = sum(1 for b in bm.blocks if b.ref_count > 0)
    assert bm.num_free_blocks + used == bm.num_blocks
    cached = bm.num_cached_blocks
    assert cached == sum(1 for b in bm.blocks if b.ref_count == 0 and b.block_hash is not None)
    assert (bm.num_free_blocks - cached) + cached + used == bm.num_blocks


def run_prefill(bm: BlockManager, req: Request) -> None:
    cached = bm.find_cached_blocks(req)
    num_computed = len(cached) * bm.block_size
    assert bm.allocate(req, req.num_tokens - num_computed, cached)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def test_allocate_and_free_all() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_req("a", list(range(10)))
    assert bm.allocate(r, 10)
    assert len(r.block_table) == 3
    assert bm.num_free_blocks == 5
    r.num_computed_tokens = 10
    assert bm.allocate(r, 2)  # 12 tokens: still 3 blocks
    assert len(r.block_table) == 3
    assert bm.allocate(r, 3)  # 13 tokens: 4 blocks
    assert len(r.block_table) == 4
    bm.free(r)
    assert bm.num_free_blocks == 8
    check_accounting(bm)


def test_allocate_fails_without_change() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    r = make_req("a", list(range(12)))
    assert not bm.allocate(r, 12)
    assert r.block_table == [] and bm.num_free_blocks == 2


def test_next_fresh_blocks_are_what_allocation_takes() -> None:
    """next_fresh_blocks(n) names, in order, the blocks the next allocations take: after
    frees (partial blocks to the front, registered ones to the back) too."""
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_req("a", list(range(10)))
    run_prefill(bm, a)  # 2 full blocks registered, 1 partial
    bm.free(a)
    want = bm.next_fresh_blocks(4)
    b = make_req("b", list(range(50, 66)))  # no prefix in common: 4 fresh blocks
    assert bm.allocate(b, 16)
    assert b.block_table == want
    assert len(bm.next_fresh_blocks(100)) == bm.num_free_blocks


def test_prefix_hit_and_last_token_always_computed() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_req("a", list(range(12)))  # 3 full blocks
    run_prefill(bm, a)
    b = make_req("b", list(range(12)))  # identical prompt
    hits = bm.find_cached_blocks(b)
    assert hits == a.block_table[:2]  # full hit is cut back so the last token is computed
    c = make_req("c", list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.find_cached_blocks(c) == a.block_table[:2]
    d = make_req("d", [5] + list(range(1, 12)))
    assert bm.find_cached_blocks(d) == []
    assert bm.allocate(b, 4, hits)
    assert b.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16
    check_accounting(bm)


def test_cached_blocks_survive_free_and_are_evicted_lru() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    old = make_req("old", [1, 2, 3, 4])
    run_prefill(bm, old)
    bm.free(old)
    new = make_req("new", [5, 6, 7, 8])
    run_prefill(bm, new)
    bm.free(new)
    assert bm.num_cached_blocks == 4
    # Fresh demand of 3 blocks: 2 never-used blocks first, then the LRU cached block
    # (the tail block of the older request).
    filler = make_req("f", [9, 9, 9, 9, 9, 9])
    assert bm.allocate(filler, 6)
    assert bm.num_cached_blocks == 3
    assert len(bm.find_cached_blocks(make_req("x", [1, 2, 3, 4, 0]))) == 1  # head kept
    assert len(bm.find_cached_blocks(make_req("y", [5, 6, 7, 8, 0]))) == 2
    bm.free(filler)
    check_accounting(bm)


def test_blocks_in_use_are_never_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_req("a", [1, 2, 3, 4])
    run_prefill(bm, a)
    b = make_req("b", [7, 7, 7, 7])
    assert bm.allocate(b, 4)
    c = make_req("c", [8, 8])
    assert not bm.allocate(c, 2)  # all 4 blocks are in use
    assert bm.find_cached_blocks(make_req("z", [1, 2, 3, 4, 5])) == a.block_table
    bm.free(a)
    bm.free(b)
    check_accounting(bm)


def test_hash_collision_is_not_reused() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, hash_fn=lambda parent, toks: 42)
    a = make_req("a", [1, 2, 3])
    run_prefill(bm, a)
    b = make_req("b", [3, 4, 5])  # same (fake) hash, different tokens
    assert bm.find_cached_blocks(b) == []
    assert bm.find_cached_blocks(make_req("c", [1, 2, 9])) == a.block_table[:1]


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_req("a", [1, 2, 3, 4, 5])
    run_prefill(bm, a)
    assert bm.find_cached_blocks(make_req("b", [1, 2, 3, 4, 5])) == []
    bm.free(a)
    assert bm.num_cached_blocks == 0


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_req("a", [1, 2, 3, 4, 5])
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 2
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_blocks(make_req("b", [1, 2, 3, 4, 5])) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "free", "trim", "reset"]),
                          st.integers(0, 3)), max_size=40))
def test_cached_count_follows_every_change(ops: list[tuple[str, int]]) -> None:
    """num_cached_blocks (a counter kept as blocks come and go) equals a count of the
    unused blocks holding a prefix after any mix of admissions (prefix hits included),
    growth, frees, trims and resets, in a pool small enough to evict."""
    bm = BlockManager(num_blocks=12, block_size=2)
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9], [1, 2, 7], [5, 6, 7, 8, 1, 2, 3]]
    live: dict[int, object] = {}
    for n, (kind, i) in enumerate(ops):
        r = live.get(i)
        if kind == "admit" and r is None:
            r = make_req(f"{i}-{n}", prompts[i])
            cached = bm.find_cached_blocks(r)
            if bm.allocate(r, r.num_tokens - len(cached) * bm.block_size, cached):
                r.num_computed_tokens = r.num_tokens
                bm.cache_full_blocks(r)
                live[i] = r
        elif kind == "grow" and r is not None and bm.allocate(r, 1):
            r.append_token(40 + n)
            r.num_computed_tokens = r.num_tokens
            bm.cache_full_blocks(r)
        elif kind == "free" and r is not None:
            bm.free(r)
            del live[i]
        elif kind == "trim" and r is not None:
            bm.trim(r)
        elif kind == "reset":
            bm.reset_prefix_cache()
        check_accounting(bm)
