"""Issue #11, "deterministic by default": with default engine options a request's
logits are bitwise identical (``torch.equal``) whatever else is in the batch.

Each test runs a target request alone, then under a different schedule, and compares
the logits row the sampler received at each of its steps (``invariance_helpers``):
batches of 2 to 64 with prefill and decode rows around it, its prompt in chunks of 1
to 256 tokens, its prefix from the cache, its KV recomputed after preemption; seeded
sampling gives the same tokens alone and under load, and n=3 with seed s the same as
three requests seeded s, s+1, s+2. Weight formats: exact fp32 ("none"), "fp16" and the
default ("auto": int8 on CPU, with an fp16 KV cache). The contract holds with the C++
kernels (the default); the PyTorch fallback (``ROSEINFER_CPU_KERNELS=0``) promises no
invariance: one documenting case is an expected failure (xfail, not strict).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import transformers

from roseinfer.sampling_params import SamplingParams
from tests.engine.invariance_helpers import (
    QUANTIZATIONS,
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

SEEDED = dict(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model() -> transformers.PreTrainedModel:
    return tiny_gqa_llama()


@pytest.fixture(params=QUANTIZATIONS)
def quant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def kernels() -> Iterator[None]:
    """The contract's setting: the C++ kernels on (skipped where they cannot be built)."""
    with cpu_kernels(True):
        yield


def alone(hf_model: transformers.PreTrainedModel, quant: str, arrival: Arrival,
          **options: object) -> RunResult:
    """The target's run on a fresh engine with nothing else in it."""
    return run_schedule(make_engine(hf_model, quant, **options), [arrival])


@pytest.mark.parametrize("batch", [2, 7, 33, 64])
def test_alone_vs_batched(hf_model, quant: str, kernels: None, batch: int) -> None:
    rng = random.Random(batch)
    target = Arrival(3, "target", random_prompt(rng, 40), greedy(12))
    want = alone(hf_model, quant, target)
    # Others arrive before and after it: prefill chunks and decodes share its steps.
    arrivals = load_arrivals(rng, batch - 1, last_step=8) + [target]
    got = run_schedule(make_engine(hf_model, quant), arrivals)
    assert got.max_rows >= min(batch, 8)
    if batch >= 7:  # its row moved around the batch
        assert len(set(got.recorder.positions["target"])) > 1
    assert_same_logits(want, got, f"in a batch of {batch}")


@pytest.mark.parametrize("budget", [1, 16, 33, 256])
def test_prompt_chunking(hf_model, quant: str, kernels: None, budget: int) -> None:
    target = Arrival(0, "target", random_prompt(random.Random(1), 300), greedy(8))
    want = alone(hf_model, quant, target, max_num_batched_tokens=512)  # one chunk
    got = alone(hf_model, quant, target, max_num_batched_tokens=budget)
    assert got.num_steps > want.num_steps
    assert_same_logits(want, got, f"chunks of {budget} tokens")


@pytest.mark.parametrize("concurrent", [False, True], ids=["after", "while-running"])
def test_prefix_cache_hit(hf_model, quant: str, kernels: None, concurrent: bool) -> None:
    rng = random.Random(2)
    prefix = random_prompt(rng, 150)
    target = Arrival(4 if concurrent else 40, "target", prefix + random_prompt(rng, 30),
                     greedy(12))
    want = alone(hf_model, quant, target)
    first = Arrival(0, "first", prefix + random_prompt(rng, 20), greedy(24))
    got = run_schedule(make_engine(hf_model, quant), [first, target])
    assert got.recorder.requests["target"].num_cached_tokens >= 144
    assert_same_logits(want, got, "prefix from the cache")


def test_preempted_and_recomputed(hf_model, quant: str, kernels: None) -> None:
    """Four requests of 60 + 24 tokens in 20 blocks of 16: past 80 tokens each needs a
    sixth block, and the newest one (the target) is preempted, then recomputed."""
    rng = random.Random(3)
    target = Arrival(0, "target", random_prompt(rng, 60), greedy(24))
    want = alone(hf_model, quant, target)
    loads = [Arrival(0, f"load-{i}", random_prompt(rng, 60), greedy(24)) for i in range(3)]
    got = run_schedule(make_engine(hf_model, quant, num_kv_blocks=20), loads + [target])
    assert got.recorder.requests["target"].num_preemptions > 0, "the pool must preempt it"
    assert_same_logits(want, got, "recomputed after preemption")


def test_seeded_sampling_under_load(hf_model, quant: str, kernels: None) -> None:
    rng = random.Random(4)
    target = Arrival(2, "target", random_prompt(rng, 30), SamplingParams(seed=1234, **SEEDED))
    want = alone(hf_model, quant, target)
    got = run_schedule(make_engine(hf_model, quant), load_arrivals(rng, 20) + [target])
    assert max(n for _, n in got.recorder.positions["target"]) > 1
    assert_same_logits(want, got, "seeded, under load")
    assert got.tokens["target"] == want.tokens["target"]


def test_n3_equals_three_seeded_requests(hf_model, quant: str, kernels: None) -> None:
    prompt = random_prompt(random.Random(5), 30)
    grouped = run_schedule(make_engine(hf_model, quant), [
        Arrival(0, "g", prompt, SamplingParams(n=3, seed=77, **SEEDED))])
    single = run_schedule(make_engine(hf_model, quant), [
        Arrival(0, f"s{i}", prompt, SamplingParams(seed=77 + i, **SEEDED)) for i in range(3)])
    assert len({tuple(t) for t in grouped.tokens["g"]}) > 1, "the children must differ"
    for i in range(3):
        assert_same_logits(single, grouped, f"child {i}", f"s{i}", f"g#{i}")
        assert grouped.tokens["g"][i] == single.tokens[f"s{i}"][0], f"child {i}"


def test_two_threads(hf_model, quant: str, kernels: None) -> None:
    """The engine's default is every core: the kernels' thread splits must not depend
    on the batch either."""
    rng = random.Random(6)
    target = Arrival(2, "target", random_prompt(rng, 40), greedy(8))
    want = alone(hf_model, quant, target, num_threads=2)
    got = run_schedule(make_engine(hf_model, quant, num_threads=2),
                       load_arrivals(rng, 6, last_step=4) + [target])
    assert_same_logits(want, got, "two threads, batch of 7")


@pytest.mark.xfail(strict=False, reason="documentation: invariance is promised with the C++ "
                   "kernels only, not by the PyTorch fallback (ROSEINFER_CPU_KERNELS=0)")
def test_pytorch_fallback_is_not_promised(hf_model, quant: str) -> None:
    rng = random.Random(7)
    target = Arrival(2, "target", random_prompt(rng, 40), greedy(8))
    with cpu_kernels(False):
        want = alone(hf_model, quant, target)
        batched = run_schedule(make_engine(hf_model, quant),
                               load_arrivals(rng, 6, last_step=4) + [target])
        chunked = alone(hf_model, quant, target, max_num_batched_tokens=16)
    assert_same_logits(want, batched, "fallback, batch of 7")
    assert_same_logits(want, chunked, "fallback, chunks of 16")
