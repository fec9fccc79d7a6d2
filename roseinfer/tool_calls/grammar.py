"""The grammar of tool calls, and the constraint it puts on a request's output.

Calls are written ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block
per call). ``required`` constrains the whole output to such blocks (one, or one or more
with ``parallel_tool_calls``), a named tool to exactly one; ``auto`` lets the model write
text that never contains ``<tool_call>``, or text then calls — or, with a response
format, either calls or an answer matching it. Once a block opens its arguments must
match that tool's ``parameters`` schema (llguidance Lark with ``%json`` per tool),
closed to the declared properties unless the schema says otherwise (``strict_schema``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from roseinfer.engine.validation import InvalidRequestError
from roseinfer.structured_outputs import StructuredOutputsParams
from roseinfer.tool_calls.plan import ToolPlan

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tag_tokens(tokenizer: Any) -> tuple[int | None, int | None]:
    """The ids of ``<tool_call>`` / ``</tool_call>`` where the tokenizer has each as one
    token of its own (Qwen's): llguidance takes such added tokens as special, so the
    grammar must name them besides spelling the tag out."""
    out = []
    for tag in (OPEN, CLOSE):
        ids = tokenizer.encode(tag, add_special_tokens=False) if tokenizer is not None else []
        out.append(ids[0] if len(ids) == 1 else None)
    return out[0], out[1]


def tool_grammar(plan: ToolPlan, strict: bool = True, answer: str | None = None,
                 tags: tuple[int | None, int | None] = (None, None)) -> str:
    """The Lark grammar (llguidance) of the calls ``plan`` allows. ``strict``: arguments
    hold only the declared properties (``strict_schema``). ``answer``: a Lark rule body
    the text must match when the model answers instead of calling (``auto`` only; e.g.
    ``%json {...}`` for a response_format schema). ``tags``: ``tag_tokens``."""
    open_, close = (f'"{tag}"' if tid is None else f'("{tag}" | <[{tid}]>)'
                    for tag, tid in zip((OPEN, CLOSE), tags, strict=True))
    rules = []
    for i, tool in enumerate(plan.allowed):
        schema = strict_schema(tool.schema) if strict else tool.schema
        head = json.dumps('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
        rules.append(f'call_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    alternatives = " | ".join(f"call_{i}" for i in range(len(plan.allowed)))
    more = f' ("\\n"? {open_} body)*' if plan.parallel else ""
    if plan.mode == "auto" and answer is not None:
        start = [f"start: answer | {open_} calls", f"answer: {answer}"]
    elif plan.mode == "auto":
        token = "" if tags[0] is None else f" | TEXT <[{tags[0]}]> calls"
        start = [f"start: TEXT | TEXT_CALL calls{token}",
                 r"TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
                 r"TEXT_CALL: /(?s:.*)<tool_call>/ & ~/(?s:.*<tool_call>.*<tool_call>)/"]
    else:
        start = [f"start: {open_} calls"]
    return "\n".join([*start, f"calls: body{more}", f"body: ({alternatives}) {close}",
                      *rules]) + "\n"


def answer_rule(spec: StructuredOutputsParams) -> str | None:
    """The Lark rule body of a final answer constrained by ``spec`` when it is a JSON
    schema (``response_format`` json_schema, what agent frameworks send beside tools);
    None for the other kinds, which stay refused beside active tools."""
    kind, text, _ = spec.key
    return f"%json {text}" if kind == "json" else None


_SUBSCHEMA_KEYS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` added to every object schema
    that declares ``properties`` and says nothing of other keys (as OpenAI's strict
    mode requires): arguments then hold only the declared properties. A schema that
    sets ``additionalProperties`` / ``patternProperties`` / ``unevaluatedProperties``
    keeps its choice; ``allOf`` members are left as written (closing each would refuse
    the others' properties)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict_schema(out["additionalProperties"])
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def tool_constraint(plan: ToolPlan, compile_grammar: Callable[[StructuredOutputsParams], object],
                    other: str | None = None, *, strict: bool = True,
                    answer: StructuredOutputsParams | None = None,
                    tags: tuple[int | None, int | None] = (None, None),
                    ) -> StructuredOutputsParams | None:
    """The ``structured_outputs`` that constrains generation to the calls ``plan``
    allows (None when its mode is ``none``). Every tool's schema is compiled with
    ``compile_grammar`` (e.g. ``RequestValidator.compile_grammar``), also with
    ``tool_choice: "none"``: a bad one is an ``InvalidRequestError`` naming ``tools``.
    ``answer``: the constraint of a text answer (``response_format``); with ``auto``
    the output is either calls or such an answer, with ``required`` / a named tool it
    is calls (the answer comes in a later turn). ``other`` names a constraint the
    request has that cannot sit beside calls (anything but a JSON schema): active
    tools refuse it. ``strict``: ``strict_schema`` of every tool's arguments. ``tags``:
    the tags' own token ids (``tag_tokens``), when the tokenizer has them."""
    if not plan.tools:
        return None
    rule = None if answer is None else answer_rule(answer)
    if plan.active and other and (answer is None or rule is None):
        raise InvalidRequestError(f"tools can be combined with {other} only when it is a "
                                  "JSON schema (the answer's shape beside the calls)",
                                  "tools")
    check = plan if plan.active else ToolPlan(plan.tools, "required", plan.tools, True)
    try:
        spec = StructuredOutputsParams(grammar=tool_grammar(
            check, strict, rule if check.mode == "auto" else None, tags))
        compile_grammar(spec)
    except ValueError as exc:  # InvalidRequestError included
        message = str(exc).replace("structured_outputs: ", "", 1)
        raise InvalidRequestError(f"tools: a function's parameters schema cannot be used: "
                                  f"{message}", "tools") from exc
    return spec if plan.active else None
