"""Structured outputs through the engine, on a tiny random Llama with the real tokenizer.

The random model picks random allowed tokens, so every output exercises the masks:
each sampled token must be allowed by its row's mask (``MaskSpy``), outputs must match
their regex / choice / grammar / schema, EOS is allowed exactly when the grammar
accepts, and this holds with temperature sampling, n > 1, prefix caching, preemption
and chunked prefill. Failures (a matcher in error) fail their request alone.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from roseinfer.engine.engine import LLMEngine
from roseinfer.engine.structured.masks import MaskBuilder
from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams
from roseinfer.structured_outputs import StructuredOutputsParams as SO
from tests.engine.structured_helpers import TOKENIZER_VOCAB, MaskSpy, replay, tiny_engine

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"enum": ["red", "green", "blue"]},
                   "name": {"type": "string", "maxLength": 6},
                   "ok": {"type": "boolean"}},
    "required": ["id", "tag", "name", "ok"], "additionalProperties": False,
}
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
GRAMMAR_RE = r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"
SPECS = [
    SO(regex=r"[0-9]{3}-[a-z]{2,4}"),
    SO(choice=["alpha", "beta", "gamma delta"]),
    SO(grammar=GRAMMAR),
    SO(json=SCHEMA, disable_any_whitespace=True),
]
PROMPT = [(7 * i + 3) % 5000 + 100 for i in range(22)]


def check_output(engine: LLMEngine, spec: SO, out) -> None:  # noqa: ANN001
    text = out.text
    assert out.finish_reason == "stop", (text, out.finish_reason)
    assert replay(engine, spec, out)
    if spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    elif spec.grammar is not None:
        assert re.fullmatch(GRAMMAR_RE, text), text
    else:
        jsonschema.validate(json.loads(text), SCHEMA)


CONFIGS = {
    "plain": ({}, dict(temperature=1.0)),
    "n3-top-p": ({}, dict(temperature=0.9, top_p=0.95, n=3)),
    "prefix-cache": ({"enable_prefix_caching": True}, dict(temperature=1.0, n=2)),
    "preemption": ({"num_kv_blocks": 24}, dict(temperature=1.0, n=2)),
    "chunked-prefill": ({"max_num_batched_tokens": 8}, dict(temperature=0.7)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sampled_tokens_always_allowed_and_outputs_match(name: str) -> None:
    options, sampling = CONFIGS[name]
    engine = tiny_engine(**options)
    spy = MaskSpy(engine)
    prompts = [PROMPT + [k] for k in range(len(SPECS))] * 2  # the same prefixes twice
    params = [SamplingParams(max_tokens=64, seed=i, structured_outputs=SPECS[i % len(SPECS)],
                             **sampling) for i in range(len(prompts))]
    outs = LLM.from_engine(engine).generate(prompts, params)
    for i, out in enumerate(outs):
        assert len(out.outputs) == sampling.get("n", 1)
        for completion in out.outputs:
            check_output(engine, SPECS[i % len(SPECS)], completion)
    assert not spy.errors, spy.errors[:5]
    assert spy.checked >= sum(len(c.token_ids) for o in outs for c in o.outputs)
    spy.assert_matchers_in_step()
    if name == "preemption":
        assert engine.stats.num_preemptions > 0
    if name == "prefix-cache":
        assert engine.block_manager.prefix_hits > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_eos_only_when_the_grammar_accepts() -> None:
    engine = tiny_engine()
    spy = MaskSpy(engine)
    spec = SO(regex=r"[0-9]{3,}")
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, n=8,
                            structured_outputs=spec)
    out = LLM.from_engine(engine).generate([PROMPT], params)[0]
    eos = engine.eos_token_ids
    stopped = [c for c in out.outputs if c.finish_reason == "stop"]
    assert stopped, "some sequence should sample EOS (11 allowed tokens, EOS among them)"
    for c in out.outputs:
        assert c.token_ids.count(eos[0]) <= 1
        assert re.fullmatch(r"[0-9]*", c.text)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in eos and len(c.text) >= 3
            assert replay(engine, spec, c)
    assert not spy.errors and spy.eos_allowed > 0


def test_max_tokens_mid_grammar_is_length() -> None:
    engine = tiny_engine()
    spec = SO(regex=r"[a-z]{40}")
    out = LLM.from_engine(engine).generate(
        [PROMPT], SamplingParams(temperature=1.0, max_tokens=5, seed=0,
                                 structured_outputs=spec))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert re.fullmatch(r"[a-z]{1,40}", out.text)
    assert not replay(engine, spec, out)  # not complete


def test_grammar_complete_on_the_last_allowed_token_is_stop() -> None:
    engine = tiny_engine()
    out = LLM.from_engine(engine).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=SO(
            choice=["a"])))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("a", "stop", None)


def test_stream_equals_generate_with_grammar_stops() -> None:
    llm = LLM.from_engine(tiny_engine())
    for i, spec in enumerate(SPECS):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=spec)
        full = llm.generate([PROMPT], params)[0].outputs[0]
        assert "".join(llm.stream(PROMPT, params)) == full.text
        check_output(llm.engine, spec, full)


def test_constrained_rows_are_row_local() -> None:
    """A greedy constrained request yields the same tokens alone and in a mixed batch."""
    engine = tiny_engine()
    llm = LLM.from_engine(engine)
    target = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True))
    alone = llm.generate([PROMPT], target)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=30,
                             structured_outputs=SPECS[i % 3] if i % 2 else None)
              for i in range(5)]
    outs = llm.generate([PROMPT[:10] + [i] for i in range(5)] + [PROMPT], others + [target])
    assert outs[-1].outputs[0].token_ids == alone


def test_vocab_wider_than_the_tokenizer_never_samples_the_extra_ids() -> None:
    engine = tiny_engine(vocab=TOKENIZER_VOCAB + 64)
    spy = MaskSpy(engine)
    outs = LLM.from_engine(engine).generate(
        [PROMPT] * len(SPECS), [SamplingParams(temperature=1.0, seed=i, max_tokens=64,
                                               structured_outputs=s)
                                for i, s in enumerate(SPECS)])
    for spec, out in zip(SPECS, outs, strict=True):
        check_output(engine, spec, out.outputs[0])
    assert spy.checked and not spy.errors


def test_matcher_error_fails_that_request_alone() -> None:
    engine = tiny_engine()
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SPECS[0])
    engine.add_request("good", PROMPT, params)
    engine.add_request("bad", PROMPT, params)
    engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=6))
    bad = engine.scheduler.requests["bad"]
    assert not bad.grammar.ll.consume_token(81)  # "a" cannot start [0-9]{3}: error state
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert "structured output" in finals["bad"].error
    assert finals["good"].outputs[0].finish_reason == "stop"
    assert re.fullmatch(SPECS[0].regex, finals["good"].outputs[0].text)
    assert finals["free"].outputs[0].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_token_the_grammar_refuses_fails_that_request_alone() -> None:
    """If a row's token escapes its mask (here: the mask is dropped), advancing the matcher
    fails and only that request ends with "error"."""
    engine = tiny_engine()
    finish = engine.structured.finish

    def unmask_bad(job, failed):  # noqa: ANN001, ANN202
        masks = finish(job, failed)
        for req, row in masks.row_of.items():
            if req.request_id == "bad":
                masks.allowed[row] = True
        return masks

    engine.structured.finish = unmask_bad  # type: ignore[method-assign]
    digits = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SPECS[0])
    outs = {}
    for rid in ("good", "bad"):
        engine.add_request(rid, PROMPT, digits)
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert "structured output" in outs["bad"].error
    assert outs["good"].outputs[0].finish_reason == "stop"


def test_unconstrained_steps_compute_no_masks() -> None:
    engine = tiny_engine()

    def boom(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("masks computed for an unconstrained step")

    engine.structured.finish = boom  # type: ignore[method-assign]
    engine.structured.advance = boom  # type: ignore[method-assign]
    out = LLM.from_engine(engine).generate([PROMPT], SamplingParams(max_tokens=8,
                                                                    logit_bias={5: 1.0}))
    assert len(out[0].outputs[0].token_ids) >= 1


def test_grammar_and_allowed_token_ids_with_nothing_in_common_fail_alone() -> None:
    engine = tiny_engine()
    outs = LLM.from_engine(engine).generate([PROMPT, PROMPT], [
        SamplingParams(max_tokens=8, structured_outputs=SPECS[0], allowed_token_ids=[81]),
        SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[81, 82])])
    assert outs[0].outputs[0].finish_reason == "error"
    assert "no token can be sampled" in outs[0].error
    assert set(outs[1].outputs[0].token_ids) <= {81, 82}


def test_mask_bits_fit_the_model_vocabulary() -> None:
    cpu = torch.device("cpu")
    bits = np.array([[1 << 5, 1 << 1], [-1, -1]], dtype=np.int32)  # tokens 5, 33; all
    narrow = MaskBuilder(ll_vocab_size=40, vocab_size=36, num_threads=1).to_allowed(bits, cpu)
    assert narrow.shape == (2, 36) and narrow.dtype == torch.bool
    assert narrow[0].nonzero().flatten().tolist() == [5, 33] and bool(narrow[1].all())
    wide = MaskBuilder(ll_vocab_size=40, vocab_size=70, num_threads=1).to_allowed(bits, cpu)
    assert wide.shape == (2, 70)
    assert wide[1].nonzero().flatten().tolist() == list(range(40))  # none past the tokenizer
