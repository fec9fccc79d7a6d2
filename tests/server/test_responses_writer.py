"""The Responses API's pieces without a server: the event writer (order, sequence
numbers, indices, the SDK's own models and stream accumulator), the request checks,
input items as chat messages and the bounded response store."""

from __future__ import annotations

import time
from typing import Any, get_args

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from roseinfer.server.errors import APIError
from roseinfer.server.responses_api.convert import chat_messages
from roseinfer.server.responses_api.objects import ResponseObject, ResponseUsage, echoed
from roseinfer.server.responses_api.protocol import (
    FunctionCallItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    check_request,
    function_tools,
    input_items,
)
from roseinfer.server.responses_api.store import ResponseStore
from roseinfer.server.responses_api.writer import ResponseWriter

_EVENT_TYPES = {get_args(member.model_fields["type"].annotation)[0]: member
                for member in get_args(get_args(ResponseStreamEvent)[0])}


def sdk_event(raw: dict[str, Any]) -> Any:
    """``raw`` validated by the SDK's model of its type."""
    return _EVENT_TYPES[raw["type"]].model_validate(raw)


def writer(**body: Any) -> ResponseWriter:
    request = ResponsesRequest.model_validate({"input": "hi", **body})
    response = ResponseObject(id="resp_1", created_at=int(time.time()), model="m",
                              **echoed(request, function_tools(request)))
    return ResponseWriter(response)


def run(w: ResponseWriter, truncated: bool = False) -> list[dict[str, Any]]:
    """A reasoning block, two text deltas, a call in two pieces, more text."""
    events = w.start()
    events += w.reasoning("Let me ") + w.reasoning("think.")
    events += w.text("Hel") + w.text("lo") + w.text("")
    events += w.call_start("call_1", "add") + w.call_arguments('{"a": 1, ') + \
        w.call_arguments('"b": 2}') + w.call_end()
    events += w.text(" again")
    events += w.finish(truncated, ResponseUsage.of(7, 9, cached_tokens=3))
    return events


def test_event_order_and_indices() -> None:
    events = run(writer())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.completed"]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == [
        "reasoning", "message", "function_call", "message"]
    for e in events[2:-1]:
        item = final["output"][e["output_index"]]
        if "item_id" in e:
            assert e["item_id"] == item["id"]
        if "content_index" in e:
            assert e["content_index"] == 0
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert final["usage"] == {"input_tokens": 7, "output_tokens": 9, "total_tokens": 16,
                              "input_tokens_details": {"cached_tokens": 3,
                                                       "cache_write_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 0}}
    assert final["output"][0]["content"] == [{"type": "reasoning_text",
                                              "text": "Let me think."}]
    assert final["output"][1]["content"] == [{"type": "output_text", "text": "Hello",
                                              "annotations": [], "logprobs": []}]
    call = final["output"][2]
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == (
        "call_1", "add", '{"a": 1, "b": 2}', "completed")
    assert call["id"].startswith("fc_") and final["output"][1]["id"].startswith("msg_")


def test_sdk_models_and_accumulator_agree() -> None:
    """Every event is one of the SDK's event models, and the SDK's own stream state
    (what ``client.responses.stream`` runs) rebuilds the final response from them."""
    events = run(writer())
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for raw in events:
        event = sdk_event(raw)
        state.handle_event(event)
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello again"
    snapshot = state._completed_response  # noqa: SLF001 - what the SDK's stream returns
    assert snapshot is not None and snapshot.output_text == "Hello again"


def test_truncated_and_empty() -> None:
    events = run(writer(max_output_tokens=5), truncated=True)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][-1]["status"] == "incomplete"
    assert final["response"]["max_output_tokens"] == 5
    w = writer()
    events = w.start() + w.finish(False, ResponseUsage.of(1, 0))
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert Response.model_validate(events[-1]["response"]).output_text == ""


def test_failure_events() -> None:
    w = writer()
    events = w.start() + w.text("a") + w.fail("boom", "engine_error")
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    for raw in events:
        sdk_event(raw)
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}
    assert events[-2]["code"] == "engine_error"


def test_echoed_parameters() -> None:
    final = run(writer(instructions="Be brief", temperature=0.5, top_p=0.9, store=False,
                       metadata={"k": "v"}, parallel_tool_calls=False, user="u",
                       tool_choice="required", reasoning={"effort": "low"},
                       tools=[{"type": "function", "name": "add", "parameters": {}}],
                       text={"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "object"}}}))[-1]["response"]
    got = Response.model_validate(final)
    assert (got.instructions, got.temperature, got.top_p, got.store, got.metadata, got.user,
            got.parallel_tool_calls, got.tool_choice) == (
        "Be brief", 0.5, 0.9, False, {"k": "v"}, "u", False, "required")
    assert got.reasoning is not None and got.reasoning.effort == "low"
    assert got.tools[0].type == "function" and got.tools[0].name == "add"
    assert got.text is not None and got.text.format is not None
    assert got.text.format.type == "json_schema"


def bad(body: dict[str, Any]) -> APIError:
    request = ResponsesRequest.model_validate(body)
    with pytest.raises(APIError) as info:
        check_request(request)
        function_tools(request)
        input_items(request)
    assert info.value.status_code == 400
    return info.value


def test_request_checks() -> None:
    assert bad({"input": "x", "frobnicate": 1}).param == "frobnicate"
    assert bad({"input": "x", "truncation": "auto"}).param == "truncation"
    assert bad({"input": "x", "background": True}).param == "background"
    assert bad({"input": "x", "top_logprobs": 3}).param == "top_logprobs"
    assert bad({"input": "x", "include": ["message.output_text.logprobs"]}).param == "include"
    assert bad({}).param == "input"
    error = bad({"input": "x", "tools": [{"type": "web_search"}]})
    assert error.param == "tools.0.type" and "web_search" in error.message
    assert bad({"input": "x", "tools": [{"type": "function"}]}).param == "tools.0.name"
    assert bad({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]}).param == "input.0.content.0.type"
    assert bad({"input": [{"type": "web_search_call", "id": "x"}]}).param == "input.0.type"
    assert bad({"input": [{"type": "function_call_output", "output": "1"}]}
               ).param == "input.0.call_id"
    assert bad({"input": [{"role": "user", "content": "x", "bogus": 1}]}
               ).param == "input.0.bogus"
    # what the SDK sends back (nulls, statuses, annotations) is accepted
    request = ResponsesRequest.model_validate({
        "input": [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                   "phase": None, "content": [{"type": "output_text", "text": "hi",
                                               "annotations": [], "logprobs": []}]},
                  {"id": "rs_1", "type": "reasoning", "summary": [], "encrypted_content": None,
                   "content": [{"type": "reasoning_text", "text": "hm"}],
                   "status": "completed"},
                  {"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f",
                   "arguments": "{}", "status": "completed"},
                  {"type": "function_call_output", "call_id": "c", "output": "3"}],
        "truncation": "disabled", "include": ["reasoning.encrypted_content"],
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "reasoning": {"effort": None, "summary": None}, "store": True, "metadata": {},
        "max_tool_calls": None, "top_logprobs": 0, "service_tier": "auto", "seed": 3})
    check_request(request)
    items = input_items(request)
    assert [type(i) for i in items][:3] == [MessageItem, ReasoningItem, FunctionCallItem]
    assert items[0].text() == "hi" and items[1].text() == "hm"


def test_store_bounds() -> None:
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    items = [MessageItem(role="user", content="x" * 100)]

    def response(i: int) -> ResponseObject:
        return ResponseObject(id=f"resp_{i}", created_at=0, model="m")

    for i in range(3):
        store.put(response(i), items)
    assert store.get("resp_0") is None and len(store) == 2
    assert store.get("resp_1") is not None  # now the most recently used
    store.put(response(3), items)
    assert store.get("resp_2") is None and store.get("resp_1") is not None
    assert store.delete("resp_1") and not store.delete("resp_1")
    small = ResponseStore(max_responses=100, max_bytes=1500)
    for i in range(5):
        small.put(response(i), items)
    assert 0 < small.bytes <= 1500 and small.get("resp_4") is not None
    assert small.get("resp_0") is None
    small.put(response(9), [MessageItem(role="user", content="y" * 2000)])  # too large alone
    assert small.get("resp_9") is None
    assert len(ResponseStore(0, 1000)) == 0


def test_items_as_chat_messages() -> None:
    """Instructions first; an assistant message and the calls after it are one message;
    a reasoning item is the next assistant message's reasoning_content."""
    request = ResponsesRequest.model_validate({"instructions": "Be brief", "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sun"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "c3", "name": "w", "arguments": "{}"}]})
    call = {"type": "function", "function": {"name": "w", "arguments": "{}"}}
    assert chat_messages(input_items(request), request.instructions) == [
        {"role": "system", "content": "Be brief"},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.",
         "tool_calls": [{"id": "c1", **call}, {"id": "c2", "type": "function", "function": {
             "name": "w", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c3", **call}]}]
