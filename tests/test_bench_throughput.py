"""How ``roseinfer bench throughput`` times decode (bench/throughput.py): the steady state
with all B sequences in flight, what llama-batched-bench's S_TG measures."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from roseinfer.bench import throughput
from tests.engine.tiny_models import engine_from_hf, tiny_hf_llama


def test_decode_rate_counts_only_steps_with_every_sequence_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk budget of 24 tokens finishes 4 prompts of 16 at different steps, so the
    first sequences finish first and the last steps run fewer rows. With a clock that
    advances 1 s per reading, every step lasts 1 s: counting only full steps gives
    exactly B tokens a second; counting the tail too would give less."""
    clock = itertools.count()  # this module's readings only (the engine keeps its own)
    monkeypatch.setattr(throughput, "time", SimpleNamespace(
        perf_counter=lambda: float(next(clock))))
    engine = engine_from_hf(tiny_hf_llama(), max_num_batched_tokens=24, num_kv_blocks=64,
                            block_size=16)
    prompts = throughput.random_prompts(4, 16, 256, seed=0)
    result = throughput.run_engine_once(engine, prompts, gen_len=8)
    assert result.decode_tok_s == 4.0
    assert result.prefill_tok_s < 4 * 16  # several prefill steps of 1 s each


def test_batch_one_takes_the_bandwidth_probed_around_its_own_runs() -> None:
    """The probe runs right before and after batch 1's runs (not other batch sizes'),
    and the bandwidth report divides by the higher reading."""
    engine = engine_from_hf(tiny_hf_llama(), num_kv_blocks=64, block_size=16)
    readings = iter([20.0, 35.0])
    calls: list[float] = []

    def probe() -> float:
        calls.append(next(readings))
        return calls[-1]

    results = throughput.run_throughput(engine, [2, 1], prompt_len=8, gen_len=4, probe=probe)
    assert calls == [20.0, 35.0]
    by_batch = {r.batch_size: r for r in results}
    assert by_batch[1].read_bandwidth_gbs == 35.0 and by_batch[2].read_bandwidth_gbs is None
    report = throughput.bandwidth_report(engine, results)
    assert report["read_bandwidth_gbs"] == 35.0
    assert report["batch1_pct_of_limit"] == pytest.approx(
        100 * by_batch[1].decode_tok_s / report["limit_tok_s"])
    assert "changed" in throughput.format_bandwidth(report | {"batch1_pct_of_limit": 120.0})
