"""Structured outputs are validated before queueing: StructuredOutputsParams alone (kind,
types, sizes), then the engine's compiler (schema / regex / grammar against llguidance)
raising InvalidRequestError(param="structured_outputs"); compiled grammars are cached."""

from __future__ import annotations

import time

import pytest

from roseinfer.engine.structured import GrammarCompiler
from roseinfer.engine.validation import InvalidRequestError
from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams
from roseinfer.structured_outputs import MAX_CHOICES, MAX_REGEX_CHARS, MAX_SCHEMA_CHARS
from roseinfer.structured_outputs import StructuredOutputsParams as SO
from tests.engine.structured_helpers import real_tokenizer, tiny_engine
from tests.engine.tiny_models import engine_from_hf, tiny_hf_llama

PROMPT = [100, 200, 300, 400]


@pytest.fixture(scope="module")
def engine():  # noqa: ANN201
    return tiny_engine()


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"regex": ""}, "regex"),
    ({"regex": 5}, "regex"),
    ({"regex": "a" * (MAX_REGEX_CHARS + 1)}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": "abc"}, "choice"),
    ({"choice": ["a", ""]}, "choice"),
    ({"choice": ["a"] * (MAX_CHOICES + 1)}, "choice"),
    ({"json": "[1, 2]"}, "json"),
    ({"json": "{not json"}, "json"),
    ({"json": '{"maximum": NaN}'}, "json"),
    ({"json": {"maximum": float("inf")}}, "json"),
    ({"json": {"enum": ["x" * MAX_SCHEMA_CHARS]}}, "json"),
    ({"json": {"default": object()}}, "json"),
    ({"json_object": False, "regex": None}, "exactly one"),
    ({"grammar": 3}, "grammar"),
    ({"json": {}, "disable_any_whitespace": "yes"}, "disable_any_whitespace"),
])
def test_params_refused_alone(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SO(**kwargs)


def test_params_key_is_canonical() -> None:
    a = SO(json={"type": "object", "properties": {"a": {"type": "string"}}})
    b = SO(json='{"type": "object",\n "properties": {"a": {"type": "string"}}}')
    assert a == b and hash(a) == hash(b) and a.key[0] == "json"
    assert SO(json={"type": "object"}) != SO(json={"type": "object"}, disable_any_whitespace=True)
    assert SO(choice=["x", "y"]).choice == ("x", "y")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    hash(SamplingParams(structured_outputs=a, logit_bias={1: 2.0}, allowed_token_ids=[1]))


@pytest.mark.parametrize("spec, match", [
    (SO(regex="a(b"), "regex"),
    (SO(regex="[z-a]"), "regex"),
    (SO(grammar="start: foo"), "grammar"),
    (SO(grammar="start: ("), "grammar"),
    (SO(grammar="root ::= undefined_rule"), "grammar"),
    (SO(json={"type": "foo"}), "json"),
    (SO(json={"type": "string", "format": "no-such-format"}), "json"),
    (SO(json={"not": {"type": "string"}}), "Unimplemented"),  # unsupported features
    (SO(json={"type": "array", "uniqueItems": True}), "Unimplemented"),
    (SO(json={"type": "string", "pattern": "(?=a)b"}), "look-around"),
    (SO(json={"$ref": "#/$defs/missing"}), "json"),
    (SO(json={"type": "integer", "minimum": 5, "maximum": 1}), "json"),
    (SO(regex="a\ud800"), "regex"),  # a lone surrogate: not UTF-8
    (SO(json={"enum": ["\ud800"]}), "json"),
    (SO(regex="(a{1000}){1000}"), "regex cannot be run: lexer error"),  # compile, then fail
    (SO(grammar='start: "x"{1000000}'), "grammar cannot be run: parser error"),
    (SO(grammar='start: X\nX: "x"{1000000}'), "grammar cannot be run: lexer error"),
])
def test_invalid_spec_refused_before_queueing(engine, spec: SO, match: str) -> None:  # noqa: ANN001
    params = SamplingParams(max_tokens=4, structured_outputs=spec)
    with pytest.raises(InvalidRequestError, match=match) as err:
        engine.validator.check_params(params)
    assert err.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError) as err:  # the offline API: nothing is queued
        LLM.from_engine(engine).generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2),
                                                            params])
    assert err.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    with pytest.raises(InvalidRequestError):
        engine.add_request("x", PROMPT, params)
    assert not engine.has_unfinished_requests()


def test_unrunnable_grammar_is_a_cached_value_error_in_bounded_time() -> None:
    """Grammars that compile but that llguidance cannot run (lexer fuel, Earley items) are
    found by the first-step probe (the offline API's refusal is in the cases above),
    bounded by the parser limits (~1 s measured; generous bound for shared cores),
    cached like compile errors; the probe leaves the prototype of a good grammar fresh."""
    compiler = GrammarCompiler(real_tokenizer(), (2,))
    compiler.ll_tokenizer()
    bad = SO(regex="(a{1000}){1000}")
    start = time.perf_counter()
    with pytest.raises(ValueError, match="cannot be run"):
        compiler.compile(bad)
    assert time.perf_counter() - start < 20
    with pytest.raises(ValueError, match="cannot be run"):
        compiler.compile(bad)
    assert compiler.cache.hits == 1
    good = compiler.compile(SO(regex="ab"))
    m = good.new_matcher()
    assert m.accept(real_tokenizer().encode("ab", add_special_tokens=False)[0]) is None


def test_grammar_kinds_that_compile(engine) -> None:  # noqa: ANN001
    for spec in [SO(json_object=True), SO(regex=r"\d+"), SO(choice=["é", 'a "quoted" one']),
                 SO(grammar='root ::= "x" [0-9]+'), SO(json={"anyOf": [{"type": "null"},
                                                                    {"type": "integer"}]})]:
        engine.validator.check_params(SamplingParams(structured_outputs=spec))


def test_engine_without_tokenizer_refuses_structured_outputs() -> None:
    engine = engine_from_hf(tiny_hf_llama())
    with pytest.raises(InvalidRequestError, match="tokenizer") as err:
        engine.add_request("a", [5, 6], SamplingParams(structured_outputs=SO(regex="a")))
    assert err.value.param == "structured_outputs"


def test_compiled_grammars_are_cached_in_a_bounded_lru() -> None:
    compiler = GrammarCompiler(real_tokenizer(), (2,), cache_size=2)
    first = compiler.compile(SO(regex="[0-9]+"))
    assert compiler.compile(SO(regex="[0-9]+")) is first and compiler.cache.hits == 1
    with pytest.raises(ValueError, match="regex"):
        compiler.compile(SO(regex="("))
    with pytest.raises(ValueError, match="regex"):  # the error is cached too
        compiler.compile(SO(regex="("))
    assert compiler.cache.hits == 2
    compiler.compile(SO(regex="[a-z]+"))
    assert len(compiler.cache) == 2
    assert compiler.compile(SO(regex="[0-9]+")) is not first  # evicted, compiled again
    m1, m2 = first.new_matcher(), first.new_matcher()
    assert m1.accept(33) is None and m2.ll.is_accepting() is False  # independent states
