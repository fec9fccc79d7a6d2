"""The default model's greedy steps take its LM head's greedy kernel (the GGUF's Q8_0
embedding, ``csrc/head_greedy.h``): the tokens are those of the full logits' argmax,
and a step with any request that needs logits (sampling, logprobs) computes them."""

from __future__ import annotations

import pytest

from roseinfer.engine import step_sampler
from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three plus four equals",
           "Once upon a time", "The chemical symbol for gold is", "Translate 'cat' to French:",
           "The largest planet is", "Water boils at", "My favourite colour is",
           "import numpy as np\n", "The opposite of hot is", "Seven times six is",
           "In 1492, Columbus", "A haiku about rain:", "SELECT * FROM", "The moon orbits"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM()  # the default format: the GGUF as stored, its Q8_0 embedding the head
    head = getattr(llm.engine.runner.model.lm_head, "kernel", None)
    if head is None or not head.has_greedy():
        pytest.skip("no greedy head kernel in this build (AVX-512 VNNI and VBMI)")
    return llm


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(PROMPTS[:len(params)], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _counting(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    model = llm.engine.runner.model
    inner, used = model.compute_greedy, [0]

    def counted(hidden):
        got = inner(hidden)
        used[0] += got is not None
        return got

    monkeypatch.setattr(model, "compute_greedy", counted)
    return used


def test_greedy_steps_give_the_tokens_of_the_full_logits(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # 16 rows a decode step: the head's int8 pass (5 rows and more)
    greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    used = _counting(llm, monkeypatch)
    fast = _tokens(llm, greedy)
    assert used[0] >= 24  # every decode step (and the prefill's) took the kernel
    monkeypatch.setattr(step_sampler.StepSampler, "greedy_only", staticmethod(lambda s: False))
    used[0] = 0
    assert _tokens(llm, greedy) == fast
    assert used[0] == 0


def test_steps_with_a_request_that_needs_logits_compute_them(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = _tokens(llm, [greedy])[0]
    used = _counting(llm, monkeypatch)
    for other in (SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=0.0, logprobs=2, max_tokens=16, ignore_eos=True)):
        assert _tokens(llm, [greedy, other])[0] == alone
    assert used[0] == 0


def test_bench_profile_steps_take_the_greedy_head_as_the_engine_does(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """`roseinfer bench profile` times the steps the engine runs: all-greedy decode steps
    ask the runner for the greedy head's tokens, in its unprofiled and profiled passes."""
    from roseinfer.bench.profile import run_profile

    runner = llm.engine.runner
    inner, asked = runner.execute, []

    def recorded(scheduled, greedy=False):
        asked.append(greedy)
        return inner(scheduled, greedy=greedy)

    monkeypatch.setattr(runner, "execute", recorded)
    prof = run_profile(llm.engine, 5, prompt_len=16, steps=2)
    assert prof["batch"] == 5
    assert len(asked) >= 4 and all(asked[-4:])  # 2 timed steps, then 2 profiled ones
