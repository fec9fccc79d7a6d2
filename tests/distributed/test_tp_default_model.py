"""The default model (SmolLM2-135M, Q4_1 GGUF) over 2 ranks: 9 query heads and 3 KV
heads split 6 + 3 / 2 + 1.  Under batching, chunked prefill and preemption its greedy
tokens equal one process's (which runs the C++ decoder stack), in exact fp32 weights:
the row-parallel sums add the ranks' partial sums in another order than one process,
and the default format's int8 activations (gate/up) can turn such a last-bit difference
into another token some steps later (one of these six prompts, at its 9th token)."""

from __future__ import annotations

import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from tests.distributed.helpers import generate, greedy, tokens, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three uses of a paperclip: 1.",
    "In 1969, the first humans to walk on the Moon were",
    "Translate to French: 'Good morning, how are you today, my friend?' ->",
]
OPTIONS = dict(num_threads=1, max_num_batched_tokens=32, num_kv_blocks=8, block_size=16,
               weight_cache=False, quantization="none")


def _run(size: int) -> tuple[list[list[int]], int]:
    eng = LLMEngine(EngineConfig(tensor_parallel_size=size, **OPTIONS))
    try:
        out = tokens(generate(eng, PROMPTS, greedy(16)))
        return out, eng.stats.num_preemptions
    finally:
        eng.shutdown()


def test_two_ranks_give_the_tokens_of_one_process() -> None:
    two, preempted_two = _run(2)
    assert not workers()
    one, preempted_one = _run(1)
    assert preempted_one > 0 and preempted_two > 0  # the pool is too small for all six
    assert two == one
