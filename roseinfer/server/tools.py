"""Tool calling over HTTP: a chat body's tool fields onto ``roseinfer.tool_calls``.

The plan, grammar, prompt and parsing live in ``roseinfer.tool_calls`` (shared with
``LLM.chat(tools=...)``); here the pydantic request models become plain dicts and the
``InvalidRequestError`` of a bad tool request becomes a 400 naming its field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from starlette.concurrency import run_in_threadpool

from roseinfer import tool_calls
from roseinfer.engine.validation import InvalidRequestError
from roseinfer.server.errors import bad_request
from roseinfer.server.protocol import ChatCompletionRequest, ChatMessage, ToolDefinition
from roseinfer.tool_calls import ToolPlan, call_text

__all__ = ["call_text", "chat_conversation", "constrain_tools", "message_dicts",
           "plan_tool_dicts", "plan_tools", "tool_dicts"]


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """The body's tool request, checked (APIError 400 naming ``tools`` / ``tool_choice``)."""
    return plan_tool_dicts(tool_dicts(body.tools or ()), body.tool_choice,
                           body.parallel_tool_calls)


def plan_tool_dicts(tools: Sequence[Mapping[str, Any]] | None,
                    tool_choice: str | Mapping[str, Any] | None,
                    parallel_tool_calls: bool | None, names: Any = None) -> ToolPlan:
    """``tool_calls.plan_tools`` with its errors as 400s naming ``names.tools`` /
    ``names.tool_choice`` (a ``FieldNames``; None: OpenAI's names)."""
    try:
        return tool_calls.plan_tools(tools, tool_choice, parallel_tool_calls)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), _named(exc.param, names)) from exc


def _named(param: str | None, names: Any) -> str | None:
    """The API's own name of ``tools`` / ``tool_choice``."""
    if names is None or param not in ("tools", "tool_choice"):
        return param
    return getattr(names, param)


def tool_dicts(tools: Sequence[ToolDefinition]) -> list[dict[str, Any]]:
    """The request's tool models as OpenAI-shaped dicts (unset fields left out)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as OpenAI-shaped dicts (content parts joined)."""
    out = []
    for m in messages:
        entry = {"role": m.role, "content": m.text(), "name": m.name,
                 "tool_call_id": m.tool_call_id,
                 "tool_calls": [{"id": c.id, "type": "function", "function": {
                     "name": c.function.name, "arguments": c.function.arguments}}
                     for c in m.tool_calls or ()]}
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            entry["reasoning_content"] = reasoning
        out.append(entry)
    return out


def chat_conversation(messages: Sequence[ChatMessage], native: bool,
                      tools: Sequence[ToolDefinition] | None = None) -> list[dict[str, Any]]:
    """``tool_calls.conversation`` of the request models (template input)."""
    return tool_calls.conversation(
        message_dicts(messages), native,
        None if tools is None else tool_calls.parse_tools(tool_dicts(tools)))


async def constrain_tools(plan: ToolPlan, validator: Any, fields: dict[str, Any],
                          names: Any = None, *, strict: bool = True,
                          other_param: str = "response_format",
                          tokenizer: Any = None) -> dict[str, Any]:
    """``fields`` (SamplingParams constraints) with the grammar of the calls ``plan``
    allows (``tool_calls.tool_constraint``, off the event loop). Every tool's schema is
    compiled, also with ``tool_choice: "none"`` (a bad one is a 400 naming
    ``names.tools``). A ``structured_outputs`` already in ``fields`` (the request's
    ``other_param``) becomes the answer's constraint beside the calls. ``tokenizer``:
    the model's, for the tags' own tokens (``tool_calls.tag_tokens``)."""
    if not plan.tools:
        return fields
    answer = fields.get("structured_outputs")
    try:
        spec = await run_in_threadpool(
            partial(tool_calls.tool_constraint, strict=strict, answer=answer,
                    tags=tool_calls.tag_tokens(tokenizer)), plan,
            validator.compile_grammar, other_param if answer is not None else None)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), _named(exc.param, names)) from exc
    return fields if spec is None else {**fields, "structured_outputs": spec}
