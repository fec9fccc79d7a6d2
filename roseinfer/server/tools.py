"""Tool calling over HTTP: a chat body's tool fields onto ``roseinfer.tool_calls``.

The plan, grammar, prompt and parsing live in ``roseinfer.tool_calls`` (shared with
``LLM.chat(tools=...)``); here the pydantic request models become plain dicts and the
``InvalidRequestError`` of a bad tool request becomes a 400 naming its field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

from roseinfer import tool_calls
from roseinfer.engine.validation import InvalidRequestError
from roseinfer.server.errors import bad_request
from roseinfer.server.protocol import ChatCompletionRequest, ChatMessage, ToolDefinition
from roseinfer.tool_calls import ToolPlan, call_text

__all__ = ["call_text", "chat_conversation", "message_dicts", "plan_tools", "tool_constraint"]


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """The body's tool request, checked (APIError 400 naming ``tools`` / ``tool_choice``)."""
    try:
        return tool_calls.plan_tools(_tool_dicts(body.tools or ()), body.tool_choice,
                                     body.parallel_tool_calls)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param) from exc


def _tool_dicts(tools: Sequence[ToolDefinition]) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools]


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as OpenAI-shaped dicts (content parts joined)."""
    return [{"role": m.role, "content": m.text(), "name": m.name,
             "tool_call_id": m.tool_call_id,
             "tool_calls": [c.model_dump() for c in m.tool_calls or ()]} for m in messages]


def chat_conversation(messages: Sequence[ChatMessage], native: bool,
                      tools: Sequence[ToolDefinition] | None = None) -> list[dict[str, Any]]:
    """``tool_calls.conversation`` of the request models (template input)."""
    return tool_calls.conversation(
        message_dicts(messages), native,
        None if tools is None else tool_calls.parse_tools(_tool_dicts(tools)))


async def tool_constraint(plan: ToolPlan, validator: Any,
                          fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (the body's SamplingParams constraints) with the grammar of the calls
    ``plan`` allows. Every tool's schema is compiled, also with ``tool_choice: "none"``
    (a bad one is a 400 naming ``tools``); tools with ``response_format`` /
    ``structured_outputs`` are a 400, as both would constrain the output."""
    if not plan.tools:
        return fields
    other = "response_format or structured_outputs" if "structured_outputs" in fields else None
    try:
        spec = await run_in_threadpool(tool_calls.tool_constraint, plan,
                                       validator.compile_grammar, other)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param) from exc
    return fields if spec is None else {**fields, "structured_outputs": spec}
