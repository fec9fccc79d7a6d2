"""A failure while stepping fails only the request it belongs to (tiny random Llama).

Faults are injected into the model: a "poison" prompt token makes the forward raise,
a "NaN" token turns its hidden row into NaN; a sampler row with every token masked
has nothing to sample. The other requests of the same steps must finish with the
tokens they get without the faulty request, and the KV pool must come back whole.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.engine.engine import LLMEngine
from roseinfer.engine.fault_isolation import ModelFailedError
from roseinfer.engine.request_stream import (
    EngineDeadError,
    PendingRequest,
    QueueFullError,
    RequestFailedError,
    RequestTooLargeError,
)
from roseinfer.engine.validation import InvalidRequestError
from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams
from tests.engine.tiny_models import engine_from_hf, tiny_hf_llama

POISON = 250  # the forward raises when this id is among the step's tokens
NAN = 251  # the hidden state of this token's position becomes NaN

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21], [22, 23]]


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_llama()


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def faulty_engine(hf_model, **options) -> LLMEngine:  # noqa: ANN001
    engine = engine_from_hf(hf_model, block_size=4, **options)
    model = engine.runner.model
    forward = model.forward

    def injected(input_ids, positions, kv_caches, meta):  # noqa: ANN001, ANN202
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected fault")
        hidden = forward(input_ids, positions, kv_caches, meta)
        return hidden.masked_fill((input_ids == NAN)[:, None], float("nan"))

    model.forward = injected
    return engine


def run_all(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):  # noqa: ANN201
    return LLM.from_engine(engine).generate(prompts, params)


def assert_pool_whole(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.has_unfinished_requests()


def reference(hf_model, prompts, params) -> list[list[int]]:  # noqa: ANN001
    outs = run_all(engine_from_hf(hf_model, block_size=4), prompts, params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("bad_prompt", [[3, 4, POISON, 6], [3, 4, 5, NAN]])
def test_failing_request_fails_alone(hf_model, bad_prompt) -> None:  # noqa: ANN001
    engine = faulty_engine(hf_model)
    params = [greedy(), greedy(6), greedy(), greedy(5)]
    want = reference(hf_model, PROMPTS, params)
    prompts = PROMPTS[:2] + [bad_prompt] + PROMPTS[2:]
    outs = run_all(engine, prompts, params[:2] + [greedy()] + params[2:])
    bad = outs.pop(2)
    assert bad.finished and bad.outputs[0].finish_reason == "error" and bad.error
    assert ("injected fault" in bad.error) if POISON in bad_prompt else ("non-finite" in bad.error)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs)
    assert engine.stats.finished.get("error") == 1
    assert_pool_whole(engine)


def test_failure_mid_decode_in_a_busy_batch(hf_model) -> None:  # noqa: ANN001
    """A bad request joins while the others are mid-prefill (small chunks) or decoding."""
    engine = faulty_engine(hf_model, max_num_batched_tokens=8)
    params = [greedy(10)] * len(PROMPTS)
    want = reference(hf_model, PROMPTS, params)
    llm = LLM.from_engine(engine)
    ids = []
    for p in PROMPTS:
        rid = engine.next_request_id()
        engine.add_request(rid, p, params[0])
        ids.append(rid)
    engine.step()
    engine.step()  # the others are mid-prefill / decoding when the bad one arrives
    engine.add_request("bad", [7, 8, NAN], greedy())
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert [finals[r].outputs[0].token_ids for r in ids] == want
    assert llm is not None
    assert_pool_whole(engine)


def test_row_with_every_token_masked_fails_alone(hf_model) -> None:  # noqa: ANN001
    engine = engine_from_hf(hf_model, block_size=4)
    vocab = engine.model_config.vocab_size
    masked = SamplingParams(temperature=0.7, max_tokens=4, min_tokens=2, seed=1,
                            stop_token_ids=list(range(vocab)))
    params = [greedy(), masked, greedy(6)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    want = reference(hf_model, [PROMPTS[0], PROMPTS[2]], [params[0], params[2]])
    outs = run_all(engine, prompts, params)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "no token can be sampled" in outs[1].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == want
    assert_pool_whole(engine)


def test_all_requests_failing_with_a_working_model_is_not_fatal(hf_model) -> None:  # noqa: ANN001
    engine = faulty_engine(hf_model)
    outs = run_all(engine, [[POISON, 5], [6, POISON]], [greedy(), greedy()])
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert run_all(engine, [PROMPTS[0]], [greedy()])[0].outputs[0].token_ids == reference(
        hf_model, [PROMPTS[0]], [greedy()])[0]
    assert_pool_whole(engine)


def test_broken_model_raises_model_failed(hf_model) -> None:  # noqa: ANN001
    engine = engine_from_hf(hf_model, block_size=4)

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("weights gone")

    engine.runner.model.forward = broken
    engine.add_request("a", PROMPTS[0], greedy())
    with pytest.raises(ModelFailedError, match="weights gone"):
        engine.step()


def test_async_engine_dead_when_the_model_cannot_run(hf_model) -> None:  # noqa: ANN001
    engine = engine_from_hf(hf_model, block_size=4)

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("weights gone")

    engine.runner.model.forward = broken

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            with pytest.raises(EngineDeadError, match="weights gone"):
                async for _ in ae.add_request("a", PROMPTS[0], greedy()):
                    pass
            assert not ae.healthy and isinstance(ae.dead_reason, ModelFailedError)
        finally:
            ae.shutdown()

    asyncio.run(main())


def test_async_engine_fails_one_stream_and_dies_only_with_the_model(hf_model) -> None:  # noqa: ANN001
    engine = faulty_engine(hf_model)

    async def main() -> tuple[str, list[int]]:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            bad = ae.add_request("bad", [POISON, 5, 6], greedy())
            good = ae.add_request("good", PROMPTS[0], greedy())
            with pytest.raises(RequestFailedError, match="injected fault") as err:
                async for _ in bad:
                    pass
            tokens: list[int] = []
            async for out in good:
                tokens = out.outputs[0].token_ids
            assert ae.healthy
            return str(err.value), tokens
        finally:
            ae.shutdown()

    _, tokens = asyncio.run(main())
    assert tokens == reference(hf_model, [PROMPTS[0]], [greedy()])[0]


def test_queue_admission_counts_sequences_whole_or_nothing(hf_model) -> None:  # noqa: ANN001
    engine = engine_from_hf(hf_model, block_size=4)

    async def main() -> None:
        gate = threading.Event()
        engine_step = engine.step
        engine.step = lambda: (gate.wait(10), engine_step())[1]  # nothing leaves the queue
        ae = AsyncEngine(engine, max_waiting_requests=4)
        ae.start()
        try:
            with pytest.raises(RequestTooLargeError, match="5 sequences"):
                ae.add_requests([PendingRequest(f"r{i}", [5, 6], greedy()) for i in range(5)])
            with pytest.raises(RequestTooLargeError):
                ae.add_request("n8", [5, 6], greedy(n=8))
            ae.add_request("a", [5, 6], greedy(n=3))
            with pytest.raises(QueueFullError):  # 3 + 2 > 4: refused whole
                ae.add_requests([PendingRequest("b", [5], greedy()),
                                 PendingRequest("c", [5], greedy())])
            ae.add_request("d", [5, 6], greedy())  # 3 + 1 fits
            assert ae.num_waiting() == 4
        finally:
            gate.set()
            ae.shutdown()

    asyncio.run(main())


def test_invalid_requests_refused_before_queueing(hf_model) -> None:  # noqa: ANN001
    engine = engine_from_hf(hf_model, block_size=4)
    with pytest.raises(InvalidRequestError, match="stop_token_ids") as err:
        engine.add_request("a", [5, 6], greedy(min_tokens=2, stop_token_ids=[999999]))
    assert err.value.param == "stop_token_ids"
    for name, value in [("temperature", float("inf")), ("temperature", float("nan")),
                        ("top_p", float("nan")), ("presence_penalty", float("-inf")),
                        ("repetition_penalty", float("inf")), ("min_p", float("nan"))]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x" * 60000])
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[f"s{i}" for i in range(100)])
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-1)
    assert not engine.has_unfinished_requests()


def test_child_ids_checked_before_anything_is_scheduled(hf_model) -> None:  # noqa: ANN001
    engine = engine_from_hf(hf_model, block_size=4)
    engine.add_request("x#1", [5, 6, 7], greedy(3))
    with pytest.raises(InvalidRequestError, match="x#1"):
        engine.add_request("x", [5, 6, 7], greedy(3, n=2))
    assert set(engine.scheduler.requests) == {"x#1"}
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["x#1"]
    assert_pool_whole(engine)


def test_prompt_logprobs_exact_after_preemption_and_chunking(hf_model) -> None:  # noqa: ANN001
    prompt = [(7 * i + 3) % 240 + 3 for i in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    roomy = engine_from_hf(hf_model, block_size=4)
    # A pool too small for everyone + small chunks: the logprob request is preempted.
    tight = engine_from_hf(hf_model, block_size=4, num_kv_blocks=20, max_num_batched_tokens=8)
    others = [[(5 * i + j) % 240 + 3 for i in range(25)] for j in range(4)]
    for engine in (roomy, tight):
        outs = run_all(engine, others + [prompt],
                       [greedy(20)] * len(others) + [params])
        plp = outs[-1].prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        for j in range(1, len(prompt)):
            entry = plp[j]
            assert prompt[j] in entry and len(entry) <= 3
            assert abs(entry[prompt[j]].logprob - ref[j - 1, prompt[j]].item()) < 1e-4
        assert_pool_whole(engine)
    assert tight.stats.num_preemptions > 0
