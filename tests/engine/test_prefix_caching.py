"""Prefix caching through the engine: same tokens on and off, reuse is counted,
eviction under pressure is LRU and never touches blocks in use."""

from __future__ import annotations

import random

import pytest

from roseinfer.engine.engine import LLMEngine
from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams
from tests.engine.tiny_models import engine_from_hf, tiny_hf_llama

BS = 4


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_llama(seed=1, max_positions=2048)


def check_blocks(engine: LLMEngine) -> None:
    bm = engine.block_manager
    used = sum(1 for b in bm.blocks if b.ref_count > 0)
    cached = bm.num_cached_blocks
    free = bm.num_free_blocks - cached
    assert free + cached + used == bm.num_blocks
    assert used == bm.num_used_blocks


def run_all(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
            ) -> list[list[int]]:
    outs = LLM.from_engine(engine).generate(prompts, params)
    check_blocks(engine)
    assert engine.block_manager.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("shared_blocks", [0, 1, 3, "all-but-one"])
@pytest.mark.parametrize("sampled", [False, True])
def test_same_tokens_with_caching_on_and_off(hf_model, shared_blocks, sampled: bool) -> None:
    rng = random.Random(7)
    base = [rng.randrange(3, 256) for _ in range(6 * BS + 1)]
    if shared_blocks == "all-but-one":
        prompts = [base, base[:-1] + [(base[-1] + 1) % 250 + 3], list(base)]
    else:
        shared = base[: shared_blocks * BS]
        prompts = [shared + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 10))]
                   for _ in range(4)]
    if sampled:
        params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=8,
                                 ignore_eos=True) for i in range(len(prompts))]
    else:
        params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * len(prompts)
    off = run_all(engine_from_hf(hf_model, block_size=BS, enable_prefix_caching=False),
                  prompts, params)
    on_engine = engine_from_hf(hf_model, block_size=BS)
    on = run_all(on_engine, prompts, params)
    # Run again on the warm cache: every prompt is now a (capped) full hit.
    again = run_all(on_engine, prompts, params)
    assert on == off
    assert again == off
    if shared_blocks:
        assert on_engine.block_manager.prefix_hits > 0


def test_second_request_computes_only_new_tokens(hf_model) -> None:
    engine = engine_from_hf(hf_model, block_size=16, max_num_batched_tokens=512)
    rng = random.Random(3)
    prefix = [rng.randrange(3, 256) for _ in range(1000)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = prefix + [11, 12, 13]
    LLM.from_engine(engine).generate([first], params)
    computed_before = engine.stats.computed_tokens_total
    second = prefix + [21, 22, 23, 24, 25]
    out = LLM.from_engine(engine).generate([second], params)[0]
    computed = engine.stats.computed_tokens_total - computed_before
    cached = (1000 // 16) * 16  # full blocks of the shared prefix
    assert out.num_cached_tokens == cached
    # Only the uncached tail of the prompt plus the decode steps ran through the model.
    assert computed == len(second) - cached + (params.max_tokens - 1)
    assert engine.get_stats().prefix_cache_hits == cached


def test_prompt_logprobs_are_complete_on_a_warm_cache(hf_model) -> None:
    """A request asking for prompt logprobs skips cache hits: every position is scored."""
    engine = engine_from_hf(hf_model, block_size=BS)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 256) for _ in range(5 * BS + 2)]
    llm = LLM.from_engine(engine)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # warms the cache
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    warm = llm.generate([prompt], params)[0]
    cold = LLM.from_engine(engine_from_hf(hf_model, block_size=BS,
                                          enable_prefix_caching=False)).generate([prompt], params)[0]
    assert warm.num_cached_tokens == 0
    assert len(warm.prompt_logprobs) == len(prompt)
    for w, c, tok in zip(warm.prompt_logprobs[1:], cold.prompt_logprobs[1:], prompt[1:],
                         strict=True):
        assert w[tok].logprob == pytest.approx(c[tok].logprob, abs=1e-5)
    check_blocks(engine)


def test_eviction_is_lru_and_spares_blocks_in_use(hf_model) -> None:
    engine = engine_from_hf(hf_model, block_size=BS, num_kv_blocks=16)
    bm = engine.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    a = [5] * (3 * BS) + [6]
    b = [7] * (3 * BS) + [8]
    run_all(engine, [a], [params])
    run_all(engine, [b], [params])
    assert bm.num_cached_blocks == 6  # both prompts' full blocks stay cached
    # A long request takes 12 of the 16 blocks: the 10 holding nothing first, then
    # cached blocks least recently used first: a's (older) tail blocks go, b's stay.
    engine.add_request("long", [9] * (12 * BS), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    check_blocks(engine)
    assert len(bm.find_cached_blocks(_probe(a))) == 1
    assert len(bm.find_cached_blocks(_probe(b))) == 3
    # Blocks in use are never evicted: "big" needs 6 blocks, only 4 are unused, so it
    # waits while "long" keeps its blocks and finishes; then "big" runs.
    long_req = engine.scheduler.requests["long"]
    table = list(long_req.block_table)
    engine.add_request("big", [10] * (6 * BS), SamplingParams(max_tokens=2, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
        if not long_req.is_finished:
            assert long_req.block_table[: len(table)] == table
        check_blocks(engine)
    assert finished == ["long", "big"]
    assert bm.num_used_blocks == 0


def _probe(tokens: list[int]):
    from roseinfer.engine.request import Request

    return Request("probe", tokens, SamplingParams())


def test_preempt_and_abort_of_sharing_request_leave_others_intact(hf_model) -> None:
    rng = random.Random(11)
    prefix = [rng.randrange(3, 256) for _ in range(5 * BS)]
    prompts = [prefix + [rng.randrange(3, 256) for _ in range(3)] for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    expected = run_all(engine_from_hf(hf_model, block_size=BS, enable_prefix_caching=False),
                       prompts, [params] * 5)
    engine = engine_from_hf(hf_model, block_size=BS, num_kv_blocks=18,
                            max_num_batched_tokens=32)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    results: dict[str, list[int]] = {}
    aborted = False
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        check_blocks(engine)
        r3 = engine.scheduler.requests.get("r3")
        if not aborted and r3 is not None and r3.num_output_tokens >= 3:
            engine.abort_request("r3")
            aborted = True
            check_blocks(engine)
    assert aborted
    assert engine.stats.num_preemptions > 0, "the small pool must force preemption"
    for i in (0, 1, 2, 4):
        assert results[f"r{i}"] == expected[i]
    assert engine.block_manager.num_used_blocks == 0
