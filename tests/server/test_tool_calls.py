"""Tool calling through the official `openai` client against the tiny tokenizer server:
required / named / auto / none, streamed deltas reassembled == the whole response, a
follow-up turn with tool messages, and the 400s for bad tools."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from roseinfer.server.protocol import ChatMessage, ToolDefinition
from roseinfer.server.tool_stream import ToolCallParser
from roseinfer.server.tools import call_text, chat_conversation
from tests.server.test_structured_http import no_whitespace
from tests.server.tokenizer_server import MODEL_NAME

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
SAMPLING: dict[str, Any] = {"temperature": 0.8, "max_tokens": 160}




def valid_calls(message: Any, names: set[str]) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def create(c: openai.OpenAI, **kwargs: Any) -> Any:
    return c.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=TOOLS,
                                     logit_bias=no_whitespace(), **{**SAMPLING, **kwargs})


def test_required_single_and_parallel(client) -> None:
    out = create(client, tool_choice="required", parallel_tool_calls=False, n=3, seed=1)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        valid_calls(choice.message, {"get_weather", "add"})
    out = create(client, tool_choice="required", n=2, seed=2)
    for choice in out.choices:
        if choice.finish_reason == "tool_calls":
            valid_calls(choice.message, {"get_weather", "add"})
        else:  # parallel calls may run out of max_tokens; complete ones still count
            assert choice.finish_reason == "length"


def test_named_tool(client) -> None:
    out = create(client, tool_choice={"type": "function", "function": {"name": "add"}},
                 parallel_tool_calls=False, seed=3, n=2)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        valid_calls(choice.message, {"add"})


def test_auto_answers_in_text_or_calls(client) -> None:
    out = create(client, tool_choice="auto", seed=5, n=4, max_tokens=48)
    for choice in out.choices:
        assert "<tool_call>" not in (choice.message.content or "") or (
            choice.finish_reason == "length")
        if choice.message.tool_calls:
            valid_calls(choice.message, {"get_weather", "add"})


def test_none_is_plain_text(client) -> None:
    out = create(client, tool_choice="none", seed=5, max_tokens=8)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")


def reassemble(chunks: Any) -> dict[int, dict[str, Any]]:
    got: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            entry = got.setdefault(ch.index, {"content": "", "calls": {}, "finish": None})
            entry["content"] += ch.delta.content or ""
            for piece in ch.delta.tool_calls or ():
                call = entry["calls"].setdefault(piece.index, {"name": "", "arguments": ""})
                if piece.id:
                    assert piece.id.startswith("call_") and piece.type == "function"
                    call["name"] += piece.function.name
                call["arguments"] += piece.function.arguments or ""
            entry["finish"] = ch.finish_reason or entry["finish"]
    return got


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_stream_reassembles_to_the_whole_response(client, choice: str) -> None:
    kwargs = {"tool_choice": choice, "seed": 11, "n": 3, "max_tokens": 96}
    whole = create(client, **kwargs)
    got = reassemble(create(client, stream=True, **kwargs))
    for ch in whole.choices:
        entry = got[ch.index]
        assert (entry["content"] or None) == ch.message.content
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in ch.message.tool_calls or ()]
        assert [entry["calls"][k] for k in sorted(entry["calls"])] == calls
        assert entry["finish"] == ch.finish_reason


def test_follow_up_turn_with_tool_messages(client) -> None:
    first = create(client, tool_choice="required", parallel_tool_calls=False, seed=4)
    call = first.choices[0].message.tool_calls[0]
    messages = [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS,
                                         max_tokens=4, seed=1)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    conv = chat_conversation([ChatMessage.model_validate(m) for m in messages], native=False,
                             tools=tuple(ToolDefinition.model_validate(t) for t in TOOLS))
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user"]
    assert conv[0]["content"].startswith("You may call") and '"get_weather"' in conv[0]["content"]
    assert conv[2]["content"] == call_text(call.function.name, call.function.arguments)
    assert conv[3]["content"] == '<tool_response>\n{"temp": 21}\n</tool_response>'


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "bogus"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
])
def test_bad_tools_are_400s(client, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=2, **extra)
    assert info.value.param == param, info.value


def test_parser_is_chunking_independent() -> None:
    text = ('hi <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>\n')
    whole = ToolCallParser()
    content, calls = whole.feed(text)
    content += whole.finish()
    assert content == "hi " and [c.name for c in calls] == ["add", "add"]
    for step in (1, 2, 5):
        p = ToolCallParser()
        pieces = [p.feed(text[i:i + step]) for i in range(0, len(text), step)]
        assert "".join(t for t, _ in pieces) + p.finish() == content
        assert [c for _, cs in pieces for c in cs] == calls
    p = ToolCallParser()
    assert p.feed("a <tool_") == ("a ", []) and p.finish() == "<tool_"
