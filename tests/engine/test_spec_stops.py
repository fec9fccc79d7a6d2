"""Stops inside a run of accepted drafts: a stop token id, EOS or a stop string met by a
token that is not the last one a step emitted ends the request right there, with the
same tokens, text, finish reason, stop reason and logprobs as without speculation; the
tokens after it are dropped; streamed deltas add up to the final text.

The model is scripted (``ScriptedRunner`` stands in for the runner): whatever the
context, output token i is ``SCRIPT[i]``, and the prompt holds the script's start, so
the n-gram drafts copy it and whole runs of drafts are accepted, deterministically.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from roseinfer.engine.engine import LLMEngine
from roseinfer.engine.scheduler import ScheduledRequest
from roseinfer.llm import LLM
from roseinfer.outputs import CompletionOutput
from roseinfer.runner.model_runner import StepLogits
from roseinfer.sampling_params import SamplingParams
from tests.engine.invariance_helpers import VOCAB
from tests.engine.spec_helpers import SPEC, CharTokenizer, spec_engine, text

SCRIPT = list(range(100, 160))  # distinct tokens: each stop matches one place only
PROMPT = [3, 4, 5, *SCRIPT[:30], 7, 8]
# Steps: the prefill samples SCRIPT[0]; each later step verifies 4 drafts copied from the
# prompt and emits 5 tokens: SCRIPT[1:6], SCRIPT[6:11], ... Token 8 is inside a run.
J = 8


class ScriptedRunner:
    """``ModelRunner.execute`` stand-in: each row to sample gets logits that make output
    token i ``SCRIPT[i]`` (i = the row's position - prompt length + 1): argmax, and a
    softmax with some spread for the logprobs."""

    def __init__(self, engine: LLMEngine) -> None:
        engine.runner.execute = self.execute  # type: ignore[method-assign]

    def execute(self, scheduled: list[ScheduledRequest], greedy: bool = False) -> StepLogits:
        rows = []  # logits even for a greedy step (the runner may give them or tokens)
        for s in scheduled:
            if not s.completes:
                continue
            req = s.request
            first = req.num_tokens - req.num_prompt_tokens  # output index of the first row
            for j in range(len(s.spec_token_ids) + 1):
                row = torch.linspace(0.0, 1.0, VOCAB)
                row[SCRIPT[first + j]] = 5.0
                rows.append(row)
        logits = torch.stack(rows) if rows else torch.empty(0, VOCAB)
        return StepLogits(logits, {})


class EmitSpy:
    """Records, per request, the tokens each step's verifier emitted (before stops)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.emitted: dict[str, list[list[int]]] = defaultdict(list)
        inner = engine.step_sampler.sample

        def sample(scheduled, logits, failed, masks=None):  # noqa: ANN001, ANN202
            out = inner(scheduled, logits, failed, masks)
            for s, tokens in zip(scheduled, out, strict=True):
                if tokens:
                    self.emitted[s.request.request_id].append(list(tokens))
            return out

        engine.step_sampler.sample = sample  # type: ignore[method-assign]

    def cut_inside_a_run(self, kept: int) -> bool:
        """The request's steps emitted more tokens than it kept, the last one several."""
        steps = next(iter(self.emitted.values()))
        return sum(len(t) for t in steps) > kept and len(steps[-1]) > 1


def scripted_engine(spec: dict | None, eos: tuple[int, ...] = (2,)) -> LLMEngine:
    engine = spec_engine(spec, tokenizer=CharTokenizer(eos), block_size=4)
    ScriptedRunner(engine)
    return engine


def generate(spec: dict | None, params: SamplingParams, eos: tuple[int, ...] = (2,)
             ) -> tuple[CompletionOutput, EmitSpy, LLMEngine]:
    engine = scripted_engine(spec, eos)
    spy = EmitSpy(engine)
    out = LLM.from_engine(engine).generate([PROMPT], params)[0].outputs[0]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return out, spy, engine


def free(max_tokens: int = 40, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def pair(params: SamplingParams, eos: tuple[int, ...] = (2,)):  # noqa: ANN201
    """(output without speculation, output with it, the spy of the second run)."""
    a, _, _ = generate(None, params, eos)
    b, spy, engine = generate(SPEC, params, eos)
    assert engine.stats.spec_decode_num_accepted_tokens >= 4
    return a, b, spy


def assert_same(a: CompletionOutput, b: CompletionOutput) -> None:
    __tracebackhide__ = True
    assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
        a.token_ids, a.text, a.finish_reason, a.stop_reason)
    assert b.logprobs == a.logprobs and b.cumulative_logprob == a.cumulative_logprob


def test_the_script_is_copied_in_runs() -> None:
    out, spy, engine = generate(SPEC, free(21))
    assert out.token_ids == SCRIPT[:21]
    assert [len(t) for t in spy.emitted["req-1"]] == [1, 5, 5, 5, 5]
    s = engine.stats
    assert (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens) == (4, 16, 16)
    assert s.spec_decode_accepted_per_pos == [4, 4, 4, 4]


@pytest.mark.parametrize("keep", [False, True], ids=["text-left-out", "include-stop-str"])
def test_stop_token_id_inside_a_run(keep: bool) -> None:
    params = free(stop_token_ids=[SCRIPT[J]], include_stop_str_in_output=keep, logprobs=2)
    a, b, spy = pair(params)
    assert_same(a, b)
    assert b.token_ids == SCRIPT[:J + 1]
    assert (b.finish_reason, b.stop_reason) == ("stop", SCRIPT[J])
    assert b.text == text(SCRIPT[:J + 1] if keep else SCRIPT[:J])
    assert len(b.logprobs) == J + 1
    assert spy.cut_inside_a_run(J + 1)


def test_eos_inside_a_run() -> None:
    a, b, spy = pair(SamplingParams(temperature=0.0, max_tokens=40, logprobs=0),
                     eos=(SCRIPT[J],))
    assert_same(a, b)
    assert b.token_ids == SCRIPT[:J + 1] and (b.finish_reason, b.stop_reason) == ("stop", None)
    assert b.text == text(SCRIPT[:J])
    assert spy.cut_inside_a_run(J + 1)


@pytest.mark.parametrize("keep", [False, True], ids=["text-left-out", "include-stop-str"])
def test_stop_string_inside_a_run(keep: bool) -> None:
    stop = text(SCRIPT[J - 1:J + 1])
    a, b, spy = pair(free(stop=[stop], include_stop_str_in_output=keep, logprobs=1))
    assert_same(a, b)
    assert b.token_ids == SCRIPT[:J + 1] and (b.finish_reason, b.stop_reason) == ("stop", stop)
    assert b.text == text(SCRIPT[:J + 1] if keep else SCRIPT[:J - 1])
    assert len(b.logprobs) == J + 1
    assert spy.cut_inside_a_run(J + 1)


def test_min_tokens_holds_back_a_stop_inside_a_run() -> None:
    """Below min_tokens the stop id is masked, so the output leaves the script there
    (rows after it see it among their own output: both runs agree token for token)."""
    a, b, _ = pair(free(20, stop_token_ids=[SCRIPT[J]], min_tokens=J + 2))
    assert_same(a, b)
    assert b.token_ids[J] != SCRIPT[J] and b.finish_reason == "length"


def test_max_tokens_inside_a_run() -> None:
    a, b, spy = pair(free(J + 1))
    assert_same(a, b)
    assert b.token_ids == SCRIPT[:J + 1] and b.finish_reason == "length"
    assert sum(len(t) for t in spy.emitted["req-1"]) == J + 1  # drafts capped, none wasted


def test_stream_deltas_add_up() -> None:
    params = free(stop=[text(SCRIPT[J - 1:J + 1])])
    engine = scripted_engine(SPEC)
    deltas = list(LLM.from_engine(engine).stream(PROMPT, params))
    assert "".join(deltas) == text(SCRIPT[:J - 1])
    assert any(len(d) > 1 for d in deltas), "several tokens per delta"
