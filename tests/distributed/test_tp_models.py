"""Tensor parallelism on tiny random models: 2 ranks (gloo, 1 thread each) give the
tokens and logits of 1 process, and a request's logits do not depend on its batch."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from roseinfer.engine.engine import LLMEngine
from roseinfer.outputs import RequestOutput
from tests.distributed.helpers import (
    PROMPTS,
    engine,
    generate,
    greedy,
    save_gpt2,
    save_llama,
    tokens,
    workers,
)
from tests.engine.invariance_helpers import Arrival, assert_same_logits, run_schedule
from tests.server.helpers import free_port

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 query / 3 KV heads (ranks: 4+2 / 2+1), biases on q/k/v/o, 224 MLP channels
    (128 + 96), a vocabulary of 301 (151 + 150)."""
    return save_llama(tmp_path_factory.mktemp("llama"), attention_bias=True)


def _logprobs(outs: list[RequestOutput]) -> list[float]:
    """Every top logprob of every generated and prompt position, in a fixed order."""
    values = []
    for out in outs:
        for entry in list(out.outputs[0].logprobs or []) + list(out.prompt_logprobs or []):
            if entry is not None:
                values.extend(entry[k].logprob for k in sorted(entry))
    return values


def _compare(path: Path, **options: object) -> tuple[LLMEngine, list[RequestOutput]]:
    """Greedy outputs (with logprobs) of 2 ranks against 1 process."""
    params = greedy(10, logprobs=3, prompt_logprobs=2)
    one = generate(engine(path, 1, **options), PROMPTS, params)
    eng = engine(path, 2, **options)
    try:
        two = generate(eng, PROMPTS, params)
    finally:
        eng.shutdown()
    assert tokens(two) == tokens(one)
    assert _logprobs(two) == pytest.approx(_logprobs(one), abs=1e-4)
    return eng, two


def test_uneven_split_with_biases_matches_one_process(llama: Path) -> None:
    eng, _ = _compare(llama)
    assert [c.shape[2] for c in eng.runner.kv_caches] == [2, 2]  # rank 0's KV heads only
    assert eng.runner.model.model.layers[0].self_attn.num_heads == 4
    assert not workers()


def test_replicated_kv_head_and_tied_embeddings(tmp_path: Path) -> None:
    path = save_llama(tmp_path / "mqa", hidden_size=128, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)
    eng, _ = _compare(path)
    assert eng.runner.plan.shards[1].kv_heads == (0, 1)


def test_int8_kv_cache_matches_one_process(llama: Path) -> None:
    """The int8 KV pool under 2 ranks: each rank's KV heads carry their own per-head
    scales, so the shards hold what one process holds."""
    eng, _ = _compare(llama, kv_cache_dtype="int8")
    assert eng.kv_dtype == torch.int8


def test_gpt2_matches_one_process(tmp_path: Path) -> None:
    """Also: an explicit rendezvous address (``distributed_init_method``)."""
    _compare(save_gpt2(tmp_path / "gpt2"),
             distributed_init_method=f"tcp://127.0.0.1:{free_port()}")


@pytest.fixture(scope="module")
def int8_engine(llama: Path) -> Iterator[LLMEngine]:
    from roseinfer.kernels import cpu_kernels_available

    if not cpu_kernels_available():
        pytest.skip("int8 weights need the C++ kernels")
    eng = engine(llama, 2, quantization="int8", max_num_batched_tokens=24)
    yield eng
    eng.shutdown()


def _arrivals(seed: int, count: int) -> list[Arrival]:
    rng = random.Random(seed)
    return [Arrival(rng.randint(0, 6), f"load-{i}",
                    [rng.randrange(3, 301) for _ in range(rng.randint(1, 40))], greedy(
                        rng.randint(2, 12))) for i in range(count)]


def test_int8_logits_are_batch_invariant(int8_engine: LLMEngine) -> None:
    """A request's logits rows bitwise equal alone and among others (other rows, other
    prefill chunking): the all-reduce of 2 partial sums is row-local."""
    target = Arrival(0, "target", [9, 8, 7, 6, 5, 4, 3, 30, 31, 32, 33, 34, 35] * 3, greedy(8))
    alone = run_schedule(int8_engine, [target])
    batched = run_schedule(int8_engine, [Arrival(2, "target", target.prompt, target.params)]
                           + _arrivals(1, 6))
    assert batched.max_rows > 1
    assert_same_logits(alone, batched, "2 ranks, int8: alone vs batched")


def test_int8_close_to_one_process(llama: Path, int8_engine: LLMEngine) -> None:
    """int8 shards quantize exactly the whole model's blocks: only the order of the
    row-parallel sums differs."""
    params = greedy(6, logprobs=3)
    one = generate(engine(llama, 1, quantization="int8"), PROMPTS, params)
    two = generate(int8_engine, PROMPTS, params)
    assert _logprobs(two) == pytest.approx(_logprobs(one), abs=2e-3)


def test_speculative_decoding_gives_the_same_tokens(llama: Path,
                                                   int8_engine: LLMEngine) -> None:
    """Drafts add rows per request to the gathered logits; greedy output is unchanged."""
    prompts = [[11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12], [40, 41, 40, 41, 40, 41]]
    want = tokens(generate(int8_engine, prompts, greedy(16)))
    spec = engine(llama, 2, quantization="int8", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1})
    try:
        assert tokens(generate(spec, prompts, greedy(16))) == want
        assert spec.stats.spec_decode_num_drafts > 0
    finally:
        spec.shutdown()
