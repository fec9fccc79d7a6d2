"""Anthropic's Messages API through the official ``anthropic`` SDK against a real uvicorn
(a tiny random Llama with the default model's tokenizer and chat template, an API key
set): create, stream (joined deltas == the final message), stop sequences, prefill,
tools with a named ``tool_choice``, a ``tool_result`` follow-up turn, count_tokens, and
errors in Anthropic's shape. The model's text is meaningless: the protocol is tested."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
import torch

from roseinfer.server.state import ServerSettings
from tests.server.helpers import TinyServer
from tests.server.test_structured_http import no_whitespace
from tests.server.tokenizer_server import MODEL_NAME, tokenizer_server

KEY = "sk-anthropic-test"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": WEATHER}]
NAMED = {"type": "tool", "name": "get_weather"}


class LogitsHook:
    """The random model's logits, changed: whitespace-only tokens are never chosen (the
    OpenAI tool tests send ``logit_bias`` for this, which Anthropic's API does not have:
    the model would spend its budget on the whitespace JSON allows inside a call); with
    ``poison`` set they are NaN, so the engine fails the request (and goes on)."""

    def __init__(self, server: TinyServer) -> None:
        self.model = server.engine.runner.model
        self.compute_logits = self.model.compute_logits
        self.banned = torch.tensor([int(i) for i in no_whitespace()], dtype=torch.long)
        self.poison = False
        self.model.compute_logits = self

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.compute_logits(hidden)  # [R, V]
        logits[:, self.banned] = -1e4
        if self.poison:
            logits[:] = float("nan")
        return logits


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TinyServer, LogitsHook]]:
    settings = ServerSettings(served_model_names=(MODEL_NAME,), api_key=KEY)
    with tokenizer_server(settings) as server:
        yield server, LogitsHook(server)


@pytest.fixture(scope="module")
def ts(served: tuple[TinyServer, LogitsHook]) -> TinyServer:
    return served[0]


@pytest.fixture(scope="module")
def client(ts: TinyServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=ts.url, api_key=KEY, max_retries=0, timeout=120)


SAMPLING = ("temperature", "top_p", "top_k")


def create(client: anthropic.Anthropic, **kwargs: Any) -> Any:
    """``messages.create``; this SDK (2.14) has no sampling arguments any more, so
    temperature / top_p / top_k (still accepted, as older SDKs send them) go as
    ``extra_body``."""
    extra = {k: kwargs.pop(k) for k in SAMPLING if k in kwargs}
    fields = {"model": MODEL_NAME, "max_tokens": 12, "messages": USER, **kwargs}
    if extra:
        fields["extra_body"] = {**fields.get("extra_body", {}), **extra}
    return client.messages.create(**fields)


def raw_events(client: anthropic.Anthropic, **kwargs: Any) -> list[Any]:
    with create(client, stream=True, **kwargs) as stream:
        return list(stream)


def prompt_tokens(usage: Any) -> int:
    """The whole prompt: Anthropic counts cache reads apart from ``input_tokens``."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def text_of(msg: Any) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_create(client: anthropic.Anthropic) -> None:
    msg = create(client, system="Answer briefly.", temperature=0.7, top_p=0.9, top_k=50,
                 metadata={"user_id": "u1"})
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == MODEL_NAME
    assert [b.type for b in msg.content] in ([], ["text"])
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert 1 <= msg.usage.output_tokens <= 12
    if msg.stop_reason == "max_tokens":
        assert msg.usage.output_tokens == 12
    assert msg.usage.cache_creation_input_tokens == 0
    count = client.messages.count_tokens(model=MODEL_NAME, messages=USER,
                                         system="Answer briefly.")
    assert prompt_tokens(msg.usage) == count.input_tokens > 0


def test_stream_joins_to_the_final_message(client: anthropic.Anthropic) -> None:
    kwargs = {"temperature": 0, "max_tokens": 16}
    whole = create(client, **kwargs)
    events = raw_events(client, **kwargs)
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    body = types[1:-2]
    assert body.count("content_block_start") == body.count("content_block_stop") == len(
        whole.content)
    start = events[0].message
    assert start.stop_reason is None and start.content == [] and start.id.startswith("msg_")
    assert start.usage.input_tokens == prompt_tokens(whole.usage)  # no cache lookup yet
    assert start.usage.cache_read_input_tokens == 0
    delta = events[-2]
    assert (delta.delta.stop_reason, delta.usage.output_tokens) == (
        whole.stop_reason, whole.usage.output_tokens)
    with client.messages.stream(model=MODEL_NAME, messages=USER, max_tokens=16,
                                extra_body={"temperature": 0}) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(final)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.usage.output_tokens, prompt_tokens(final.usage)) == (
        whole.stop_reason, whole.usage.output_tokens, prompt_tokens(whole.usage))


def test_cache_read_input_tokens(ts: TinyServer, client: anthropic.Anthropic) -> None:
    """A second request sharing a long prefix reads it from the prefix cache, and usage
    says so as Anthropic does (``input_tokens`` are the rest), whole and streamed; the
    count equals chat completions' ``cached_tokens`` for the same prompt."""
    system = "You are a careful weather assistant. " * 12 + "Case 7f3a."  # unseen prefix
    kwargs = {"system": system, "temperature": 0, "max_tokens": 4}
    first = create(client, **kwargs)
    count = client.messages.count_tokens(model=MODEL_NAME, messages=USER,
                                         system=system).input_tokens
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens == count
    second = create(client, **kwargs)
    block = ts.engine.config.block_size
    cached = second.usage.cache_read_input_tokens
    assert cached == (count - 1) // block * block > 0  # every full block but a last token's
    assert second.usage.input_tokens == count - cached
    assert second.usage.cache_creation_input_tokens == 0
    with client.messages.stream(model=MODEL_NAME, messages=USER, max_tokens=4, system=system,
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert (final.usage.cache_read_input_tokens, final.usage.input_tokens) == (
        cached, count - cached)
    chat = httpx.post(f"{ts.url}/v1/chat/completions", headers={"x-api-key": KEY}, json={
        "model": MODEL_NAME, "max_tokens": 4, "messages": [
            {"role": "system", "content": system}, *USER]}, timeout=60).json()
    assert chat["usage"]["prompt_tokens"] == count
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    text = text_of(create(client, temperature=0, max_tokens=24))
    stop = next((text[k:k + 3] for k in range(len(text) // 2, len(text) - 2)
                 if text[k:k + 3].strip()), None)
    assert stop, text  # a random model may write anything: the test needs some text
    msg = create(client, temperature=0, max_tokens=24, stop_sequences=["@@never@@", stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert text_of(msg) == text[:text.index(stop)]


def test_prefill_continues_the_assistant_message(client: anthropic.Anthropic) -> None:
    msg = create(client, temperature=0, messages=[
        *USER, {"role": "assistant", "content": "The weather in Paris is"}])
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert prompt_tokens(msg.usage) == client.messages.count_tokens(
        model=MODEL_NAME, messages=[*USER, {"role": "assistant",
                                            "content": "The weather in Paris is"}]).input_tokens


def test_output_format_constrains_the_text(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
              "required": ["answer"], "additionalProperties": False}
    msg = create(client, output_config={"format": {"type": "json_schema", "schema": schema}},
                 max_tokens=60)
    assert msg.stop_reason == "end_turn", msg
    jsonschema.validate(json.loads(text_of(msg)), schema)
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, output_config={"format": {"type": "json_schema",
                                                 "schema": {"type": "nonsense"}}})
    assert "output_config.format" in error_of(info, 400, "invalid_request_error")


def check_call(block: Any) -> None:
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER)


def test_named_tool_gives_one_call(client: anthropic.Anthropic) -> None:
    msg = create(client, tools=TOOLS, tool_choice=NAMED, max_tokens=200, temperature=0.8)
    assert msg.stop_reason == "tool_use", msg
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert len(calls) == 1 and msg.content[-1] is calls[0]
    check_call(calls[0])
    with client.messages.stream(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=200,
                                tool_choice={**NAMED, "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0.8}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and len(final.content) == 1
    check_call(final.content[0])
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert anthropic.types.ToolUseBlock.model_validate(
        {**final.content[0].model_dump(), "input": json.loads(partial)}
    ) == final.content[0]


def test_tool_result_follow_up(client: anthropic.Anthropic) -> None:
    first = create(client, tools=TOOLS, max_tokens=200,
                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use" and len(first.content) == 1, first
    assistant = first.to_param()  # as the SDK sends a reply back (its blocks, nulls kept)
    assistant["content"] = [*assistant["content"], {
        "type": "tool_use", "id": "toolu_2", "name": "get_weather",
        "input": {"city": "Atlantis", "unit": "c"}}]
    turn = [*USER, assistant, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": first.content[0].id, "content": "12 C, rain"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
         "content": [{"type": "text", "text": "unknown city"}]},
        {"type": "text", "text": "Thanks."}]}]
    for choice in ({"type": "auto"}, {"type": "none"}):
        msg = create(client, messages=turn, tools=TOOLS, tool_choice=choice, max_tokens=8)
        assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
        if choice["type"] == "none":
            assert all(b.type == "text" for b in msg.content)
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=turn, tools=TOOLS)
    assert counted.input_tokens > client.messages.count_tokens(
        model=MODEL_NAME, messages=USER, tools=TOOLS).input_tokens


def test_count_tokens_counts_tools(client: anthropic.Anthropic) -> None:
    plain = client.messages.count_tokens(model=MODEL_NAME, messages=USER).input_tokens
    with_tools = client.messages.count_tokens(model=MODEL_NAME, messages=USER, tools=TOOLS)
    assert with_tools.input_tokens > plain > 0


def error_of(info: pytest.ExceptionInfo, status: int, kind: str) -> str:
    exc = info.value
    assert exc.status_code == status
    assert exc.body["type"] == "error" and exc.body["error"]["type"] == kind, exc.body
    return exc.body["error"]["message"]


def test_errors_in_anthropics_shape(client: anthropic.Anthropic, ts: TinyServer) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, extra_body={"frequency_penalty": 1})
    assert "frequency_penalty" in error_of(info, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "url", "url": "http://127.0.0.1/x.png"}}]}])
    assert "image" in error_of(info, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})
    assert "nope" in error_of(info, 400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as info:
        create(client, model="claude-unknown")
    error_of(info, 404, "not_found_error")
    wrong = anthropic.Anthropic(base_url=ts.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        create(wrong)
    error_of(info, 401, "authentication_error")
    url = f"{ts.url}/v1/messages"
    body = {"model": MODEL_NAME, "messages": USER}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    missing = httpx.post(url, json=body, headers=headers, timeout=30)
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    ok = httpx.post(url, json={**body, "max_tokens": 2}, headers=headers, timeout=60)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    refused = httpx.post(url, json={**body, "max_tokens": 2}, timeout=30,
                         headers={**headers, "x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == (
        "authentication_error")
    models = httpx.get(f"{ts.url}/v1/models", headers={"x-api-key": KEY}, timeout=30)
    assert models.status_code == 200  # the key is taken as x-api-key on every route
    models = httpx.get(f"{ts.url}/v1/models", headers={"x-api-key": "wrong"}, timeout=30)
    assert models.status_code == 401 and "type" not in models.json()  # OpenAI's shape there
    for method, path, status, kind in (
            ("GET", "/v1/messages", 405, "invalid_request_error"),
            ("POST", "/v1/messages/batches", 404, "not_found_error")):
        unknown = httpx.request(method, f"{ts.url}{path}", headers=headers, timeout=30)
        error = unknown.json()["error"]
        assert (unknown.status_code, error["type"]) == (status, kind)
        assert f"{method} {path}" in error["message"]


def test_engine_failure(client: anthropic.Anthropic, served: tuple[TinyServer, LogitsHook]
                        ) -> None:
    server, hook = served
    hook.poison = True
    try:
        with pytest.raises(anthropic.InternalServerError) as info:
            create(client)
        error_of(info, 500, "api_error")
        with httpx.stream("POST", f"{server.url}/v1/messages", timeout=60, headers={
                "x-api-key": KEY}, json={"model": MODEL_NAME, "max_tokens": 4,
                                         "messages": USER, "stream": True}) as response:
            text = response.read().decode()
    finally:
        hook.poison = False
    events = [block.split("\n") for block in text.strip().split("\n\n")]
    assert [e[0] for e in events][0] == "event: message_start"
    assert events[-1][0] == "event: error", text  # the stream ends with the error
    body = json.loads(events[-1][1].removeprefix("data: "))
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert create(client).type == "message"  # the server goes on
