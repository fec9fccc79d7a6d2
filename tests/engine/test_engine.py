"""Engine end to end on a tiny random Llama: batching, preemption, abort, n, seeds."""

from __future__ import annotations

import random

import pytest
import torch

from roseinfer.engine.engine import LLMEngine
from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams
from tests.engine.tiny_models import engine_from_hf, tiny_hf_llama
from tests.hf_reference import hf_greedy


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_llama()


def prompts_mixed(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)




def assert_pool_empty(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.has_unfinished_requests()


def test_greedy_matches_hf_generate(hf_model) -> None:
    llm = LLM.from_engine(engine_from_hf(hf_model, block_size=4))
    for prompt in prompts_mixed(3, seed=1):
        out = llm.generate([prompt], greedy(10))[0]
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 10)


def test_alone_equals_batch_of_16_and_tiny_pool(hf_model) -> None:
    prompts = prompts_mixed(16)
    alone_llm = LLM.from_engine(engine_from_hf(hf_model, block_size=4))
    alone = [alone_llm.generate([p], greedy())[0].outputs[0].token_ids for p in prompts]
    batch_engine = engine_from_hf(hf_model, block_size=4, max_num_batched_tokens=64)
    batch = [o.outputs[0].token_ids for o in LLM.from_engine(batch_engine).generate(prompts, greedy())]
    assert batch == alone
    assert_pool_empty(batch_engine)
    tiny = engine_from_hf(hf_model, block_size=4, num_kv_blocks=24, max_num_batched_tokens=32)
    pressed = [o.outputs[0].token_ids for o in LLM.from_engine(tiny).generate(prompts, greedy())]
    assert tiny.stats.num_preemptions > 0, "the tiny pool must force preemption"
    assert pressed == alone
    assert_pool_empty(tiny)


def test_request_joins_mid_generation(hf_model) -> None:
    engine = engine_from_hf(hf_model, block_size=4)
    p1, p2 = prompts_mixed(2, seed=3)
    engine.add_request("a", p1, greedy(16))
    finished = {}
    for step in range(100):
        if step == 5:
            engine.add_request("b", p2, greedy(8))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    alone = LLM.from_engine(engine_from_hf(hf_model, block_size=4))
    assert finished["a"] == alone.generate([p1], greedy(16))[0].outputs[0].token_ids
    assert finished["b"] == alone.generate([p2], greedy(8))[0].outputs[0].token_ids
    assert_pool_empty(engine)


def test_abort_frees_blocks(hf_model) -> None:
    engine = engine_from_hf(hf_model, block_size=4, max_num_batched_tokens=16)
    prompts = prompts_mixed(6, seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(20))
    for _ in range(3):
        engine.step()
    for i in range(0, 6, 2):
        assert engine.abort_request(f"r{i}")
    assert not engine.abort_request("nope")
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert_pool_empty(engine)


def test_seeded_sampling_reproducible_in_any_batch(hf_model) -> None:
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    prompt = prompts_mixed(1, seed=5)[0]
    llm = LLM.from_engine(engine_from_hf(hf_model, block_size=4))
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = prompts_mixed(5, seed=6)
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=0.8, max_tokens=10)] * 2 + [params]
                         + [SamplingParams(temperature=0.8, max_tokens=10)] * 3)
    assert mixed[2].outputs[0].token_ids == alone


def test_n_samples_share_prompt_blocks(hf_model) -> None:
    engine = engine_from_hf(hf_model, block_size=4)
    prompt = prompts_mixed(1, seed=7)[0] + list(range(3, 40))
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = LLM.from_engine(engine).generate([prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    full_blocks = (len(prompt) - 1) // 4
    assert engine.block_manager.prefix_hits >= 2 * full_blocks * 4
    assert_pool_empty(engine)


def test_logprobs_and_prompt_logprobs(hf_model) -> None:
    engine = engine_from_hf(hf_model, block_size=4)
    prompt = prompts_mixed(1, seed=8)[0][:20] + [5, 6]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=1,
                            ignore_eos=True)
    out = LLM.from_engine(engine).generate([prompt], params)[0]
    with torch.no_grad():
        full = torch.tensor([prompt + out.outputs[0].token_ids])
        ref = torch.log_softmax(hf_model(full).logits[0].float(), -1)
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 3
    for j, tok in enumerate(out.outputs[0].token_ids):
        entry = lps[j]
        assert entry[tok].rank == 1  # greedy picks the top token
        assert abs(entry[tok].logprob - ref[len(prompt) - 1 + j, tok].item()) < 1e-4
    plp = out.prompt_logprobs
    assert plp is not None and plp[0] is None and len(plp) == len(prompt)
    for j in range(1, len(prompt)):
        assert abs(plp[j][prompt[j]].logprob - ref[j - 1, prompt[j]].item()) < 1e-4


def test_bad_requests_rejected(hf_model) -> None:
    engine = engine_from_hf(hf_model, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len is 32"):
        engine.add_request("a", list(range(3, 40)), greedy())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("b", [5, 999], greedy())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("c", [], greedy())
    engine.add_request("d", [5, 6], greedy(40))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("d", [5, 6], greedy())
    out = LLM.from_engine(engine)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                assert o.outputs[0].finish_reason == "length"
                assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 32
    assert out is not None
    assert_pool_empty(engine)


def test_unseeded_sampling_reproducible_from_engine_seed(hf_model) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    prompt = prompts_mixed(1, seed=9)[0]

    def run(seed: int) -> list[int]:
        llm = LLM.from_engine(engine_from_hf(hf_model, block_size=4, seed=seed))
        return llm.generate([prompt], params)[0].outputs[0].token_ids

    assert run(5) == run(5)
    assert run(5) != run(6)
