"""Anthropic Messages shapes without a server: the request models (what is accepted and
refused), the conversion to a chat turn, the content blocks of a stream and of a whole
message, and the SSE event format."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest
from pydantic import TypeAdapter, ValidationError

from roseinfer.outputs import ToolCall
from roseinfer.server.anthropic import sse
from roseinfer.server.anthropic.blocks import BlockWriter, MessageAssembler, stop_reason
from roseinfer.server.anthropic.convert import (
    chat_messages,
    conversation_fields,
    tool_fields,
    turn_fields,
)
from roseinfer.server.anthropic.errors import error_body, is_anthropic_path
from roseinfer.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from roseinfer.server.anthropic.routes import message_content, stream_events
from roseinfer.server.chat_events import (
    ChatError,
    ChatUsage,
    ChoiceFinish,
    ChoiceResult,
    ChoiceStart,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from roseinfer.server.errors import APIError
from roseinfer.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def request(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate({**body, **fields})


def refused(**fields: Any) -> str:
    with pytest.raises(ValidationError) as info:
        request(**fields)
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in info.value.errors())


def test_accepts_what_the_sdk_sends_nulls_included() -> None:
    body = request(
        system=[{"type": "text", "text": "Be brief. ", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Use metric.", "citations": None}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "Let me look.", "citations": None},
                {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"city": "Oslo"},
                 "caller": {"type": "direct"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": None,
                 "content": [{"type": "text", "text": "12 C"}]}]}],
        tools=[{"name": "get", "input_schema": SCHEMA, "description": None, "type": None,
                "cache_control": None, "strict": None}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": None},
        metadata={"user_id": None}, stop_sequences=None, temperature=None, top_p=None,
        top_k=None, stream=None, thinking=None, service_tier=None, container=None)
    assert body.system_text() == "Be brief. Use metric."


@pytest.mark.parametrize(("fields", "words"), [
    ({"foo": 1}, "foo: Extra inputs are not permitted"),
    ({"max_tokens": 0}, "greater than or equal to 1"),
    ({"temperature": 1.5}, "less than or equal to 1"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}]}]},
     "document blocks are not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "web_search_20250305 tools (server tools) are not supported"),
    ({"tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "greater than or equal to 1024"),
    ({"container": "c1"}, "containers (code execution) are not supported"),
    ({"tools": [{"name": "t", "input_schema": SCHEMA, "input_examples": [{"city": "x"}]}]},
     "input_examples are not supported"),
])
def test_refuses_what_would_change_the_output(fields: dict[str, Any], words: str) -> None:
    assert words in refused(**fields)


def test_messages_become_chat_messages() -> None:
    body = request(system="S", messages=[
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "T", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "A"},
            {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12 C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "city"}]},
            {"type": "text", "text": "And tomorrow?"}]}])
    assert chat_messages(body) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning_content": "T", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "12 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no city"},
        {"role": "user", "content": "And tomorrow?"}]


def test_tool_use_in_a_user_message_is_refused() -> None:
    body = request(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "get", "input": {}}]}])
    with pytest.raises(APIError) as info:
        chat_messages(body)
    assert info.value.status_code == 400 and "tool_use blocks" in info.value.message


@pytest.mark.parametrize(("choice", "expected"), [
    (None, {}),
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any", "disable_parallel_tool_use": True},
     {"tool_choice": "required", "parallel_tool_calls": False}),
    ({"type": "tool", "name": "get"}, {"tool_choice": {"type": "function",
                                                       "function": {"name": "get"}}}),
    ({"type": "none"}, {"tool_choice": "none"}),
])
def test_tool_choice(choice: dict[str, Any] | None, expected: dict[str, Any]) -> None:
    tools = [{"name": "get", "description": "Weather", "input_schema": SCHEMA, "strict": True}]
    out = tool_fields(request(tools=tools, tool_choice=choice))
    assert out.pop("tools") == [{"type": "function", "function": {
        "name": "get", "description": "Weather", "parameters": SCHEMA, "strict": True}}]
    assert out == expected


def test_turn_fields() -> None:
    out = turn_fields(request(temperature=0, top_k=5, stop_sequences=["\n\n"],
                              thinking={"type": "enabled", "budget_tokens": 1024},
                              max_tokens=2048, output_config={"format": {
                                  "type": "json_schema", "schema": SCHEMA}}))
    assert out["max_tokens"] == 2048
    assert out["sampling"] == {"temperature": 0, "top_k": 5, "stop": ("\n\n",)}
    assert out["chat_template_kwargs"] == {"enable_thinking": True}
    assert out["structured"] == StructuredOutputsParams(json=SCHEMA)
    assert (out["add_generation_prompt"], out["continue_final_message"]) == (True, False)
    for thinking in (None, {"type": "disabled"}):
        assert turn_fields(request(thinking=thinking))["chat_template_kwargs"] == {
            "enable_thinking": False}
    prefill = request(messages=[{"role": "user", "content": "Q"},
                                {"role": "assistant", "content": "The answer is"}])
    assert (turn_fields(prefill)["add_generation_prompt"],
            turn_fields(prefill)["continue_final_message"]) == (False, True)


def test_thinking_rules() -> None:
    with pytest.raises(APIError) as info:
        turn_fields(request(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=1024))
    assert info.value.param == "thinking.budget_tokens"
    tools = [{"name": "get", "input_schema": SCHEMA}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get"}):
        with pytest.raises(APIError) as info:
            turn_fields(request(thinking={"type": "adaptive"}, tools=tools, tool_choice=choice))
        assert info.value.param == "tool_choice"
    assert turn_fields(request(thinking={"type": "adaptive"}, tools=tools,
                               tool_choice={"type": "auto"}))["tool_choice"] == "auto"


def test_count_tokens_body_has_no_sampling() -> None:
    body = CountTokensRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"}], "system": "S"})
    assert conversation_fields(body)["messages"][0] == {"role": "system", "content": "S"}
    with pytest.raises(ValidationError):
        CountTokensRequest.model_validate({"model": "m", "max_tokens": 3, "messages": [
            {"role": "user", "content": "hi"}]})


def run(writer: BlockWriter, steps: list[tuple[str, str]]) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = []
    for kind, text in steps:
        if kind == "call":
            name, _, args = text.partition(" ")
            ops += writer.tool_call_start(name)
            ops += writer.tool_call_arguments(args[:3]) + writer.tool_call_arguments(args[3:])
            ops += writer.close()
        else:
            ops += getattr(writer, kind)(text)
    return ops + writer.close()


def test_blocks_of_a_stream() -> None:
    ops = run(BlockWriter(), [("reasoning", "Let me "), ("reasoning", "think."),
                              ("text", ""), ("text", "Sure. "), ("text", "Calling."),
                              ("call", 'get {"city": "Oslo"}'), ("call", "get {}")])
    kinds = [(op["type"], op.get("delta", op.get("content_block", {})).get("type")) for op in ops]
    assert kinds == [
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"),
        ("content_block_delta", "text_delta"), ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None)]
    assert [op["index"] for op in ops] == [0] * 5 + [1] * 4 + [2] * 4 + [3] * 3
    assembler = MessageAssembler()
    assembler.apply(ops)
    ids = [b.pop("id") for b in assembler.content if b["type"] == "tool_use"]
    assert all(i.startswith("toolu_") for i in ids) and len(set(ids)) == 2
    assert assembler.content == [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""},
        {"type": "text", "text": "Sure. Calling."},
        {"type": "tool_use", "name": "get", "input": {"city": "Oslo"}},
        {"type": "tool_use", "name": "get", "input": {}}]


def test_omitted_thinking_keeps_an_empty_block() -> None:
    assembler = MessageAssembler()
    assembler.apply(run(BlockWriter(omit_thinking=True), [("reasoning", "x"), ("text", "y")]))
    assert assembler.content == [{"type": "thinking", "thinking": "", "signature": ""},
                                 {"type": "text", "text": "y"}]


@pytest.mark.parametrize(("finish", "matched", "expected"), [
    ("length", None, ("max_tokens", None)),
    ("tool_calls", None, ("tool_use", None)),
    ("stop", "END", ("stop_sequence", "END")),
    ("stop", "<|im_end|>", ("end_turn", None)),  # a stop string of the model's, not the request's
    ("stop", 2, ("end_turn", None)),
    ("stop", None, ("end_turn", None)),
])
def test_stop_reason(finish: str, matched: Any, expected: tuple[str, Any]) -> None:
    assert stop_reason(finish, matched, ["END"]) == expected


def test_sse_events_and_errors() -> None:
    text = sse.event(sse.message_delta("end_turn", None, 7, 3, 4))
    head, data, blank = text.split("\n", 2)
    assert head == "event: message_delta" and blank == "\n"
    payload = json.loads(data.removeprefix("data: "))
    assert payload["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert payload["usage"] == {"input_tokens": 3, "output_tokens": 3,
                                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}
    assert sse.event(sse.PING) == 'event: ping\ndata: {"type":"ping"}\n\n'
    assert error_body(503, "busy") == {"type": "error", "error": {
        "type": "overloaded_error", "message": "busy"}}
    assert error_body(422, "x")["error"]["type"] == "invalid_request_error"
    assert error_body(500, "x")["error"]["type"] == "api_error"
    assert is_anthropic_path("/v1/messages/count_tokens") and not is_anthropic_path(
        "/v1/messagesx")


def test_keepalive_pings_a_quiet_stream() -> None:
    async def slow() -> AsyncIterator[int]:
        for i in range(3):
            await asyncio.sleep(0.25 if i == 1 else 0)
            yield i

    async def collect(limit: int | None = None) -> list[int | None]:
        out: list[int | None] = []
        stream = sse.keepalive(slow(), 0.05)
        async for item in stream:
            out.append(item)
            if limit is not None and len(out) == limit:
                await stream.aclose()  # the pending item is cancelled
                break
        return out

    items = asyncio.run(collect())
    assert [i for i in items if i is not None] == [0, 1, 2]
    assert 2 <= items.count(None) <= 6 and items.index(None) == 1
    assert asyncio.run(collect(limit=2)) == [0, None]


def parse_sse(text: str) -> list[dict[str, Any]]:
    """The payloads of an SSE text, each checked against its ``event:`` line."""
    out = []
    for block in text.strip().split("\n\n"):
        head, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_stream_events_and_whole_message_agree() -> None:
    call = ToolCall("call_1", "get", '{"city": "Oslo"}')
    events = [ChoiceStart(0), ReasoningDelta(0, "Hmm, "), ReasoningDelta(0, "Oslo."),
              TextDelta(0, "Checking."), ToolCallStart(0, 0, call.id, call.name),
              ToolCallDelta(0, 0, call.arguments), ToolCallEnd(0, 0, call),
              ChoiceFinish(0, "tool_calls", None, 9), ChatUsage(5, 9)]

    async def source() -> AsyncIterator[Any]:
        for event in events:
            yield event

    async def collect() -> str:
        return "".join([e async for e in stream_events(source(), "msg_1", "m", 5, None, False)])

    payloads = parse_sse(asyncio.run(collect()))
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for payload in payloads:
        if payload["type"] != "ping":
            adapter.validate_python(payload)  # the SDK's own event types
    assert [p["type"] for p in payloads[:2]] == ["message_start", "ping"]
    assert [p["type"] for p in payloads[-2:]] == ["message_delta", "message_stop"]
    assert payloads[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert payloads[-2]["usage"]["output_tokens"] == 9
    streamed = MessageAssembler()
    streamed.apply([p for p in payloads if p["type"].startswith("content_block")])
    whole = message_content(ChoiceResult(0, "Checking.", "Hmm, Oslo.", [call], "tool_calls",
                                         None, 9), omit_thinking=False)
    for blocks in (streamed.content, whole):
        assert blocks[2].pop("id").startswith("toolu_")
    assert streamed.content == whole == [
        {"type": "thinking", "thinking": "Hmm, Oslo.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "name": "get", "input": {"city": "Oslo"}}]
    message = sse.message("msg_1", "m", whole, "tool_use", None, 5, 9)
    message["content"][2]["id"] = "toolu_1"
    anthropic.types.Message.model_validate(message)


def test_an_engine_failure_ends_the_stream_with_an_error_event() -> None:
    async def source() -> AsyncIterator[Any]:
        yield TextDelta(0, "partial")
        yield ChatError(APIError(503, "The engine is not available"))

    async def collect() -> str:
        return "".join([e async for e in stream_events(source(), "msg_1", "m", 5, None, False)])

    payloads = parse_sse(asyncio.run(collect()))
    assert payloads[-1] == {"type": "error", "error": {
        "type": "overloaded_error", "message": "The engine is not available"}}
    assert "message_stop" not in [p["type"] for p in payloads]
