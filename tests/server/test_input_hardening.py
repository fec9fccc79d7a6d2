"""Input hardening through a real uvicorn (tiny model, real tokenizer): non-finite floats,
lone surrogates in every text field, error bodies that always encode, bounded list
sizes, and a 413 (or 401) that reaches the client even under load, never a reset."""

from __future__ import annotations

import json
import socket
import threading
import typing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pydantic import BaseModel

from roseinfer.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from roseinfer.server import protocol
from roseinfer.server.errors import APIError, error_body
from roseinfer.server.protocol import MAX_MESSAGES, MAX_PROMPTS_PER_REQUEST
from roseinfer.server.state import ServerSettings
from tests.server.helpers import TinyServer, wait_until
from tests.server.tokenizer_server import MODEL_NAME, tokenizer_server

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 1 << 20
MSG = [{"role": "user", "content": "hi"}]
CHAT = ("/v1/chat/completions", {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2})
COMP = ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2})
GEN = ("/generate", {"prompt": "Hello", "max_new_tokens": 2})
MARK = "@@MARK@@"


@pytest.fixture(scope="module")
def ts() -> Iterator[TinyServer]:
    settings = ServerSettings(served_model_names=(MODEL_NAME,), api_key=KEY,
                              max_body_bytes=MAX_BODY)
    with tokenizer_server(settings) as server:
        yield server


def post_raw(ts: TinyServer, path: str, raw: bytes, timeout: float = 60) -> httpx.Response:
    return httpx.post(ts.url + path, content=raw, timeout=timeout,
                      headers={**AUTH, "content-type": "application/json"})


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = json.loads(r.content.decode("utf-8"))  # strict UTF-8: the body always encodes
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_pool_whole(ts: TinyServer) -> None:
    bm = ts.engine.block_manager
    assert wait_until(lambda: bm.num_free_blocks == bm.num_blocks, 5.0)


# -------------------------------------------------------------- non-finite floats
def _request_models() -> list[type[BaseModel]]:
    return [obj for obj in vars(protocol).values() if isinstance(obj, type)
            and issubclass(obj, BaseModel) and obj.model_config.get("strict")]


def test_every_request_model_refuses_non_finite_floats() -> None:
    models = _request_models()
    assert {m.__name__ for m in models} >= {"ChatCompletionRequest", "CompletionRequest",
                                            "GenerateRequest", "TokenizeRequest",
                                            "DetokenizeRequest", "ChatMessage"}
    float_fields = 0
    for model in models:
        assert model.model_config.get("allow_inf_nan") is False, model
        hints = typing.get_type_hints(model)
        for name in model.model_fields:
            if "float" in str(hints[name]):
                float_fields += 1
    assert float_fields >= 8


FLOAT_CASES = [(*CHAT, f) for f in ("temperature", "top_p", "presence_penalty",
                                    "frequency_penalty", "min_p", "repetition_penalty")]
FLOAT_CASES += [(*COMP, "temperature"), (*COMP, "top_p"), (*COMP, "repetition_penalty"),
                (*GEN, "temperature"), (*GEN, "top_p")]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(("path", "base", "field"), FLOAT_CASES,
                         ids=[f"{p}:{f}" for p, _, f in FLOAT_CASES])
def test_non_finite_float_is_a_400_naming_the_field(ts, path, base, field, literal) -> None:
    raw = json.dumps({**base, field: MARK}).replace(f'"{MARK}"', literal).encode()
    err = assert_error(post_raw(ts, path, raw), 400, field)
    assert "finite" in err["message"]


# ----------------------------------------------------------------- lone surrogates
def _msg(**kw: object) -> list[dict]:
    return [{"role": "user", "content": "hi", **kw}]


SURROGATE_CASES = {
    "chat-model": ("/v1/chat/completions", {**CHAT[1], "model": MARK}, "model"),
    "chat-content": ("/v1/chat/completions", {**CHAT[1], "messages": _msg(content=MARK)},
                     "messages.0.content"),
    "chat-text-part": ("/v1/chat/completions",
                       {**CHAT[1], "messages": _msg(content=[{"type": "text", "text": "a"},
                                                             {"type": "text", "text": MARK}])},
                       "messages.0.content.1.text"),
    "chat-name": ("/v1/chat/completions", {**CHAT[1], "messages": _msg(name=MARK)},
                  "messages.0.name"),
    "chat-stop": ("/v1/chat/completions", {**CHAT[1], "stop": MARK}, "stop"),
    "chat-user": ("/v1/chat/completions", {**CHAT[1], "user": MARK}, "user"),
    "completion-prompt": ("/v1/completions", {**COMP[1], "prompt": MARK}, "prompt"),
    "completion-prompt-list": ("/v1/completions", {**COMP[1], "prompt": ["ok", MARK]},
                               "prompt.1"),
    "completion-stop-list": ("/v1/completions", {**COMP[1], "stop": ["x", MARK]}, "stop.1"),
    "completion-suffix": ("/v1/completions", {**COMP[1], "suffix": MARK}, "suffix"),
    "completion-model": ("/v1/completions", {**COMP[1], "model": MARK}, "model"),
    "generate-prompt": ("/generate", {**GEN[1], "prompt": MARK}, "prompt"),
    "tokenize-prompt": ("/tokenize", {"prompt": MARK}, "prompt"),
    "tokenize-messages": ("/tokenize", {"messages": _msg(content=MARK)}, "messages.0.content"),
    "tokenize-model": ("/tokenize", {"model": MARK, "prompt": "x"}, "model"),
    "detokenize-model": ("/detokenize", {"model": MARK, "tokens": [1]}, "model"),
}
# The same lone surrogate (U+D800) as a JSON escape and as raw CESU-style UTF-8 bytes,
# which json.loads decodes with 'surrogatepass'; also a low one and one inside text.
SURROGATES = {"escape": b"\\ud800", "raw-bytes": b"\xed\xa0\x80", "low-escape": b"\\udfff",
              "inside-text": b"ab\\udc00cd"}


@pytest.mark.parametrize("form", list(SURROGATES))
@pytest.mark.parametrize("case", list(SURROGATE_CASES))
def test_lone_surrogate_is_a_400_naming_the_field(ts, case: str, form: str) -> None:
    path, body, param = SURROGATE_CASES[case]
    raw = json.dumps(body).encode().replace(MARK.encode(), SURROGATES[form])
    err = assert_error(post_raw(ts, path, raw), 400, param)
    assert "Unicode" in err["message"] and "surrogate" in err["message"]


def test_valid_non_ascii_text_still_works(ts) -> None:
    body = {**COMP[1], "prompt": "héllo 😀 \u4e16\u754c", "stop": ["😀"], "max_tokens": 2}
    r = post_raw(ts, "/v1/completions", json.dumps(body).encode())
    assert r.status_code == 200, r.text
    r = post_raw(ts, "/tokenize", json.dumps({"prompt": "😀"}, ensure_ascii=False).encode())
    assert r.status_code == 200 and r.json()["count"] >= 1


def test_error_bodies_escape_what_they_cannot_encode() -> None:
    err = APIError(404, "The model 'a\ud800b' does not exist", param="mo\udfffdel",
                   code="model_not_found")
    response = err.response()
    decoded = json.loads(response.body.decode("utf-8"))["error"]
    assert decoded["message"] == "The model 'a\\ud800b' does not exist"
    assert decoded["param"] == "mo\\udfffdel"
    body = error_body("x\udc80", param=None)
    json.dumps(body, ensure_ascii=False).encode("utf-8")  # never raises
    assert error_body("plain")["error"]["message"] == "plain"


MALFORMED = {
    "empty": (b"", "body is missing"),
    "null": (b"null", "must be a JSON object"),
    "list": (b"[]", "must be a JSON object"),
    "nan": (b"NaN", "must be a JSON object"),
    "invalid-utf8": (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    "truncated": (b'{"prompt": "a', "not valid JSON"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
@pytest.mark.parametrize("path", [CHAT[0], COMP[0], "/generate", "/tokenize", "/detokenize"])
def test_malformed_bodies_are_a_400(ts, path: str, case: str) -> None:
    raw, words = MALFORMED[case]
    err = assert_error(post_raw(ts, path, raw), 400)
    assert words in err["message"], err


# ---------------------------------------------------------------------- bounded sizes
BOUND_CASES = {
    "prompts-per-request": ("/v1/completions",
                            {**COMP[1], "prompt": ["a"] * (MAX_PROMPTS_PER_REQUEST + 1)},
                            "prompt"),
    "token-prompts-per-request": ("/v1/completions",
                                  {**COMP[1], "prompt": [[5]] * (MAX_PROMPTS_PER_REQUEST + 1)},
                                  "prompt"),
    "messages": ("/v1/chat/completions", {**CHAT[1], "messages": MSG * (MAX_MESSAGES + 1)},
                 "messages"),
    "tokenize-messages": ("/tokenize", {"messages": MSG * (MAX_MESSAGES + 1)}, "messages"),
    "n": ("/v1/chat/completions", {**CHAT[1], "n": MAX_N + 1}, "n"),
    "logprobs": ("/v1/completions", {**COMP[1], "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    "top_logprobs": ("/v1/chat/completions",
                     {**CHAT[1], "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
                     "top_logprobs"),
    "stop-strings": ("/v1/completions", {**COMP[1], "stop": ["s"] * (MAX_STOP_STRINGS + 1)},
                     "stop"),
    "stop-string-chars": ("/v1/completions",
                          {**COMP[1], "stop": "s" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    "stop-list-string-chars": ("/v1/chat/completions",
                               {**CHAT[1], "stop": ["x", "s" * (MAX_STOP_STRING_CHARS + 1)]},
                               "stop.1"),
    "empty-stop-string": ("/v1/completions", {**COMP[1], "stop": [""]}, "stop.0"),
    "stop-token-ids": ("/v1/completions",
                       {**COMP[1], "stop_token_ids": [3] * (MAX_STOP_TOKEN_IDS + 1)},
                       "stop_token_ids"),
    "negative-stop-token-id": ("/v1/completions", {**COMP[1], "stop_token_ids": [1, -1]},
                               "stop_token_ids.1"),
    "negative-prompt-id": ("/v1/completions", {**COMP[1], "prompt": [[1], [2, -3]]},
                           "prompt.1.1"),
}


@pytest.mark.parametrize("case", list(BOUND_CASES))
def test_bounds_are_a_400_naming_the_field(ts, case: str) -> None:
    path, body, param = BOUND_CASES[case]
    assert_error(post_raw(ts, path, json.dumps(body).encode()), 400, param)


def test_bounds_themselves_are_accepted(ts) -> None:
    body = {**COMP[1], "prompt": [[5, 6]] * MAX_PROMPTS_PER_REQUEST, "max_tokens": 1,
            "stop": ["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
            "stop_token_ids": [7] * MAX_STOP_TOKEN_IDS, "temperature": 0}
    r = post_raw(ts, "/v1/completions", json.dumps(body).encode(), timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == MAX_PROMPTS_PER_REQUEST
    r = post_raw(ts, "/tokenize", json.dumps({"messages": MSG * MAX_MESSAGES}).encode())
    assert r.status_code == 200, r.text
    assert_pool_whole(ts)


# ------------------------------------------------------------------ 413 reliably
def _busy_streams(ts: TinyServer, stop: threading.Event) -> list[threading.Thread]:
    """Streaming requests that keep the engine and the event loop busy until ``stop``."""

    def run() -> None:
        body = {**CHAT[1], "max_tokens": 400, "ignore_eos": True, "stream": True}
        while not stop.is_set():
            with httpx.stream("POST", f"{ts.url}/v1/chat/completions", json=body,
                              headers=AUTH, timeout=60) as s:
                assert s.status_code == 200
                for _ in s.iter_lines():
                    if stop.is_set():
                        break

    threads = [threading.Thread(target=run, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    return threads


def _raw_post(ts: TinyServer, body: bytes, chunked: bool, key: str = KEY) -> tuple[int, bytes]:
    """A client that writes the WHOLE request before it reads (as many simple clients do):
    it fails with a reset if the server closes while body bytes are still unread."""
    host, port = ts.url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}"
            "\r\nContent-Type: application/json\r\n")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        if chunked:
            sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            for i in range(0, len(body), 65536):
                part = body[i:i + 65536]
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            sock.sendall(b"0\r\n\r\n")
        else:
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ")[1]), payload


def _oversized(ts: TinyServer, i: int) -> tuple[int, bytes]:
    a_bit_over = b"x" * (MAX_BODY + 100)
    well_over = b"y" * (6 * MAX_BODY)
    kind = i % 5
    if kind == 3:
        return _raw_post(ts, a_bit_over if i % 2 else well_over, chunked=False)
    if kind == 4:  # the final chunk is the one that crosses the limit, or not
        return _raw_post(ts, a_bit_over if i % 2 else well_over, chunked=True)
    url = f"{ts.url}/v1/completions"
    headers = {**AUTH, "content-type": "application/json"}
    with httpx.Client(timeout=60) as c:
        if kind == 0:
            r = c.post(url, content=a_bit_over, headers=headers)
        elif kind == 1:  # Content-Length well over the limit
            r = c.post(url, content=well_over, headers=headers)
        else:  # chunked, no length
            r = c.post(url, content=(b"z" * 65536 for _ in range(MAX_BODY // 65536 + 4)),
                       headers=headers)
    return r.status_code, r.content


def test_oversized_bodies_get_413_under_load(ts) -> None:
    stop = threading.Event()
    threads = _busy_streams(ts, stop)
    try:
        assert wait_until(lambda: ts.engine.has_unfinished_requests(), 10)
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda i: _oversized(ts, i), range(20)))
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    for status, content in responses:
        err = assert_error(httpx.Response(status, content=content), 413)
        assert err["code"] == "request_too_large" and str(MAX_BODY) in err["message"]
    assert httpx.get(f"{ts.url}/health").status_code == 200
    assert_pool_whole(ts)


def test_unauthorized_body_is_drained_before_the_401(ts) -> None:
    url = f"{ts.url}/v1/completions"
    for size in (MAX_BODY // 2, 3 * MAX_BODY):
        status, content = _raw_post(ts, b" " * size, chunked=False, key="wrong")
        assert_error(httpx.Response(status, content=content), 401)
    with httpx.Client(timeout=30) as c:  # drained: the connection stays usable
        assert_error(c.post(url, json=COMP[1]), 401)
        assert c.post(url, json=COMP[1], headers=AUTH).status_code == 200


def test_expect_100_continue_gets_413_without_sending_the_body(ts) -> None:
    host, port = ts.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {50 * MAX_BODY}\r\nExpect: 100-continue\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(payload)["error"]["code"] == "request_too_large"
