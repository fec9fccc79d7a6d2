"""Issue #12, n-gram speculative decoding: with speculation on, every request yields
exactly the tokens it yields without it (greedy, and seeded sampling too: the verifier
draws each emitted token's uniform from the request's generator and rewinds the rest),
at batch 1 and 16, with prefix caching on or off, prompts prefilled in small chunks, a
KV pool small enough to preempt, penalties, min_tokens, logit_bias, logprobs and n > 1;
drafts are really verified (some accepted, some rejected) and every KV block is free
afterwards. The contract behind it is batch invariance (docs/CONTRACTS.md): a row's
logits are the same as one of k + 1 verification rows as in a plain decode step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from roseinfer.engine.request import Request
from roseinfer.engine.spec_decode import SpecDecoding
from roseinfer.sampling_params import SamplingParams
from roseinfer.speculative_config import SpeculativeConfig
from tests.engine.invariance_helpers import cpu_kernels
from tests.engine.spec_helpers import SPEC, greedy, repeat_prompts, run_requests, spec_engine


@pytest.fixture(autouse=True)
def kernels() -> Iterator[None]:
    """Exact equality needs the batch-invariant kernels (skipped where they cannot be built)."""
    with cpu_kernels(True):
        yield


def both(prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
         spec: dict = SPEC, quantization: str = "auto", **options: object):  # noqa: ANN201
    """(run without speculation, run with it) on fresh engines with the same options."""
    off = run_requests(spec_engine(None, quantization, **options), prompts, params)
    on = run_requests(spec_engine(spec, quantization, **options), prompts, params)
    return off, on


def assert_same_tokens(off, on) -> None:  # noqa: ANN001
    __tracebackhide__ = True
    assert set(off.outputs) == set(on.outputs)
    for rid, out in off.outputs.items():
        for a, b in zip(out.outputs, on.outputs[rid].outputs, strict=True):
            assert b.token_ids == a.token_ids, f"{rid}: tokens differ"
            assert b.finish_reason == a.finish_reason, rid


def assert_drafts_verified(run) -> None:  # noqa: ANN001
    """Drafts were fed, some accepted and some rejected: the test is not vacuous."""
    __tracebackhide__ = True
    s = run.stats
    assert s.spec_decode_num_drafts > 0, "nothing was drafted"
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens, (
        f"accepted {s.spec_decode_num_accepted_tokens} of {s.spec_decode_num_draft_tokens}")
    multi = [d for deltas in run.deltas.values() for d in deltas if len(d) > 1]
    assert multi, "no step gave a request several tokens"


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_greedy_batch_1(quantization: str) -> None:
    prompts = repeat_prompts(0, 1)
    off, on = both(prompts, greedy(60), quantization=quantization)
    assert_same_tokens(off, on)
    assert_drafts_verified(on)
    assert on.num_steps < off.num_steps


@pytest.mark.parametrize("options", [
    {},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 16},  # chunked prefill, drafts cut by the budget
    {"num_kv_blocks": 40, "block_size": 4},  # preemption
    {"kv_cache_dtype": "int8"},  # the int8 KV pool (issue 27)
], ids=["default", "no-prefix-cache", "chunked", "preempting", "int8-kv"])
def test_greedy_batch_16(options: dict) -> None:
    prompts = repeat_prompts(1, 16)
    off, on = both(prompts, greedy(40), **options)
    assert_same_tokens(off, on)
    assert_drafts_verified(on)
    if "num_kv_blocks" in options:
        assert on.stats.num_preemptions > 0, "the pool must preempt"


def test_drafts_of_the_true_continuation_are_all_accepted() -> None:
    """Drafts equal to the greedy continuation (``OracleDrafter``, the ceiling measured by
    ``benchmarks/spec_decode.py --oracle``) are accepted to the last one, a step then
    gives a request 1 + k tokens, and the output is the same as without speculation."""
    from roseinfer.bench.oracle import OracleDrafter

    prompts = repeat_prompts(4, 6)
    off = run_requests(spec_engine(None), prompts, greedy(30))
    answers = {tuple(p): off.tokens(f"r{i}") for i, p in enumerate(prompts)}
    engine = spec_engine(SPEC, max_num_batched_tokens=64)  # prefill chunks: no drafts
    assert engine.spec is not None
    engine.spec.propose = OracleDrafter(answers, 4).propose  # type: ignore[method-assign]
    on = run_requests(engine, prompts, greedy(30))
    assert_same_tokens(off, on)
    s = on.stats
    assert s.spec_decode_num_draft_tokens > 0
    assert s.spec_decode_num_accepted_tokens == s.spec_decode_num_draft_tokens
    assert max(len(d) for deltas in on.deltas.values() for d in deltas) == 5
    assert on.num_steps < off.num_steps


def test_prefix_cache_hits_after_speculation() -> None:
    """A second request whose prompt is the first one's prompt + output reuses the blocks
    the first one filled while speculating (hashed from accepted tokens only), and still
    yields the same tokens as without speculation."""
    prompt = repeat_prompts(2, 1)[0]
    engine = spec_engine(SPEC, block_size=4)
    first = run_requests(engine, [prompt], greedy(40))
    follow = prompt + first.tokens("r0")
    engine.add_request("again", follow, greedy(20))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs["again"].num_cached_tokens >= len(follow) - 8
    ref = run_requests(spec_engine(None, block_size=4), [follow], greedy(20))
    assert outs["again"].outputs[0].token_ids == ref.tokens("r0")


def test_adaptive_default_is_exact_too() -> None:
    adaptive = dict(SPEC, adaptive=True, num_speculative_tokens=6)
    prompts = repeat_prompts(3, 8)
    off, on = both(prompts, greedy(40), spec=adaptive)
    assert_same_tokens(off, on)
    assert on.stats.spec_decode_num_accepted_tokens > 0


def test_seeded_sampling_with_filters_and_penalties() -> None:
    """Seeded sampled rows (temperature, top-k/p, min-p, repetition / presence /
    frequency penalties over the output so far, logit_bias, min_tokens) give the same
    tokens with and without speculation; unseeded ones are only valid."""
    prompts = repeat_prompts(4, 6)
    params = [
        SamplingParams(temperature=0.3, seed=11, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.5, top_p=0.9, top_k=20, seed=12, max_tokens=30,
                       ignore_eos=True),
        SamplingParams(temperature=0.4, min_p=0.1, seed=13, max_tokens=30,
                       repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                       ignore_eos=True),
        SamplingParams(temperature=0.2, seed=14, max_tokens=30, min_tokens=10,
                       stop_token_ids=[prompts[3][-1]], logit_bias={5: 3.0, 6: -5.0}),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.5,
                       frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0.3, max_tokens=30, ignore_eos=True),  # unseeded
    ]
    off, on = both(prompts, params)
    assert on.stats.spec_decode_num_drafts > 0
    for i in range(5):
        assert on.tokens(f"r{i}") == off.tokens(f"r{i}"), f"request {i}"
    assert len(on.tokens("r5")) == 30


def test_logprobs_equal() -> None:
    prompts = repeat_prompts(5, 3)
    off, on = both(prompts, greedy(30, logprobs=3))
    assert_drafts_verified(on)
    for rid, out in off.outputs.items():
        a, b = out.outputs[0], on.outputs[rid].outputs[0]
        assert len(b.logprobs) == len(b.token_ids)
        assert b.logprobs == a.logprobs, rid
        assert b.cumulative_logprob == a.cumulative_logprob
        deltas = [lp for d in on.deltas[rid] for lp in d]
        assert deltas == b.token_ids


def test_n_greater_than_1() -> None:
    prompts = repeat_prompts(6, 2)
    params = SamplingParams(n=3, temperature=0.3, seed=5, max_tokens=25, ignore_eos=True)
    off, on = both(prompts, params)
    assert_same_tokens(off, on)
    assert on.stats.spec_decode_num_drafts > 0


def test_max_tokens_never_exceeded() -> None:
    prompts = repeat_prompts(7, 10)
    params = [greedy(m) for m in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17)]
    off, on = both(prompts, params)
    assert_same_tokens(off, on)
    for i, p in enumerate(params):
        assert len(on.tokens(f"r{i}")) == p.max_tokens


def test_abort_while_speculating_frees_blocks() -> None:
    engine = spec_engine(SPEC, block_size=4)
    for i, prompt in enumerate(repeat_prompts(8, 6)):
        engine.add_request(f"r{i}", prompt, greedy(200))
    drafted = 0
    for _ in range(12):
        engine.step()
        drafted = engine.stats.spec_decode_num_drafts
    assert drafted > 0
    engine.abort_all()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.has_unfinished_requests()


def test_no_drafts_for_constrained_requests() -> None:
    """A structured-output request decodes plainly (its mask is for its next token)."""
    spec = SpecDecoding(SpeculativeConfig.from_dict(SPEC), max_num_batched_tokens=256)
    plain = Request("plain", [5, 6, 7, 5, 6], SamplingParams(max_tokens=10))
    constrained = Request("json", [5, 6, 7, 5, 6], SamplingParams(max_tokens=10))
    constrained.grammar = object()  # type: ignore[assignment]
    for req in (plain, constrained):
        req.num_computed_tokens = req.num_tokens - 1  # decoding
    spec.propose([plain, constrained])
    assert plain.spec_token_ids == [7, 5, 6, 7]
    assert constrained.spec_token_ids == []
