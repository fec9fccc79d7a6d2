"""Structured outputs, logit_bias and allowed_token_ids over HTTP, through a real uvicorn
over a tiny random model with the real tokenizer: its outputs are random, so every one
of them must satisfy its constraint (``response_format`` json_schema / json_object,
vLLM's ``structured_outputs`` regex / choice / grammar); stream == non-stream; bad
constraints and fields the server cannot honour are a 400 naming the field before
anything is queued; the official ``openai`` client works with them as it is."""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer.model.loader import default_model_path
from roseinfer.tokenizer import Tokenizer
from tests.server.helpers import TinyServer, wait_until
from tests.server.tokenizer_server import MODEL_NAME, VOCAB_SIZE

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Reply in the format asked."}]
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"},
                   "tag": {"enum": ["red", "green"]},
                   "name": {"type": "string", "maxLength": 5}},
    "required": ["id", "ok", "tag", "name"], "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema",
               "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
GRAMMAR_RE = r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


@functools.cache
def no_whitespace() -> dict[str, int]:
    """logit_bias banning the whitespace-only tokens: a random model otherwise spends
    most of its tokens on the whitespace JSON allows between tokens."""
    tok = tokenizer()
    out = {}
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        if text and not text.strip():
            out[str(i)] = -100
    return out


def token_id(text: str) -> int:
    ids = tokenizer().encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]



def post(ts: TinyServer, path: str, **body: Any) -> httpx.Response:
    return httpx.post(ts.url + path, json={"model": MODEL_NAME, **body}, timeout=120)


def ok(ts: TinyServer, path: str, **body: Any) -> dict[str, Any]:
    r = post(ts, path, **body)
    assert r.status_code == 200, r.text
    return r.json()


def texts(out: dict[str, Any]) -> list[tuple[str, str]]:
    """(text, finish_reason) of every choice of a chat or completions response."""
    return [(c["message"]["content"] if "message" in c else c["text"], c["finish_reason"])
            for c in out["choices"]]


def streamed(ts: TinyServer, path: str, **body: Any) -> list[tuple[str, str]]:
    """The same, assembled from the SSE stream."""
    parts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    with httpx.stream("POST", ts.url + path, timeout=120,
                      json={"model": MODEL_NAME, **body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for c in event["choices"]:
                text = c["delta"].get("content") if "delta" in c else c["text"]
                parts.setdefault(c["index"], []).append(text or "")
                if c["finish_reason"] is not None:
                    finish[c["index"]] = c["finish_reason"]
    return [("".join(parts[i]), finish[i]) for i in sorted(parts)]


def assert_error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    assert err["param"] == param, err
    return err["message"]


# ------------------------------------------------------------- outputs satisfy constraints
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_json_schema_outputs_validate(ts, path: str) -> None:
    prompt = {"messages": MSG} if path == CHAT else {"prompt": "An item:"}
    out = ok(ts, path, **prompt, response_format=JSON_SCHEMA, n=6, temperature=0.8, seed=1,
             max_tokens=120, logit_bias=no_whitespace())
    results = texts(out)
    assert len(results) == 6
    for text, finish in results:
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_without_help_completes_or_runs_out_of_length(ts) -> None:
    """With any whitespace allowed, a random model may not finish: "length" (every token
    used) is then the only way an output can fail to be complete JSON."""
    for seed in range(3):
        out = ok(ts, COMPLETIONS, prompt="An item:", response_format=JSON_SCHEMA,
                 temperature=1.0, seed=seed, max_tokens=40)
        [(text, finish)] = texts(out)
        if finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert finish == "length" and out["usage"]["completion_tokens"] == 40
            assert not text.strip() or text.lstrip().startswith("{")


def test_json_object_outputs_are_objects(ts) -> None:
    out = ok(ts, CHAT, messages=MSG, response_format={"type": "json_object"}, n=8,
             temperature=0.9, seed=1, max_tokens=100, logit_bias=no_whitespace())
    stopped = 0
    for text, finish in texts(out):
        assert text.startswith("{"), text
        if finish == "stop":  # an object's strings are free text: some run out of tokens
            stopped += 1
            assert isinstance(json.loads(text), dict)
        else:
            assert finish == "length"
    assert stopped >= 2


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_regex_choice_and_grammar(ts, path: str) -> None:
    prompt = {"messages": MSG} if path == CHAT else {"prompt": "Answer:"}
    cases = [({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
             ({"choice": CHOICES}, lambda t: t in CHOICES),
             ({"grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t))]
    for spec, check in cases:
        out = ok(ts, path, **prompt, structured_outputs=spec, n=4, temperature=1.0, seed=3,
                 max_tokens=64)
        for text, finish in texts(out):
            assert finish == "stop" and check(text), (spec, text, finish)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_equals_non_stream(ts, path: str) -> None:
    prompt = {"messages": MSG} if path == CHAT else {"prompt": "Answer:"}
    specs = [{"response_format": JSON_SCHEMA, "logit_bias": no_whitespace()},
             {"structured_outputs": {"regex": REGEX}},
             {"structured_outputs": {"choice": CHOICES}, "n": 3},
             {"structured_outputs": {"grammar": GRAMMAR}},
             {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}]
    for spec in specs:
        body = {**prompt, **spec, "temperature": 0.7, "seed": 11, "max_tokens": 120}
        assert streamed(ts, path, **body) == texts(ok(ts, path, **body)), spec


# ------------------------------------------------------------ logit_bias, allowed ids
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_logit_bias_100_forces_the_token_under_greedy(ts, path: str) -> None:
    prompt = {"messages": MSG} if path == CHAT else {"prompt": "Hello"}
    forced = token_id("zz")
    out = ok(ts, path, **prompt, temperature=0, max_tokens=4, ignore_eos=True,
             logit_bias={str(forced): 100})
    assert texts(out) == [("zz" * 4, "length")]
    plain = ok(ts, path, **prompt, temperature=0, max_tokens=4, ignore_eos=True)
    assert texts(plain) != texts(out)


def test_logit_bias_minus_100_bans_a_token(ts) -> None:
    x, y = token_id("x"), token_id("y")
    out = ok(ts, COMPLETIONS, prompt="Hello", temperature=1.0, seed=0, n=3, max_tokens=6,
             allowed_token_ids=[x, y], logit_bias={str(x): -100})
    assert texts(out) == [("y" * 6, "length")] * 3


def test_allowed_token_ids_restrict_the_output(ts) -> None:
    allowed = {token_id(t): t for t in ("x", "y", "z")}
    out = ok(ts, COMPLETIONS, prompt="Hello", temperature=1.0, seed=0, n=4, max_tokens=12,
             allowed_token_ids=list(allowed), logprobs=0)
    for c in out["choices"]:
        assert c["finish_reason"] == "length"  # EOS is not allowed
        assert c["logprobs"]["tokens"] and set(c["logprobs"]["tokens"]) <= set(allowed.values())
        assert re.fullmatch(r"[xyz]{12}", c["text"]), c["text"]


def test_allowed_token_ids_with_a_grammar(ts) -> None:
    digits = [token_id(str(d)) for d in range(10)] + list(ts.engine.eos_token_ids)
    out = ok(ts, CHAT, messages=MSG, temperature=1.0, seed=5, n=3, max_tokens=20,
             allowed_token_ids=digits, structured_outputs={"regex": "[0-9]{2,5}"})
    for text, finish in texts(out):
        assert finish == "stop" and re.fullmatch("[0-9]{2,5}", text), text


# ----------------------------------------------------------------------------- 400s
ERROR_CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "bad-schema": (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
    "schema-not-an-object": (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": "{}"}}}, "response_format.json_schema.schema"),
    "json-schema-missing": (CHAT, {"response_format": {"type": "json_schema"}},
                            "response_format"),
    "json-schema-without-schema": (CHAT, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema"),
    "json-schema-without-name": (CHAT, {"response_format": {
        "type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format.json_schema.name"),
    "unknown-response-format": (CHAT, {"response_format": {"type": "structural_tag"}},
                                "response_format.type"),
    "unknown-response-format-field": (COMPLETIONS, {"response_format": {
        "type": "json_object", "schema": SCHEMA}}, "response_format.schema"),
    "invalid-regex": (COMPLETIONS, {"structured_outputs": {"regex": "(["}},
                      "structured_outputs"),
    "bad-grammar": (COMPLETIONS, {"structured_outputs": {"grammar": "start: ((("}},
                    "structured_outputs"),
    # compile, but llguidance cannot run them (the first-step probe finds it)
    "unrunnable-regex": (COMPLETIONS, {"structured_outputs": {"regex": "(a{1000}){1000}"}},
                         "structured_outputs"),
    "unrunnable-grammar": (CHAT, {"structured_outputs": {"grammar": 'start: "x"{1000000}'}},
                           "structured_outputs"),
    "bad-json-text": (COMPLETIONS, {"structured_outputs": {"json": "{not json"}},
                      "structured_outputs"),
    "two-kinds": (COMPLETIONS, {"structured_outputs": {"regex": "a", "choice": ["a"]}},
                  "structured_outputs"),
    "no-kind": (COMPLETIONS, {"structured_outputs": {}}, "structured_outputs"),
    "empty-choice": (COMPLETIONS, {"structured_outputs": {"choice": []}}, "structured_outputs"),
    "unknown-structured-field": (COMPLETIONS, {"structured_outputs": {"backend": "xgrammar"}},
                                 "structured_outputs.backend"),
    "both": (CHAT, {"response_format": {"type": "json_object"},
                    "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    "bias-out-of-vocab": (CHAT, {"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias"),
    "bias-non-int-key": (COMPLETIONS, {"logit_bias": {"abc": 1}}, "logit_bias"),
    "bias-negative-key": (COMPLETIONS, {"logit_bias": {"-1": 1}}, "logit_bias"),
    "bias-101": (COMPLETIONS, {"logit_bias": {"42": 101}}, "logit_bias.42"),
    "bias-string-value": (CHAT, {"logit_bias": {"42": "5"}}, "logit_bias.42"),
    "bias-not-a-dict": (CHAT, {"logit_bias": [42]}, "logit_bias"),
    "allowed-out-of-vocab": (COMPLETIONS, {"allowed_token_ids": [1, VOCAB_SIZE]},
                             "allowed_token_ids"),
    "allowed-empty": (COMPLETIONS, {"allowed_token_ids": []}, "allowed_token_ids"),
    "tools": (CHAT, {"tools": [{"type": "function", "function": {"name": "f",
                                                                  "parameters": {"type": 1}}}]},
              "tools"),
    "tool-choice-required": (CHAT, {"tool_choice": "required"}, "tool_choice"),
    "tool-choice-auto": (CHAT, {"tool_choice": "auto"}, "tool_choice"),
    "tool-choice-function": (CHAT, {"tool_choice": {"type": "function",
                                                    "function": {"name": "f"}}}, "tool_choice"),
    "functions": (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    "function-call": (CHAT, {"function_call": "auto"}, "function_call"),
    "audio": (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    "modalities-audio": (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    "modalities-empty": (CHAT, {"modalities": []}, "modalities"),
    "prediction": (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    "reasoning-effort": (CHAT, {"reasoning_effort": "high"}, "reasoning_effort"),
    "verbosity": (CHAT, {"verbosity": "low"}, "verbosity"),
    "web-search": (CHAT, {"web_search_options": {}}, "web_search_options"),
    "moderation": (CHAT, {"moderation": {"model": "m"}}, "moderation"),
    "message-tool-calls": (CHAT, {"messages": [{"role": "assistant", "content": None,
                                                "tool_calls": [{"id": "1"}]}]},
                           "messages.0.tool_calls"),
    "message-unknown-field": (CHAT, {"messages": [{"role": "user", "content": "x",
                                                   "weight": 1}]}, "messages.0.weight"),
    "best-of": (COMPLETIONS, {"best_of": 3}, "best_of"),
    "suffix": (COMPLETIONS, {"suffix": "end"}, "suffix"),
    "unknown-field": (CHAT, {"frobnicate": True}, "frobnicate"),
    "unknown-completions-field": (COMPLETIONS, {"guided_json": SCHEMA}, "guided_json"),
    "unknown-stream-option": (CHAT, {"stream_options": {"include_everything": True}},
                              "stream_options.include_everything"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_refused_before_anything_is_queued(ts, case: str) -> None:
    path, extra, param = ERROR_CASES[case]
    body = {"messages": MSG} if path == CHAT else {"prompt": "Hi"}
    body = {**body, "max_tokens": 4, **extra}
    ts.gate.close()  # the engine thread would block in step(): nothing may reach it
    try:
        message = assert_error(post(ts, path, **body), param)
        assert not ts.gate.entered.is_set() and not ts.engine.has_unfinished_requests()
    finally:
        ts.gate.open()
    if case.startswith("unknown-field"):
        assert message == "Unrecognized request argument supplied: frobnicate"


RAW_CASES = {  # bodies json.dumps cannot write: @M is replaced by the raw text
    "bias-nan": ({"logit_bias": {"42": "@M"}}, "NaN", "logit_bias.42"),
    "schema-nan": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"maximum": "@M"}}}}, "NaN", "response_format"),
    "schema-overflow": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"maximum": "@M"}}}}, "1e999", "response_format"),
    "schema-surrogate": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"const": "@M"}}}}, '"\\ud800"', "response_format"),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_non_finite_numbers_and_lone_surrogates_are_refused(ts, case: str) -> None:
    extra, literal, param = RAW_CASES[case]
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, **extra})
    r = httpx.post(ts.url + COMPLETIONS, content=body.replace('"@M"', literal).encode(),
                   timeout=60, headers={"content-type": "application/json"})
    message = assert_error(r, param)
    assert ("surrogate" if "surrogate" in case else "finite" if "bias" in case
            else "response_format.json_schema.schema") in message


def test_labels_and_neutral_values_are_accepted(ts) -> None:
    labels = {"store": True, "metadata": {"team": "a"}, "service_tier": "auto", "user": "u1",
              "safety_identifier": "s", "prompt_cache_key": "k",
              "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
              "parallel_tool_calls": False, "tools": [], "tool_choice": "none",
              "functions": [], "function_call": "none", "modalities": ["text"],
              "reasoning_effort": "none", "response_format": {"type": "text"},
              "stream_options": {"include_usage": True, "include_obfuscation": False},
              "audio": None, "prediction": None}
    message = {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    out = ok(ts, CHAT, messages=[*MSG, message], max_tokens=3, **labels)
    assert len(out["choices"]) == 1
    out = streamed(ts, COMPLETIONS, prompt="Hi", max_tokens=3, n=2, best_of=2, user="u",
                   response_format={"type": "text"})
    assert len(out) == 2


# ------------------------------------------------------------------------ fuzzing
# Characters some token can produce: this vocabulary has no token for the control bytes
# below nor for the UTF-8 lead bytes 0xF1-0xF2 (U+40000-U+BFFFF), and a grammar that
# needs one fails its request in the engine (500 request_failed), not before queueing.
CHARS = st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",),
                      exclude_characters="\x04\x06\x13\x14\x16\x1d")
TEXT = st.text(CHARS, max_size=10)
WORD = st.text(CHARS, min_size=1, max_size=8)
JUNK = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(),
                              TEXT),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(TEXT, inner, max_size=3)),
                    max_leaves=6)
SCHEMAS = st.one_of(st.just(SCHEMA), st.just({"type": "integer"}), st.just({"enum": ["a", 1]}),
                    st.dictionaries(st.sampled_from(["type", "enum", "maxLength", "items",
                                                     "properties", "pattern"]), JUNK,
                                    max_size=3))
KINDS = st.one_of(
    st.fixed_dictionaries({"regex": st.one_of(st.sampled_from([REGEX, "a|b", "[0-9]+", "(["]),
                                              TEXT)}),
    st.fixed_dictionaries({"choice": st.lists(WORD, min_size=1, max_size=4)}),
    st.fixed_dictionaries({"grammar": st.one_of(st.just(GRAMMAR), TEXT)}),
    st.fixed_dictionaries({"json": st.one_of(SCHEMAS, SCHEMAS.map(json.dumps))},
                          optional={"disable_any_whitespace": st.booleans()}),
    st.fixed_dictionaries({"json_object": st.booleans()}),
    st.dictionaries(st.sampled_from(["regex", "choice", "json", "grammar", "x"]), JUNK,
                    max_size=2))
FORMATS = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": WORD, "schema": SCHEMAS}, optional={"strict": st.booleans()})}),
    JUNK)
TOKEN = st.one_of(st.integers(0, VOCAB_SIZE - 1), st.sampled_from([-1, VOCAB_SIZE, 2**63]))
CONSTRAINTS = st.fixed_dictionaries({}, optional={
    "response_format": FORMATS, "structured_outputs": st.one_of(KINDS, JUNK),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(TOKEN.map(str), TEXT),
                                            st.one_of(st.integers(-101, 101), st.floats()),
                                            max_size=4), JUNK),
    "allowed_token_ids": st.one_of(st.lists(TOKEN, max_size=4), JUNK),
    "stream": st.booleans(), "n": st.integers(1, 3), "temperature": st.floats(0, 1.5)})


def test_fuzz_constraint_fields(ts) -> None:
    """Valid and junk constraints: never a 5xx, every 400 the OpenAI body, every 200
    well-formed (streams end in [DONE] without an error event), the pool whole after.
    The one failure allowed is the engine's for a row with every token masked (allowed
    ids disjoint from what the grammar allows next): that request alone fails."""

    def masked_out(extra: dict[str, Any], error: dict[str, Any]) -> bool:
        return ("allowed_token_ids" in extra and error.get("code") == "request_failed"
                and "every token is masked" in error["message"])

    @settings(max_examples=int(os.environ.get("ROSEINFER_FUZZ_EXAMPLES", "60")), deadline=None,
              derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from([CHAT, COMPLETIONS]), CONSTRAINTS)
    def run(path: str, extra: dict[str, Any]) -> None:
        body = {"messages": MSG} if path == CHAT else {"prompt": "Hi"}
        raw = json.dumps({"model": MODEL_NAME, **body, "max_tokens": 6, **extra},
                         allow_nan=True).encode()
        r = httpx.post(ts.url + path, content=raw, timeout=120,
                       headers={"content-type": "application/json"})
        where = (raw, r.status_code, r.text[-1000:])
        if r.status_code != 200:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, where
            assert r.status_code == 400 or masked_out(extra, error), where
        elif extra.get("stream"):
            events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
            assert events[-1] == "[DONE]", where
            errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
            assert all(masked_out(extra, e) for e in errors), where
        else:
            assert r.json()["choices"], where

    run()
    bm = ts.engine.block_manager
    assert wait_until(lambda: not ts.engine.has_unfinished_requests()
                      and bm.num_free_blocks == bm.num_blocks, 10.0)
