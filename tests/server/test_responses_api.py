"""The Responses API through the official `openai` client against a real uvicorn over the
tiny random model with the default model's tokenizer: create, the stream's events in
order (joined deltas == the final response == the whole one), a function call round
trip with ``function_call_output``, ``text.format`` json_schema, ``previous_response_id``
with the store (and ``store: false``), GET / DELETE, and errors in OpenAI's shape.
Greedy turns are compared with the same turn through chat completions: the same prompt
and the same output, as both run one chat pipeline. The model's text is random; the
tests assert the protocol."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.test_structured_http import SCHEMA, no_whitespace
from tests.server.test_tool_calls import WEATHER
from tests.server.tokenizer_server import MODEL_NAME

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 12}
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added",
                  "response.output_text.done", "response.content_part.done",
                  "response.output_item.done"]




@pytest.fixture(scope="module")
def no_space() -> dict[str, int]:
    """logit_bias against whitespace tokens (a random model spends JSON's budget there)."""
    return no_whitespace()


def create(c: openai.OpenAI, **kwargs: Any) -> Any:
    return c.responses.create(model=MODEL_NAME, **kwargs)


def chat_twin(c: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """The same greedy turn through chat completions."""
    kwargs = {"max_completion_tokens": GREEDY["max_output_tokens"], **kwargs}
    return c.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                     **kwargs)


def test_create(client) -> None:
    out = create(client, input="Tell me a story.", instructions="Be brief", metadata={"k": "v"},
                 **GREEDY)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == MODEL_NAME
    assert [item.type for item in out.output] == ["message"]
    message = out.output[0]
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert [part.type for part in message.content] == ["output_text"]
    assert message.content[0].annotations == []
    usage = out.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    if out.status == "incomplete":
        assert out.incomplete_details.reason == "max_output_tokens"
        assert usage.output_tokens == GREEDY["max_output_tokens"]
        assert message.status == "incomplete"
    else:
        assert out.status == "completed" and out.incomplete_details is None
        assert usage.output_tokens < GREEDY["max_output_tokens"]
    assert (out.instructions, out.metadata, out.temperature, out.max_output_tokens,
            out.store, out.tool_choice, out.tools, out.previous_response_id) == (
        "Be brief", {"k": "v"}, 0, 12, True, "auto", [], None)
    twin = chat_twin(client, [{"role": "system", "content": "Be brief"},
                              {"role": "user", "content": "Tell me a story."}])
    assert out.output_text == twin.choices[0].message.content
    assert usage.input_tokens == twin.usage.prompt_tokens
    assert usage.output_tokens == twin.usage.completion_tokens
    # the same prompt again: its full blocks come from the prefix cache, and usage says so
    assert 0 < twin.usage.prompt_tokens_details.cached_tokens < twin.usage.prompt_tokens
    again = create(client, input="Tell me a story.", instructions="Be brief", **GREEDY)
    assert (again.usage.input_tokens_details.cached_tokens
            == twin.usage.prompt_tokens_details.cached_tokens)


def test_stream_events(client, ts) -> None:
    whole = create(client, input="Count to ten.", **GREEDY)
    events = list(create(client, input="Count to ten.", stream=True, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == MESSAGE_EVENTS[:2] and kinds[-4:-1] == MESSAGE_EVENTS[2:]
    assert kinds[4:-4] == ["response.output_text.delta"] * len(deltas)
    assert kinds[-1] == f"response.{whole.status}"
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0
               for e in events[3:-2])
    joined = "".join(d.delta for d in deltas)
    assert joined == events[-4].text == final.output_text == whole.output_text
    # the same counts; the second run of the prompt may take more of it from the cache
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (
        whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.total_tokens)
    assert (final.usage.input_tokens_details.cached_tokens
            >= whole.usage.input_tokens_details.cached_tokens)
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # stored too
    # on the wire: `event:` names each event's type, and nothing follows the last
    body = {"model": MODEL_NAME, "input": "Count to ten.", "stream": True, **GREEDY}
    with httpx.stream("POST", f"{ts.url}/v1/responses", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        name, data = block.split("\n")
        assert name == f"event: {json.loads(data.removeprefix('data: '))['type']}"
    assert "[DONE]" not in blocks[-1]


def test_function_call_round_trip(client, no_space) -> None:
    bias = {"logit_bias": no_space}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = create(client, input=ask, tools=[TOOL], tool_choice="required", temperature=0,
                 max_output_tokens=120, parallel_tool_calls=False, extra_body=bias)
    assert out.status == "completed" and [i.type for i in out.output] == ["function_call"]
    call = out.output[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert out.tools[0].name == "get_weather" and out.tool_choice == "required"
    twin = chat_twin(client, ask, tools=[CHAT_TOOL], tool_choice="required",
                     parallel_tool_calls=False, max_completion_tokens=120, **bias)
    assert twin.choices[0].message.tool_calls[0].function.arguments == call.arguments
    # the stream (through the SDK's helper): the call's item, its arguments, then done
    with client.responses.stream(model=MODEL_NAME, input=ask, tools=[TOOL],
                                 tool_choice="required", temperature=0, max_output_tokens=120,
                                 parallel_tool_calls=False, extra_body=bias) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output[0].arguments == call.arguments
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == done.arguments == call.arguments
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    # the round trip: the SDK's own output items sent back, with the call's result
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}
    follow = create(client, input=[*ask, *out.output, result], tools=[TOOL], **GREEDY)
    assert follow.status in ("completed", "incomplete")
    twin = chat_twin(client, [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "22 C, sunny"}],
        tools=[CHAT_TOOL])
    assert follow.usage.input_tokens == twin.usage.prompt_tokens
    assert follow.output_text == (twin.choices[0].message.content or "")
    # the same turn through previous_response_id: only the call's result is sent
    chained = create(client, input=[result], previous_response_id=out.id, tools=[TOOL],
                     **GREEDY)
    assert chained.usage.input_tokens == follow.usage.input_tokens
    assert chained.output_text == follow.output_text
    named = create(client, input=ask, tools=[TOOL], temperature=0, max_output_tokens=120,
                   tool_choice={"type": "function", "name": "get_weather"}, extra_body=bias)
    assert [i.type for i in named.output] == ["function_call"]


class Item(BaseModel):
    id: int = Field(ge=0, le=99)
    ok: bool
    tag: Literal["red", "green"]
    name: str = Field(max_length=5)


def test_json_schema(client, no_space) -> None:
    fmt = {"format": {"type": "json_schema", "name": "item", "schema": SCHEMA, "strict": True}}
    bias = {"logit_bias": no_space, "seed": 3}
    out = create(client, input="An item, please.", text=fmt, temperature=0.8,
                 max_output_tokens=120, extra_body=bias)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    assert out.text.format.type == "json_schema" and out.text.format.name == "item"
    parsed = client.responses.parse(model=MODEL_NAME, input="An item, please.", text_format=Item,
                                    temperature=0.8, max_output_tokens=120, extra_body=bias)
    assert isinstance(parsed.output_parsed, Item)
    with client.responses.stream(model=MODEL_NAME, input="An item, please.", text_format=Item,
                                 temperature=0.8, max_output_tokens=120, extra_body=bias) as s:
        streamed = s.get_final_response()
    assert streamed.output_parsed == parsed.output_parsed  # same seed, same output
    # tools beside a schema (as the Agents SDK sends an output_type with tools): each
    # output is calls following the tool's schema, or an answer following text.format
    for seed in range(3):
        both = create(client, input="Weather or an item?", text=fmt, tools=[TOOL],
                      temperature=0.8, max_output_tokens=160,
                      extra_body={**bias, "seed": seed})
        for item in both.output:
            if item.type == "function_call":
                jsonschema.validate(json.loads(item.arguments), WEATHER)
            elif both.status == "completed":
                jsonschema.validate(json.loads(item.content[0].text), SCHEMA)
    obj = create(client, input="JSON, please.", text={"format": {"type": "json_object"}},
                 temperature=0.8, max_output_tokens=120, extra_body=bias)
    assert obj.text.format.type == "json_object" and obj.output_text.startswith("{")
    if obj.status == "completed":  # a random model's object may outrun its tokens
        assert isinstance(json.loads(obj.output_text), dict)


def test_previous_response_id_and_store(client) -> None:
    first = create(client, input="My name is Rose.", instructions="Be brief", **GREEDY)
    second = create(client, input="What is my name?", previous_response_id=first.id, **GREEDY)
    assert second.previous_response_id == first.id and second.instructions is None
    # instructions are not carried over; the earlier turn and its answer are
    twin = chat_twin(client, [{"role": "user", "content": "My name is Rose."},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "What is my name?"}])
    assert second.usage.input_tokens == twin.usage.prompt_tokens
    assert second.output_text == twin.choices[0].message.content
    third = create(client, input="And again?", previous_response_id=second.id, **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    assert got.usage == first.usage
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        create(client, input="x", previous_response_id=first.id, **GREEDY)
    assert info.value.body["param"] == "previous_response_id"
    # a continuation does not need its evicted/deleted ancestor: it holds the conversation
    assert create(client, input="Still?", previous_response_id=second.id, **GREEDY).id
    unstored = create(client, input="Forget this.", store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as info:
        create(client, input="x", previous_response_id=unstored.id, **GREEDY)
    assert info.value.status_code == 404
    assert info.value.body["type"] == "invalid_request_error"
    assert unstored.id in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("extra", "param"), [
    ({"frobnicate": True}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"max_output_tokens": 10**6}, "input"),
    ({"temperature": "hot"}, "temperature"),
    ({"model": "not-served"}, "model"),
])
def test_errors(ts, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL_NAME, "input": "hi", **extra}
    r = httpx.post(f"{ts.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_sdk_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input="hi", tools=[{"type": "web_search"}])
    assert "web_search" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_unknown")
