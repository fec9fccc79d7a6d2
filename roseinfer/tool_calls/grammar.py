"""The grammar of tool calls, and the constraint it puts on a request's output.

Calls are written ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block
per call). ``required`` / a named tool constrain the whole output to such blocks (one, or
one or more with ``parallel_tool_calls``); ``auto`` lets the model write text that never
contains ``<tool_call>``, or text then calls, and once a block opens its arguments must
match that tool's ``parameters`` schema (llguidance Lark with ``%json`` per tool).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from roseinfer.engine.validation import InvalidRequestError
from roseinfer.structured_outputs import StructuredOutputsParams
from roseinfer.tool_calls.plan import ToolPlan

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_grammar(plan: ToolPlan) -> str:
    """The Lark grammar (llguidance) of the calls ``plan`` allows."""
    rules = []
    for i, tool in enumerate(plan.allowed):
        head = json.dumps('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
        rules.append(f'call_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(tool.schema, ensure_ascii=False)}")
    alternatives = " | ".join(f"call_{i}" for i in range(len(plan.allowed)))
    more = ' ("\\n"? "<tool_call>" body)*' if plan.parallel else ""
    if plan.mode == "auto":
        start = ["start: TEXT | TEXT_CALL calls",
                 r"TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
                 r"TEXT_CALL: /(?s:.*)<tool_call>/ & ~/(?s:.*<tool_call>.*<tool_call>)/"]
    else:
        start = ['start: "<tool_call>" calls']
    return "\n".join([*start, f"calls: body{more}", f'body: ({alternatives}) "</tool_call>"',
                      *rules]) + "\n"


def tool_constraint(plan: ToolPlan, compile_grammar: Callable[[StructuredOutputsParams], object],
                    other: str | None = None) -> StructuredOutputsParams | None:
    """The ``structured_outputs`` that constrains generation to the calls ``plan``
    allows (None when its mode is ``none``). Every tool's schema is compiled with
    ``compile_grammar`` (e.g. ``RequestValidator.compile_grammar``), also with
    ``tool_choice: "none"``: a bad one is an ``InvalidRequestError`` naming ``tools``.
    ``other`` names a constraint the request already has (e.g. ``response_format``),
    which active tools refuse, as both would constrain the output."""
    if not plan.tools:
        return None
    if plan.active and other:
        raise InvalidRequestError(f"tools cannot be combined with {other}: send one of them",
                                  "tools")
    check = plan if plan.active else ToolPlan(plan.tools, "required", plan.tools, True)
    try:
        spec = StructuredOutputsParams(grammar=tool_grammar(check))
        compile_grammar(spec)
    except ValueError as exc:  # InvalidRequestError included
        message = str(exc).replace("structured_outputs: ", "", 1)
        raise InvalidRequestError(f"tools: a function's parameters schema cannot be used: "
                                  f"{message}", "tools") from exc
    return spec if plan.active else None
