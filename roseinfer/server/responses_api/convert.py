"""A Responses request as the chat pipeline's ``ChatTurn``, and a response's output as
the items a client sends back.

``instructions`` become the first system message; the conversation's items become chat
messages (an assistant message and the ``function_call`` items after it are one
assistant message with ``tool_calls``; a ``function_call_output`` is a ``tool`` message;
a ``reasoning`` item is the next assistant message's ``reasoning_content``). Function
tools take the chat shape, ``text.format`` becomes the chat ``response_format`` and
``max_output_tokens`` the turn's ``max_tokens``. Sampling fields (and the
``PASS_THROUGH`` extras) go through the chat body's own model (``SamplingFields``), so
they are checked and mapped exactly as for chat; errors name this API's fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from roseinfer.server.chat_pipeline import ChatTurn, FieldNames
from roseinfer.server.errors import APIError, bad_request
from roseinfer.server.protocol import SamplingFields
from roseinfer.server.responses_api.objects import (
    FunctionCall,
    OutputItem,
    OutputMessage,
    Reasoning,
)
from roseinfer.server.responses_api.protocol import (
    PASS_THROUGH,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextFormat,
    invalid,
)
from roseinfer.server.structured import constraint_fields

FIELDS = FieldNames(messages="input", tools="tools", tool_choice="tool_choice",
                    structured="text.format")
_FORMAT = "response_format"  # what the chat fields call text.format


def _renamed(error: APIError) -> APIError:
    """A chat field's error as this API names the field (``text.format`` is flat)."""
    def rename(text: str) -> str:
        return text.replace(f"{_FORMAT}.json_schema.", "text.format.").replace(
            f"{_FORMAT}.json_schema", "text.format").replace(_FORMAT, "text.format")

    return APIError(error.status_code, rename(error.message), type=error.type,
                    param=None if error.param is None else rename(error.param),
                    code=error.code, headers=error.headers)


def chat_messages(items: Sequence[InputItem], instructions: str | None) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat message dicts (the ``ChatTurn``'s)."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        out.append({"role": "system", "content": instructions})
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn

    def assistant(content: str | None) -> dict[str, Any]:
        nonlocal reasoning
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        out.append(message)
        return message

    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
        elif isinstance(item, MessageItem) and item.role == "assistant":
            assistant(item.text())
        elif isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or reasoning is not None:
                last = assistant(None)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def _tool(tool: FunctionTool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description,
                "parameters": tool.parameters, "strict": tool.strict}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and set(choice) == {"type", "name"} and isinstance(
            choice["name"], str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                      '"name": ...} (built-in tools and allowed_tools are not supported)',
                      "tool_choice")


def _response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    """``text.format`` as the chat ``response_format``."""
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    for field, value in (("name", fmt.name), ("schema", fmt.schema_)):
        if value is None:
            raise bad_request(f"text.format.{field} is required when type is 'json_schema'",
                              f"text.format.{field}")
    schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description,
              "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items()
                                                   if v is not None}}


def _sampling(body: ResponsesRequest) -> tuple[dict[str, Any], Any]:
    """(SamplingParams fields, the structured-output constraint or None)."""
    raw = {k: v for k, v in (body.model_extra or {}).items() if k in PASS_THROUGH}
    raw.update(temperature=body.temperature, top_p=body.top_p,
               response_format=_response_format(body.format))
    try:
        fields = SamplingFields.model_validate(raw)
    except ValidationError as exc:
        raise _renamed(invalid(exc, None)) from None
    try:
        constraints = constraint_fields(fields)
    except APIError as exc:
        raise _renamed(exc) from None
    structured = constraints.pop("structured_outputs", None)
    return {**fields.sampling_kwargs(), **constraints}, structured


def chat_turn(body: ResponsesRequest, items: Sequence[InputItem],
              tools: Sequence[FunctionTool]) -> ChatTurn:
    """This turn for the chat pipeline (``items``: the whole conversation so far)."""
    sampling, structured = _sampling(body)
    effort = body.reasoning.effort if body.reasoning is not None else None
    return ChatTurn(
        messages=chat_messages(items, body.instructions),
        tools=[_tool(t) for t in tools] if tools else None,
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        structured=structured, sampling=sampling, max_tokens=body.max_output_tokens,
        # effort "none": a thinking model's template is asked not to think
        chat_template_kwargs={"enable_thinking": False} if effort == "none" else None,
        fields=FIELDS)


def output_items(output: Sequence[OutputItem]) -> list[InputItem]:
    """A response's output as the items a client sends back for the next turn."""
    out: list[InputItem] = []
    for item in output:
        if isinstance(item, OutputMessage):
            out.append(MessageItem(role="assistant", content="".join(
                part.text for part in item.content), id=item.id, status=item.status))
        elif isinstance(item, FunctionCall):
            out.append(FunctionCallItem(type="function_call", call_id=item.call_id,
                                        name=item.name, arguments=item.arguments, id=item.id,
                                        status=item.status))
        elif isinstance(item, Reasoning):
            out.append(ReasoningItem.model_validate(item.model_dump(mode="json")))
    return out
