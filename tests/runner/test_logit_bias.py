"""logit_bias, allowed_token_ids and structured-output masks in the sampler (row-local,
ids respected, logprobs raw), their validation (SamplingParams alone, then the
vocabulary in RequestValidator), and both through a tiny engine."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from roseinfer.engine.validation import InvalidRequestError, RequestValidator
from roseinfer.llm import LLM
from roseinfer.runner.sampler import Sampler, SamplingBatch
from roseinfer.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS, SamplingParams
from tests.engine.tiny_models import engine_from_hf, tiny_hf_llama

CPU = torch.device("cpu")
V = 16


def batch_of(params: Sequence[SamplingParams], allowed: torch.Tensor | None = None,
             suppress: Sequence[Sequence[int]] | None = None) -> SamplingBatch:
    b = len(params)
    return SamplingBatch.from_requests(params, [[]] * b, [[]] * b, [None] * b,
                                       suppress or [[]] * b, V, CPU, allowed_mask=allowed)


def sample(params: Sequence[SamplingParams], logits: torch.Tensor, **kw) -> list[int | None]:
    out = Sampler(torch.Generator().manual_seed(0))(logits, batch_of(params, **kw))
    valid = out.valid.tolist() if out.valid is not None else [True] * len(params)
    return [t if ok else None for t, ok in zip(out.token_ids.tolist(), valid, strict=True)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_logit_bias_moves_only_its_row() -> None:
    logits = torch.zeros(3, V)
    logits[:, 3] = 5.0
    params = [greedy(logit_bias={7: 6.0}), greedy(), greedy(logit_bias={3: -100.0, 9: 0.5})]
    assert sample(params, logits) == [7, 3, 9]


def test_logit_bias_with_temperature_concentrates_mass() -> None:
    logits = torch.zeros(1, V)
    params = [SamplingParams(temperature=1.0, logit_bias={11: 100.0})]
    assert all(sample(params, logits) == [11] for _ in range(20))


def test_allowed_token_ids_respected_per_row() -> None:
    gen = torch.Generator().manual_seed(1)
    params = [SamplingParams(temperature=1.0, allowed_token_ids=[2, 5]), SamplingParams(
        temperature=1.0), greedy(allowed_token_ids=[0, 1])]
    seen: set[int] = set()
    for _ in range(50):
        logits = torch.randn(3, V, generator=gen)
        a, b, c = sample(params, logits)
        assert a in (2, 5) and c == int(logits[2, :2].argmax())
        seen.add(b)
    assert len(seen) > 2  # the unconstrained row is not restricted


def test_allowed_mask_joins_allowed_token_ids_and_suppression() -> None:
    logits = torch.arange(V, dtype=torch.float32).repeat(3, 1)  # prefers high ids
    allowed = torch.ones(3, V, dtype=torch.bool)
    allowed[0] = False
    allowed[0, [1, 4, 6]] = True
    allowed[1, 8:] = False
    params = [greedy(allowed_token_ids=[1, 4, 9]), greedy(), greedy()]
    assert sample(params, logits, allowed=allowed, suppress=[[], [7], []]) == [4, 6, V - 1]
    nothing = torch.zeros(1, V, dtype=torch.bool)
    assert sample([greedy()], logits[:1], allowed=nothing) == [None]  # flagged, not sampled


def test_rows_do_not_depend_on_each_other() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, V, generator=gen)
    params = [greedy(logit_bias={3: 2.0}), greedy(allowed_token_ids=[1, 2, 3]), greedy(),
              greedy(logit_bias={0: -5.0})]
    together = sample(params, logits)
    alone = [sample([p], logits[i:i + 1])[0] for i, p in enumerate(params)]
    assert together == alone


def test_logprobs_stay_raw() -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    params = [greedy(logprobs=2, logit_bias={5: 50.0}, allowed_token_ids=[5, 6])]
    out = Sampler()(logits, batch_of(params))
    assert out.token_ids.tolist() == [5]
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs.item() == pytest.approx(raw[0, 5].item())
    assert out.top_logprobs[0][0].tolist() == raw[0].topk(2).indices.tolist()


def test_sampler_refuses_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="token ids"):
        batch_of([greedy(logit_bias={V: 1.0})])
    with pytest.raises(ValueError, match="token ids"):
        batch_of([greedy(allowed_token_ids=[V + 3])])
    with pytest.raises(ValueError, match="allowed mask"):
        batch_of([greedy()], allowed=torch.ones(1, V + 1, dtype=torch.bool))


@pytest.mark.parametrize("kwargs, match", [
    ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"logit_bias": {1: float("inf")}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"logit_bias": [(1, 2.0)]}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.0]}, "allowed_token_ids"),
    ({"allowed_token_ids": "12"}, "allowed_token_ids"),
    ({"allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))}, "allowed_token_ids"),
])
def test_params_refused_alone(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_params_normalised() -> None:
    p = SamplingParams(logit_bias={3: 1, 4: -2.5}, allowed_token_ids=[4, 3])
    assert p.logit_bias == {3: 1.0, 4: -2.5} and p.allowed_token_ids == (4, 3)


@pytest.mark.parametrize("field, value", [("logit_bias", {V: 1.0}),
                                          ("allowed_token_ids", [0, V])])
def test_validator_refuses_ids_outside_the_vocabulary(field: str, value: object) -> None:
    validator = RequestValidator(vocab_size=V, max_model_len=64, has_tokenizer=False)
    with pytest.raises(InvalidRequestError, match=field) as err:
        validator.check_params(SamplingParams(**{field: value}))
    assert err.value.param == field
    validator.check_params(SamplingParams(logit_bias={V - 1: 1.0}, allowed_token_ids=[V - 1]))


def test_through_the_engine() -> None:
    engine = engine_from_hf(tiny_hf_llama(), block_size=4)
    llm = LLM.from_engine(engine)
    prompt = [5, 6, 7, 8]
    outs = llm.generate([prompt] * 3, [
        SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True,
                       allowed_token_ids=[10, 20, 30]),
        greedy(max_tokens=6, ignore_eos=True, logit_bias={42: 100.0}),
        greedy(max_tokens=6, ignore_eos=True)])
    assert set(outs[0].outputs[0].token_ids) <= {10, 20, 30}
    assert outs[1].outputs[0].token_ids == [42] * 6
    plain = llm.generate([prompt], greedy(max_tokens=6, ignore_eos=True))[0]
    assert outs[2].outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("x", prompt, greedy(logit_bias={256: 1.0}))
    assert err.value.param == "logit_bias" and not engine.has_unfinished_requests()
