"""EngineSnapshot (engine/snapshot.py) on a tiny LLMEngine, without a server: the block
map and counts agree with the block manager, request rows with the scheduler, the
throughput buckets and latency percentiles with what was recorded."""

from __future__ import annotations

import dataclasses
import time

import pytest

from roseinfer.engine.block_manager import Block
from roseinfer.engine.request_stream import StepTimings
from roseinfer.engine.snapshot import (
    MAX_MAP_CELLS,
    EngineSnapshot,
    LiveCounters,
    _block_map,
    percentile,
    take_snapshot,
)
from roseinfer.engine.stats import EngineStats
from roseinfer.sampling_params import SamplingParams
from tests.server.helpers import tiny_engine


def snap_of(engine, live: LiveCounters | None = None) -> EngineSnapshot:  # noqa: ANN001
    return take_snapshot(engine, live or LiveCounters(engine.get_stats()), time.monotonic())


def check_consistent(engine, s: EngineSnapshot) -> None:  # noqa: ANN001
    bm = engine.block_manager
    assert s.num_used_blocks + s.num_cached_blocks + s.num_free_blocks == s.num_blocks
    assert s.num_blocks == bm.num_blocks == len(s.block_map)
    assert s.block_map.count("u") == s.num_used_blocks == bm.num_used_blocks
    assert s.block_map.count("c") == s.num_cached_blocks == bm.num_cached_blocks
    assert s.num_running == len(engine.scheduler.running)
    assert s.num_waiting == len(engine.scheduler.waiting)
    assert len(s.requests) == s.num_running + s.num_waiting
    held = {b for r in engine.scheduler.running for b in r.block_table}
    assert {i for i, c in enumerate(s.block_map) if c == "u"} == held
    assert sum(r.num_blocks for r in s.requests) >= s.num_used_blocks


def test_idle_engine() -> None:
    engine = tiny_engine(num_kv_blocks=40)
    s = snap_of(engine)
    check_consistent(engine, s)
    assert s.block_map == "." * 40 and s.blocks_per_cell == 1
    assert s.kv_usage == 0.0 and s.requests == () and s.num_preempted == 0
    assert (s.block_size, s.max_model_len) == (4, engine.max_model_len)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_running = 3  # type: ignore[misc]


def test_rows_follow_the_scheduler_through_preemption_and_finish() -> None:
    engine = tiny_engine(num_kv_blocks=14, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9, 10, 11, 12], params)
    s = snap_of(engine)
    assert [r.state for r in s.requests] == ["waiting"] * 4
    assert [r.request_id for r in s.requests] == ["r0", "r1", "r2", "r3"]
    assert all(r.num_prompt_tokens == 8 and r.max_tokens == 24 for r in s.requests)
    states: set[str] = set()
    while engine.has_unfinished_requests():
        engine.step()
        s = snap_of(engine)
        check_consistent(engine, s)
        states |= {r.state for r in s.requests}
        assert s.num_preempted == sum(r.state == "preempted" for r in s.requests)
        for row in s.requests:
            req = engine.scheduler.requests[row.request_id]
            assert (row.num_output_tokens, row.num_computed_tokens, row.num_blocks) == (
                req.num_output_tokens, req.num_computed_tokens, len(req.block_table))
            assert row.age_s >= 0
    assert {"decode", "preempted"} <= states, states  # 4 x 8 blocks do not fit in 14
    assert s.num_preemptions_total == engine.stats.num_preemptions > 0
    assert s.num_used_blocks == 0 and s.requests == ()
    assert dict(s.finished) == {"length": 4}
    assert s.generation_tokens_total == 4 * 24


def test_cached_blocks_and_hit_rate() -> None:
    engine = tiny_engine(num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks of 4
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    s = snap_of(engine)
    check_consistent(engine, s)
    assert s.num_cached_blocks >= 3 and s.num_used_blocks == 0
    assert s.prefix_cache_hits == 12 and s.prefix_cache_queries == 26
    assert s.prefix_cache_hit_rate == pytest.approx(12 / 26)


def test_large_pool_is_drawn_in_cells() -> None:
    n = 3 * MAX_MAP_CELLS + 5
    blocks = [Block(i) for i in range(n)]
    blocks[0].ref_count = 1  # cell 0: used
    blocks[5].block_hash = 123  # cell 1 (blocks 4..7): cached
    cells, per_cell = _block_map(blocks)
    assert per_cell == 4 and len(cells) == -(-n // 4) <= MAX_MAP_CELLS
    assert cells[:3] == "uc." and set(cells[3:]) == {"."}


def test_throughput_buckets_and_series() -> None:
    stats = EngineStats(num_total_blocks=8)
    live = LiveCounters(stats)
    base = 1000.0
    stats.computed_tokens_total, stats.generation_tokens_total = 100, 4  # 96 prefill
    live.record_tokens(base + 0.5, stats)
    stats.computed_tokens_total, stats.generation_tokens_total = 108, 12  # 8 decode
    live.record_tokens(base + 0.9, stats)
    stats.computed_tokens_total, stats.generation_tokens_total = 110, 14
    live.record_tokens(base + 2.1, stats)
    live.record_tokens(base + 2.2, stats)  # nothing new: no bucket
    assert [list(b) for b in live.buckets] == [[1000, 96, 12], [1002, 0, 2]]
    engine = tiny_engine(num_kv_blocks=8)
    snap = dataclasses.replace(snap_of(engine, live), taken_at=base + 3.5)
    prefill, decode = snap.throughput_series(5)
    assert prefill == [0, 0, 96, 0, 0] and decode == [0, 0, 12, 0, 2]  # seconds 998..1002


def test_latency_percentiles_cover_the_window() -> None:
    live = LiveCounters(EngineStats(num_total_blocks=8))
    live.observe(StepTimings(ttft=[0.5, 0.1, 0.3], itl=[0.01] * 99 + [1.0]))
    engine = tiny_engine(num_kv_blocks=8)
    snap = snap_of(engine, live)
    count, (p50, p90, p99) = snap.latency_percentiles("ttft")
    assert (count, p50, p90, p99) == (3, 0.3, 0.5, 0.5)
    count, values = snap.latency_percentiles("itl", (50, 99, 100))
    assert count == 100 and values == [0.01, 0.01, 1.0]
    later = dataclasses.replace(snap, taken_at=snap.taken_at + 1000)
    assert later.latency_percentiles("ttft") == (0, [None, None, None])
    assert percentile([], 50) is None and percentile([2.0], 1) == 2.0
