"""Property-based fuzzing of every endpoint through a real uvicorn (tiny model, real tokenizer).

Bodies are sent as RAW bytes, so JSON's NaN/Infinity literals, invalid UTF-8, lone
surrogates, wrong types, huge and negative ints, unknown fields and truncated JSON
all reach the server. Most bodies are valid with one or two fields perturbed (they
generate a few tokens: streams, n, logprobs, echo, stop strings, stop ids, seeds...),
the rest is garbage. Whatever comes in: no 5xx, every 4xx is exactly the OpenAI error
body, a 200 stream is well-formed SSE ending in ``[DONE]`` with no error event, and
afterwards the server is healthy with every KV block free.

``ROSEINFER_FUZZ_EXAMPLES`` sets the examples per fuzz test (default 100: four tests of
one body each, plus a quarter as many batches of 2-6 concurrent bodies), besides a fixed
sweep of edge values over every numeric field: ~1300 bodies in all (a deeper run:
``ROSEINFER_FUZZ_EXAMPLES=1000``; the default keeps the suite in its time budget). The examples are
derandomized, so a given source tree always gets the same bodies (Hypothesis also mixes in
constants it finds in the project's loaded modules: editing the code can change them).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.server.helpers import TinyServer, wait_until
from tests.server.tokenizer_server import MODEL_NAME, VOCAB_SIZE, tokenizer_server

pytestmark = pytest.mark.slow  # default model or real servers: `make test-fast` skips it

EXAMPLES = int(os.environ.get("ROSEINFER_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
JSON_HEADERS = {"content-type": "application/json"}

# ------------------------------------------------------------------ leaf values
SPECIAL_TEXT = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", " ",
                                "😀", "é", "\x00", "{{", "{% if %}", "\\u0000", "<think>"])
LONE_SURROGATE = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
TEXT = st.one_of(st.text(max_size=24),
                 st.lists(st.one_of(st.text(max_size=6), SPECIAL_TEXT), max_size=5).map("".join))
WORDS = TEXT.filter(bool)  # mostly-valid bodies: a prompt or stop string is never empty
BAD_TEXT = st.tuples(TEXT, LONE_SURROGATE, TEXT).map("".join)
ANY_TEXT = st.one_of(TEXT, TEXT, TEXT, BAD_TEXT)
EDGE_INTS = st.sampled_from([-1, 0, 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -10**30,
                             VOCAB_SIZE - 1, VOCAB_SIZE])
EDGE_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324, 1e-300])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 70), EDGE_INTS,
                    st.floats(allow_nan=True, allow_infinity=True), EDGE_FLOATS, ANY_TEXT)
EDGE_NUMBERS = st.one_of(EDGE_INTS, EDGE_FLOATS, st.floats(-1e-300, 1e-300),
                        st.integers(-(2**70), 2**70))
JUNK = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(ANY_TEXT, inner, max_size=4)), max_leaves=8)
TOKEN_ID = st.one_of(*[st.integers(0, VOCAB_SIZE - 1)] * 9, EDGE_INTS)
UNIT = st.floats(0, 1)


def maybe(**fields: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


# ----------------------------------------------------------- mostly-valid bodies
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
     "content": st.one_of(TEXT, TEXT, st.none(), st.lists(
         st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3))},
    optional={"name": TEXT})
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=3)
SAMPLING = maybe(
    model=st.sampled_from([MODEL_NAME, "", None]),
    temperature=st.one_of(st.sampled_from([0, 0.0, 1, 2]), st.floats(0, 2)),
    top_p=st.one_of(st.just(1), st.floats(0.01, 1)), top_k=st.one_of(
        st.integers(-1, 60), st.just(10**6)), min_p=UNIT,
    presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.1, 3), n=st.one_of(*[st.integers(1, 3)] * 3, st.integers(1, 64)),
    seed=st.one_of(st.integers(0, 2**63 - 1), st.integers(0, 99)),
    stop=st.one_of(WORDS, st.lists(WORDS, max_size=4)), stop_token_ids=st.lists(TOKEN_ID,
                                                                                  max_size=4),
    min_tokens=st.integers(0, 4), ignore_eos=st.booleans(), skip_special_tokens=st.booleans(),
    include_stop_str_in_output=st.booleans(), stream=st.booleans(),
    stream_options=st.fixed_dictionaries({"include_usage": st.booleans()}), user=TEXT)
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature",
               "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "min_tokens",
               "logprobs", "top_logprobs", "stream", "stream_options", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "ignore_eos", "user")
CHAT_BODY = st.tuples(
    st.fixed_dictionaries({"messages": MESSAGES, "max_tokens": st.integers(1, 4)}), SAMPLING,
    maybe(max_completion_tokens=st.integers(1, 4)),
    st.one_of(maybe(logprobs=st.booleans()),
              st.fixed_dictionaries({"logprobs": st.just(True),
                                     "top_logprobs": st.integers(0, 20)})),
).map(lambda parts: {k: v for part in parts for k, v in part.items()})
PROMPT = st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=3),
                   st.lists(TOKEN_ID, min_size=1, max_size=8),
                   st.lists(st.lists(TOKEN_ID, min_size=1, max_size=6), min_size=1, max_size=3))
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "echo", "logprobs", "suffix", "n",
                     "stream", "stop", "stop_token_ids", "min_tokens", "seed", "temperature",
                     "top_k", "top_p", "stream_options")
COMPLETION_BODY = st.tuples(
    st.fixed_dictionaries({"prompt": PROMPT, "max_tokens": st.integers(1, 4)}), SAMPLING,
    maybe(echo=st.booleans(), logprobs=st.one_of(st.none(), st.integers(0, 5))),
).map(lambda parts: {k: v for part in parts for k, v in part.items()})
GENERATE_FIELDS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "stop_on_eos",
                   "do_sample", "stream")
GENERATE_BODY = st.tuples(
    st.fixed_dictionaries({"prompt": st.one_of(WORDS, st.lists(TOKEN_ID, min_size=1,
                                                              max_size=8)),
                           "max_new_tokens": st.integers(1, 4)}),
    maybe(temperature=st.floats(0, 2), top_k=st.integers(-1, 60), top_p=st.floats(0.01, 1),
          stop_on_eos=st.booleans(), do_sample=st.booleans(), stream=st.booleans()),
).map(lambda parts: {k: v for part in parts for k, v in part.items()})
TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt")
TOKENIZE_BODY = st.tuples(
    st.one_of(st.fixed_dictionaries({"prompt": TEXT}),
              st.fixed_dictionaries({"messages": MESSAGES})),
    maybe(model=st.sampled_from([MODEL_NAME, None]), add_special_tokens=st.booleans(),
          add_generation_prompt=st.booleans()),
).map(lambda parts: {k: v for part in parts for k, v in part.items()})
DETOKENIZE_BODY = st.fixed_dictionaries({"tokens": st.lists(TOKEN_ID, max_size=8)},
                                        optional={"model": st.sampled_from([MODEL_NAME, None])})


@st.composite
def perturbed(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]],
              fields: tuple[str, ...]) -> dict[str, Any]:
    """A valid body, then 0-2 fields set to junk, deleted, or an unknown field added."""
    body = dict(draw(base))
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
        key = draw(st.one_of(st.sampled_from(fields), st.sampled_from(fields), ANY_TEXT))
        if draw(st.integers(0, 4)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(st.one_of(JUNK, EDGE_NUMBERS))
    return body


@st.composite
def encoded(draw: st.DrawFn, body: Any, mutate_one_in: int = 12) -> bytes:
    """JSON text of ``body`` (NaN/Infinity literals, lone surrogates as escapes or raw
    bytes), now and then truncated or with a stray byte inserted."""
    text = json.dumps(body, allow_nan=True, ensure_ascii=draw(st.booleans()))
    raw = text.encode("utf-8", "surrogatepass")
    mutation = draw(st.integers(0, mutate_one_in))
    if mutation == 1 and raw:
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif mutation == 2:
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00",
                                               b"NaN", b"-Infinity", b"1e999"])) + raw[at:]
    return raw


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    # The chat default length is "what fits" (~1000 tokens): keep the fuzz fast.
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 4
    return body


# ------------------------------------------------------------------------ checks
class Fuzzer:
    def __init__(self, ts: TinyServer) -> None:
        self.ts = ts
        self.client = httpx.Client(base_url=ts.url, timeout=120)
        self.sent = 0

    def send(self, method: str, path: str, raw: bytes | None,
             headers: dict[str, str] | None = JSON_HEADERS) -> httpx.Response:
        self.sent += 1
        r = self.client.request(method, path, content=raw, headers=headers)
        where = f"{method} {path} {raw!r:.2000}"
        assert r.status_code < 500, f"{where}\n-> {r.status_code} {r.text[:2000]}"
        if r.status_code >= 400:
            body = json.loads(r.content.decode("utf-8"))
            assert set(body) == {"error"}, where
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"}, (where, err)
            assert isinstance(err["message"], str) and err["message"], (where, err)
            return r
        assert r.status_code == 200, (where, r.status_code)
        ctype = r.headers.get("content-type", "")
        if ctype.startswith("text/event-stream"):
            self._check_sse(r.content.decode("utf-8"), where)
        elif ctype.startswith("application/json"):
            json.loads(r.content.decode("utf-8"))
        else:
            assert ctype.startswith("text/plain"), (where, ctype)  # /generate's stream
            r.content.decode("utf-8")
        return r

    @staticmethod
    def _check_sse(text: str, where: str) -> None:
        assert text.endswith("\n\n"), where
        events = [e for e in text.split("\n\n") if e]
        assert events and events[-1] == "data: [DONE]", (where, text[-500:])
        for event in events[:-1]:
            assert event.startswith("data: ") and "\n" not in event, (where, event)
            payload = json.loads(event[6:])
            assert "error" not in payload, (where, payload)

    def assert_healthy_and_idle(self) -> None:
        engine = self.ts.engine
        bm = engine.block_manager
        assert wait_until(lambda: not engine.has_unfinished_requests()
                          and bm.num_free_blocks == bm.num_blocks, 10.0), (
            bm.num_free_blocks, bm.num_blocks)
        assert self.client.get("/health").status_code == 200


@pytest.fixture(scope="module")
def fz() -> Iterator[Fuzzer]:
    # Small blocks in a small pool: big n, several prompts and concurrent requests run
    # out of blocks, so preemption (and recompute) happens too.
    with tokenizer_server(block_size=4, num_kv_blocks=64) as ts:
        fuzzer = Fuzzer(ts)
        try:
            yield fuzzer
        finally:
            fuzzer.client.close()


def test_fuzz_chat_completions(fz: Fuzzer) -> None:
    @FUZZ
    @given(st.data())
    def run(data: st.DataObject) -> None:
        body = chat_body(data.draw(perturbed(CHAT_BODY, CHAT_FIELDS)))
        fz.send("POST", CHAT, data.draw(encoded(body)))

    run()
    fz.assert_healthy_and_idle()


def test_fuzz_completions(fz: Fuzzer) -> None:
    @FUZZ
    @given(st.data())
    def run(data: st.DataObject) -> None:
        body = data.draw(perturbed(COMPLETION_BODY, COMPLETION_FIELDS))
        fz.send("POST", COMPLETIONS, data.draw(encoded(body)))

    run()
    fz.assert_healthy_and_idle()


def test_fuzz_generate_tokenize_detokenize(fz: Fuzzer) -> None:
    endpoints = st.sampled_from([("/generate", GENERATE_BODY, GENERATE_FIELDS),
                                 ("/tokenize", TOKENIZE_BODY, TOKENIZE_FIELDS),
                                 ("/detokenize", DETOKENIZE_BODY, ("tokens", "model"))])

    @FUZZ
    @given(st.data())
    def run(data: st.DataObject) -> None:
        path, base, fields = data.draw(endpoints)
        fz.send("POST", path, data.draw(encoded(data.draw(perturbed(base, fields)))))

    run()
    fz.assert_healthy_and_idle()


def test_fuzz_concurrent_mix(fz: Fuzzer) -> None:
    """Several bodies at once, so that requests share steps, blocks and preemptions."""
    one = st.one_of(
        st.tuples(st.just(CHAT), perturbed(CHAT_BODY, CHAT_FIELDS).map(chat_body)),
        st.tuples(st.just(COMPLETIONS), perturbed(COMPLETION_BODY, COMPLETION_FIELDS)))

    # No shrinking: a failing batch is reported as sent (shrinking batches of concurrent
    # requests takes minutes and the failing body is in the message anyway).
    @settings(FUZZ, max_examples=max(1, EXAMPLES // 4),
              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    @given(st.data())
    def run(data: st.DataObject) -> None:
        batch = [(path, data.draw(encoded(body, mutate_one_in=40)))
                 for path, body in data.draw(st.lists(one, min_size=2, max_size=6))]
        with ThreadPoolExecutor(len(batch)) as pool:
            for future in [pool.submit(fz.send, "POST", path, raw) for path, raw in batch]:
                future.result()

    run()
    fz.assert_healthy_and_idle()


PATHS = (CHAT, COMPLETIONS, "/generate", "/tokenize", "/detokenize", "/v1/models", "/health",
         "/metrics", "/v1/nothing", "/")


def test_fuzz_garbage_on_every_endpoint(fz: Fuzzer) -> None:
    content_types = st.sampled_from([JSON_HEADERS, JSON_HEADERS, {}, {"content-type":
                                     "text/plain"}, {"content-type": "application/x+json"}])

    @FUZZ
    @given(st.data())
    def run(data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(PATHS))
        method = data.draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]))
        kind = data.draw(st.integers(0, 3))
        if kind == 0:
            raw = data.draw(st.one_of(st.none(), st.binary(max_size=64)))
        else:
            raw = data.draw(encoded(data.draw(JUNK), mutate_one_in=4))
        fz.send(method, path, raw, data.draw(content_types))

    run()
    fz.assert_healthy_and_idle()


# Every numeric field at every edge, once: floats that underflow float32 (5e-324, 1e-45)
# or overflow it (1e39, 1e308), ints past int32/int64, and each side of every bound.
EDGE_VALUES = (0, -0.0, 5e-324, 1e-300, 1e-45, 1e-30, 0.5, 1, 2, 2.5, 20, 21, 64, 65, 1e30, 1e39,
               1e308, -1, -2.5, 2**31, 2**63 - 1, 2**63, 10**30)
EDGE_FIELDS = {
    CHAT: ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 2, "stream": True},
           ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "n", "seed", "max_tokens", "max_completion_tokens",
            "min_tokens", "top_logprobs", "stop_token_ids")),
    COMPLETIONS: ({"prompt": "Hello there", "max_tokens": 2, "logprobs": 2, "echo": True},
                  ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "n", "seed", "max_tokens",
                   "min_tokens", "logprobs", "stop_token_ids", "prompt")),
    "/generate": ({"prompt": "Hello there", "max_new_tokens": 2},
                  ("temperature", "top_p", "top_k", "max_new_tokens", "prompt")),
    "/detokenize": ({"tokens": [1, 2]}, ("tokens",)),
}
LIST_FIELDS = frozenset({"stop_token_ids", "prompt", "tokens"})  # a one-id list
EDGE_CASES = [(path, field) for path, (_, fields) in EDGE_FIELDS.items() for field in fields]


@pytest.mark.parametrize(("path", "field"), EDGE_CASES,
                         ids=[f"{path}:{field}" for path, field in EDGE_CASES])
def test_edge_values_on_every_numeric_field(fz: Fuzzer, path: str, field: str) -> None:
    base, _ = EDGE_FIELDS[path]
    failures = []
    for value in EDGE_VALUES:
        if field in LIST_FIELDS and not isinstance(value, int):
            continue
        body = {**base, field: [value] if field in LIST_FIELDS else value}
        try:
            fz.send("POST", path, json.dumps(body).encode())
        except AssertionError as exc:
            failures.append(f"{field}={value!r}: {' '.join(str(exc).split())[:400]}")
    assert not failures, "\n".join(failures)
    fz.assert_healthy_and_idle()


def test_fuzz_get_endpoints_and_final_state(fz: Fuzzer) -> None:
    models = fz.send("GET", "/v1/models", None, None).json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert fz.send("GET", "/health", None, None).json() == {"status": "ok"}
    fz.assert_healthy_and_idle()
