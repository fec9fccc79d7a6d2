"""Tool calls in chat responses: the whole message, and the stream's call deltas.

Both come from one ``ToolCallParser`` (``roseinfer.tool_calls``), so assembling the
stream's deltas gives exactly the non-streamed message.
"""

from __future__ import annotations

from roseinfer.server.protocol import CalledFunction, ToolCall
from roseinfer.server.responses import AssistantMessage, DeltaFunction, DeltaMessage, DeltaToolCall
from roseinfer.tool_calls import (
    ParsedCall,
    ToolCallParser,
    finish_reason,
    new_call_id,
    parse_tool_calls,
)

__all__ = ["ToolCallParser", "call_deltas", "finish_reason", "tool_message"]


def tool_message(text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
    """The whole response's message and finish reason (``tool_calls`` when it stopped
    after making calls)."""
    content, calls = parse_tool_calls(text)
    tool_calls = [ToolCall(id=new_call_id(), function=CalledFunction(name=c.name,
                                                                     arguments=c.arguments))
                  for c in calls]
    return (AssistantMessage(content=content or None, tool_calls=tool_calls or None),
            finish_reason(reason, bool(calls)))


def call_deltas(calls: list[ParsedCall], first_index: int) -> list[DeltaMessage]:
    """The stream's deltas of completed calls: id, type and name, then the arguments."""
    out = []
    for k, call in enumerate(calls, first_index):
        out.append(DeltaMessage(tool_calls=[DeltaToolCall(
            index=k, id=new_call_id(), type="function",
            function=DeltaFunction(name=call.name, arguments=""))]))
        out.append(DeltaMessage(tool_calls=[DeltaToolCall(
            index=k, function=DeltaFunction(arguments=call.arguments))]))
    return out
