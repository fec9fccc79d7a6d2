"""Greedy tokens of the default model equal HF transformers on the same weights."""

from __future__ import annotations

import pytest

from roseinfer.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow  # default model or real servers: `make test-fast` skips it

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    # Longer than several 16-token blocks.
    "Photosynthesis is the process by which green plants, algae and some bacteria convert "
    "light energy into chemical energy. During this process, carbon dioxide and water are "
    "combined, using the energy of sunlight captured by chlorophyll, to produce glucose and "
    "oxygen. The light-dependent reactions take place in the thylakoid membranes, while the "
    "Calvin cycle runs in the stroma. Explain in simple words why plants need light:",
]
NEW_TOKENS = 32




def test_greedy_equals_hf_transformers(default_llm, hf_reference) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = default_llm.generate(PROMPTS, params)
    assert max(len(o.prompt_token_ids) for o in outs) > 64
    for out in outs:
        ref = hf_greedy(hf_reference, out.prompt_token_ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == ref, out.prompt


def test_chat_template_and_text(default_llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24)
    out = default_llm.chat([{"role": "user", "content": "What is 2 + 2?"}], params)[0]
    text = out.outputs[0].text
    assert text.strip(), "the model should answer"
    assert "<|im_end|>" not in text
    assert "4" in text


def test_stream_deltas_concatenate_to_text(default_llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["."])
    prompt = "List three colours of the rainbow"
    full = default_llm.generate([prompt], params)[0].outputs[0]
    streamed = "".join(default_llm.stream(prompt, params))
    assert streamed == full.text
    assert full.finish_reason in ("stop", "length")
