"""Structured outputs through the official `openai` client against the tiny tokenizer
server: response_format (dict and pydantic), extra_body structured_outputs, the SDK's
bodies (only what it is given) and the 400s it surfaces."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.test_structured_http import (
    CHOICES,
    JSON_SCHEMA,
    MSG,
    REGEX,
    SCHEMA,
    no_whitespace,
)
from tests.server.tokenizer_server import MODEL_NAME


@pytest.fixture
def client(ts) -> Iterator[tuple[openai.OpenAI, list[dict[str, Any]]]]:
    """An OpenAI client on the tiny server, and the JSON bodies it sent."""
    sent: list[dict[str, Any]] = []

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx.Client(event_hooks={"request": [record]}, timeout=120)
    try:
        yield openai.OpenAI(base_url=f"{ts.url}/v1", api_key="unused", http_client=http,
                            max_retries=0), sent
    finally:
        http.close()


def test_openai_client_sends_only_what_it_is_given(client) -> None:
    c, sent = client
    c.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=2)
    c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    assert [set(body) for body in sent] == [{"model", "messages", "max_tokens"},
                                            {"model", "prompt", "max_tokens"}]


def test_openai_client_json_schema(client) -> None:
    c, _ = client
    out = c.chat.completions.create(model=MODEL_NAME, messages=MSG, response_format=JSON_SCHEMA,
                                    temperature=0.8, seed=4, n=3, max_tokens=120,
                                    logit_bias=no_whitespace())
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = c.chat.completions.create(model=MODEL_NAME, messages=MSG, stream=True,
                                       response_format=JSON_SCHEMA, temperature=0.8, seed=4,
                                       n=3, max_tokens=120, logit_bias=no_whitespace())
    text: dict[int, str] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
    assert [text[i] for i in range(3)] == [ch.message.content for ch in out.choices]


class Item(BaseModel):
    id: int = Field(ge=0, le=99)
    tag: Literal["red", "green"]
    ok: bool


def test_openai_client_parse_with_a_pydantic_model(client) -> None:
    c, sent = client
    out = c.chat.completions.parse(model=MODEL_NAME, messages=MSG, response_format=Item,
                                   temperature=0.8, seed=2, max_tokens=80,
                                   logit_bias=no_whitespace())
    assert sent[-1]["response_format"]["type"] == "json_schema"
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Item) and 0 <= parsed.id <= 99


def test_openai_client_extra_body_structured_outputs(client) -> None:
    c, _ = client
    out = c.chat.completions.create(model=MODEL_NAME, messages=MSG, n=4, temperature=1.0,
                                    seed=6, max_tokens=16,
                                    extra_body={"structured_outputs": {"choice": CHOICES}})
    assert {ch.message.content for ch in out.choices} <= set(CHOICES)
    out = c.completions.create(model=MODEL_NAME, prompt="Code:", temperature=1.0, seed=6,
                               max_tokens=16, extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, out.choices[0].text)


def test_openai_client_sees_the_400s(client) -> None:
    c, _ = client
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=2, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}])
    assert info.value.param == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=2,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "x", "schema": {"type": "bogus"}}})
    assert info.value.param == "response_format"
