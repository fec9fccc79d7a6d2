"""Tool calls in chat completions' shapes: a response message's calls and the stream's
``delta.tool_calls`` pieces (the pipeline's ``ToolCallStart`` / ``ToolCallDelta``).

Calls are parsed once, by ``ToolCallParser`` (``roseinfer.tool_calls``) inside the
pipeline's reader, so assembling the stream's deltas gives exactly the whole message.
"""

from __future__ import annotations

from collections.abc import Sequence

from roseinfer.outputs import ToolCall as MadeCall
from roseinfer.server.protocol import CalledFunction, ToolCall
from roseinfer.server.responses import DeltaFunction, DeltaMessage, DeltaToolCall
from roseinfer.tool_calls import ToolCallParser

__all__ = ["ToolCallParser", "call_args_delta", "call_start_delta", "message_calls"]


def message_calls(calls: Sequence[MadeCall]) -> list[ToolCall] | None:
    """A response message's ``tool_calls`` (None when there are none)."""
    return [ToolCall(id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments))
            for c in calls] or None


def call_start_delta(index: int, call_id: str, name: str) -> DeltaMessage:
    """A call's first piece: its id, type and name."""
    return DeltaMessage(tool_calls=[DeltaToolCall(
        index=index, id=call_id, type="function", function=DeltaFunction(name=name,
                                                                         arguments=""))])


def call_args_delta(index: int, arguments: str) -> DeltaMessage:
    """A piece of a call's arguments."""
    return DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=DeltaFunction(
        arguments=arguments))])
