"""A request's logits do not depend on how many threads the kernels run on: the default
model's sampled logits at every step (prefill chunks, then decode batches of three
requests) are bitwise the same with 1 and 2 threads, in the default format and over the
int8 KV cache (docs/CONTRACTS.md: ranges of work decide which thread runs an item,
never a value)."""

from __future__ import annotations

import pytest
import torch

from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # default model: `make test-fast` skips it

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Translate 'Good morning' into Spanish."]


def _step_logits(threads: int, kv: str) -> list[torch.Tensor]:
    """Every step's sampled logits of the three greedy chats, prompts in 16-token chunks."""
    llm = LLM(kv_cache_dtype=kv, max_num_batched_tokens=16, num_threads=threads)
    assert torch.get_num_threads() == threads
    runner = llm.engine.runner
    execute, seen = runner.execute, []

    def recorded(scheduled):  # the step as it was, its logits kept
        out = execute(scheduled)
        seen.append(out.sample_logits.clone())
        return out

    runner.execute = recorded
    llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
             SamplingParams(max_tokens=12, temperature=0.0))
    return seen


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_logits_do_not_depend_on_thread_count(kv: str) -> None:
    before = torch.get_num_threads()
    try:
        one, two = _step_logits(1, kv), _step_logits(2, kv)
    finally:
        torch.set_num_threads(before)
    assert len(one) == len(two) > 12
    for step, (a, b) in enumerate(zip(one, two, strict=True)):
        assert torch.equal(a, b), f"step {step} differs between 1 and 2 threads"
