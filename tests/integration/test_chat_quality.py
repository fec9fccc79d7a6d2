"""The quality gate's everyday chat answers, on the default model.

A default format must answer everyday questions as the exact fp32 model does (issue
#25's gate, on top of test_quantize.py's top-1 and perplexity): over a fixed set of
short chat questions (facts, arithmetic, a translation, a short code request), the
default format's greedy answer (``quantization="auto"``: the GGUF as stored, int16
activations) agrees with fp32's (``"none"``: the same weights dequantized) on its first
16 tokens for at least 80% of them, and "What is the capital of France?" names Paris.
The opt-in int8 KV cache (``kv_cache_dtype="int8"``, issue 27) over the exact weights
is held to an opt-in bound: 70% of the answers, Paris named.
"""

from __future__ import annotations

import pytest

from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "How many days are there in a week?",
    "What is 7 plus 5?",
    "What is 12 times 3?",
    "Which planet is known as the Red Planet?",
    "What color do you get when you mix blue and yellow?",
    "Translate 'Good morning' into Spanish.",
    "Write a Python function that returns the square of a number.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Name three primary colors.",
    "What is the largest ocean on Earth?",
    "How many legs does a spider have?",
]
TOKENS = 16


def _answers(llm: LLM) -> tuple[list[list[int]], list[str]]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def fp32_answers(default_llm: LLM) -> tuple[list[list[int]], list[str]]:
    return _answers(default_llm)  # the session's exact fp32 engine (conftest.py)


@pytest.mark.slow  # the default model, once per case (fp32: the session's engine)
@pytest.mark.parametrize(("quantization", "kv_cache_dtype", "share"),
                         [("auto", "auto", 0.8), ("none", "int8", 0.7)], ids=["default", "int8-kv"])
def test_default_format_answers_everyday_questions_as_fp32_does(
        quantization: str, kv_cache_dtype: str, share: float,
        fp32_answers: tuple[list[list[int]], list[str]]) -> None:
    """The default weights and KV cache (the gate: 80%); and the opt-in int8 KV cache over
    exact weights, held to an opt-in bound (70%, Paris named) as test_quantize.py holds
    its top-1 and perplexity: it sits at the gate's line, machine by machine (14 of 14 on
    a Zen 3, 11 of 14 on a Zen 4; over the default weights 9 of 14), docs/kv-cache.md."""
    ref_ids, ref_text = fp32_answers
    ids, text = _answers(LLM(quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                             kv_cache_memory_gb=0.1))
    same = [a == b for a, b in zip(ids, ref_ids, strict=True)]
    for q, ok, a, b in zip(QUESTIONS, same, text, ref_text, strict=True):
        print(f"{'=' if ok else '!'} {q!r}: {a!r} / fp32 {b!r}")
    assert sum(same) >= share * len(QUESTIONS), f"{sum(same)} of {len(QUESTIONS)} agree"
    assert "Paris" in text[0] and "Paris" in ref_text[0]
