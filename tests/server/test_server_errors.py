"""Bad requests against the default-model server: each gets its status and an
OpenAI-shaped body, none reaches the engine, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.helpers import MODEL_NAME, metric, scrape

pytestmark = pytest.mark.slow  # default model or real servers: `make test-fast` skips it

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL_NAME, "messages": MSG, "max_tokens": 4, **kw}


def comp(**kw) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **kw}


CASES = {
    "negative-temperature": (*chat(temperature=-0.5), 400, "temperature"),
    "top_p-zero": (*chat(top_p=0), 400, "top_p"),
    "top_p-above-1": (*comp(top_p=1.5), 400, "top_p"),
    "n-zero": (*chat(n=0), 400, "n"),
    "max_tokens-zero": (*comp(max_tokens=0), 400, "max_tokens"),
    "max_completion_tokens-negative": (*chat(max_completion_tokens=-3), 400,
                                       "max_completion_tokens"),
    "empty-messages": (*chat(messages=[]), 400, "messages"),
    "unknown-role": (*chat(messages=[{"role": "wizard", "content": "x"}]), 400, None),
    "messages-wrong-type": (*chat(messages="hello"), 400, "messages"),
    "temperature-string": (*chat(temperature="hot"), 400, "temperature"),
    "max_tokens-string": (*comp(max_tokens="12"), 400, "max_tokens"),
    "stream-not-bool": (*comp(stream="yes"), 400, "stream"),
    "missing-prompt": ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    "empty-prompt-list": (*comp(prompt=[]), 400, "prompt"),
    "empty-prompt-text": (*comp(prompt=""), 400, "prompt"),
    "token-outside-vocab": (*comp(prompt=[1, 2, 10**7]), 400, "prompt"),
    "negative-token-id": (*comp(prompt=[1, -2]), 400, None),
    "presence-penalty-range": (*chat(presence_penalty=3), 400, "presence_penalty"),
    "min_tokens-over-max": (*comp(min_tokens=10, max_tokens=4), 400, "min_tokens"),
    "top_logprobs-without-logprobs": (*chat(top_logprobs=2), 400, "top_logprobs"),
    "top_logprobs-too-many": (*chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    "unknown-model": (*chat(model="gpt-9"), 404, "model"),
    "generate-bad-temperature": ("/generate", {"prompt": "x", "temperature": -1}, 400, None),
    "tokenize-nothing": ("/tokenize", {}, 400, None),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_request_gets_openai_error(server, case: str) -> None:
    path, body, status, param = CASES[case]
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_context_overflow_names_both_numbers(server) -> None:
    limit = httpx.get(f"{server.v1}/models").json()["data"][0]["max_model_len"]
    path, body = comp(prompt="word " * 50, max_tokens=limit - 2)
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert str(limit) in message and str(limit - 2) in message
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "word " * (limit + 10)}])


def test_malformed_http_and_server_keeps_serving(server) -> None:
    before = scrape(server.url)
    bad_json = httpx.post(f"{server.v1}/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    unknown = httpx.get(f"{server.url}/v1/nothing-here")
    assert unknown.status_code == 404 and unknown.json()["error"]["message"]
    wrong_method = httpx.get(f"{server.v1}/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"]
    too_big = httpx.post(f"{server.v1}/completions", content=b"x" * (5 << 20),
                         headers={"content-type": "application/json"})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    # No bad request reached the engine: no prompt token was counted.
    after = scrape(server.url)
    assert metric(after, "roseinfer:prompt_tokens_total") == metric(
        before, "roseinfer:prompt_tokens_total")
    r = httpx.post(f"{server.v1}/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{server.url}/health").status_code == 200
