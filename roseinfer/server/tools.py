"""Tool calling: the tools' prompt, the grammar of tool calls, and parsing them back.

Calls are written ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block
per call). ``required`` / a named tool constrain the whole output to such blocks (one, or
one or more with ``parallel_tool_calls``); ``auto`` lets the model write text that never
contains ``<tool_call>``, or text then calls, and once a block opens its arguments must
match that tool's ``parameters`` schema (llguidance Lark with ``%json`` per tool).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from roseinfer.engine.validation import InvalidRequestError
from roseinfer.server.errors import bad_request
from roseinfer.server.protocol import ChatCompletionRequest, ToolDefinition
from roseinfer.structured_outputs import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

# The system prompt for models whose chat template does not render tools (README).
DEFAULT_TOOL_PROMPT = (
    "You may call one or more functions to help with the user's request. The functions "
    "are described as JSON below, inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one block per call, each holding a JSON object with "
    "the function's name and its arguments:\n"
    '<tool_call>{{"name": <function-name>, "arguments": <arguments-json-object>}}'
    "</tool_call>"
)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for: ``mode`` is none / auto / required (a named
    choice is ``required`` over that tool alone)."""

    tools: tuple[ToolDefinition, ...]
    mode: str
    allowed: tuple[ToolDefinition, ...]
    parallel: bool

    @property
    def active(self) -> bool:
        return self.mode != "none"


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """The body's tool request, checked (APIError 400 naming ``tools`` / ``tool_choice``)."""
    tools = tuple(body.tools or ())
    names = [t.function.name for t in tools]
    for name in names:
        if not NAME_RE.fullmatch(name):
            raise bad_request(f"tools: function name {name!r} must be 1 to 64 characters of "
                              "a-z, A-Z, 0-9, underscores and dashes", "tools")
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools and choice != "none":
        raise bad_request("tool_choice is only allowed when tools are specified", "tool_choice")
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, str):
        return ToolPlan(tools, choice, tools, parallel)
    name = _named_choice(choice)
    chosen = tuple(t for t in tools if t.function.name == name)
    if not chosen:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools",
                          "tool_choice")
    return ToolPlan(tools, "required", chosen, parallel)


def _named_choice(choice: dict[str, Any]) -> str:
    function = choice.get("function")
    if (choice.get("type") != "function" or set(choice) != {"type", "function"}
            or not isinstance(function, dict) or set(function) != {"name"}
            or not isinstance(function["name"], str)):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                          '"function", "function": {"name": ...}}', "tool_choice")
    return function["name"]


def tool_json(tool: ToolDefinition) -> dict[str, Any]:
    """The OpenAI shape of a tool, as templates and the default prompt show it."""
    return tool.model_dump(exclude_none=True)


def tool_prompt(tools: tuple[ToolDefinition, ...]) -> str:
    """``DEFAULT_TOOL_PROMPT`` listing ``tools`` (one JSON object a line)."""
    listed = "\n".join(json.dumps(tool_json(t), ensure_ascii=False) for t in tools)
    return DEFAULT_TOOL_PROMPT.format(tools=listed)


def call_text(name: str, arguments: str) -> str:
    """A past call as the model would have written it (plain rendering)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{OPEN}{body}{CLOSE}"


def tool_grammar(plan: ToolPlan) -> str:
    """The Lark grammar (llguidance) of the calls ``plan`` allows."""
    rules = []
    for i, tool in enumerate(plan.allowed):
        schema = tool.function.parameters
        schema = EMPTY_PARAMETERS if schema is None else schema
        head = json.dumps('{"name": ' + json.dumps(tool.function.name) + ', "arguments": ')
        rules.append(f'call_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def parse_call(block: str) -> ParsedCall | None:
    """The call inside one ``<tool_call>`` block (None if it is not a call)."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (
            "arguments" not in obj):
        return None
    return ParsedCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


# ------------------------------------------------------------------- rendering
_PROBE_TOOL = {"type": "function", "function": {
    "name": "roseinfer_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}


def template_renders_tools(tok: Any) -> bool:
    """Whether the model's chat template shows ``tools`` (a conversation rendered with
    and without one differs); such templates also get calls and tool messages as is."""
    hf = getattr(tok, "hf", None)
    if not getattr(hf, "chat_template", None):
        return False
    probe = [{"role": "user", "content": "hi"}]
    try:
        plain = hf.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        with_tools = hf.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False,
                                            add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        return False
    return plain != with_tools


def chat_conversation(messages: Any, native: bool,
                      tools: Any = None) -> list[dict[str, Any]]:
    """The messages as template input. ``native``: calls and ``tool`` messages go to the
    template as is; else calls are written as ``<tool_call>`` text and tool results as
    a user turn holding a ``<tool_response>`` block. ``tools`` (when not native): the
    default tool prompt is added to the system message (or is the system message)."""
    conv: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": m.text()}
        for key, value in (("name", m.name), ("tool_call_id", m.tool_call_id)):
            if value:
                entry[key] = value
        if m.tool_calls and native:
            entry["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        elif m.tool_calls:
            entry["content"] += "".join(call_text(c.function.name, c.function.arguments)
                                        for c in m.tool_calls)
        if role == "tool" and not native:
            entry = {"role": "user",
                     "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        conv.append(entry)
    if tools:
        prompt = tool_prompt(tuple(tools))
        if conv and conv[0]["role"] == "system":
            conv[0] = {**conv[0], "content": f"{conv[0]['content']}\n\n{prompt}"}
        else:
            conv.insert(0, {"role": "system", "content": prompt})
    return conv


def _template_call(call: Any) -> dict[str, Any]:
    """A call as HF templates expect it: ``arguments`` as an object when it is JSON."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


# ------------------------------------------------------------------- constraint
async def tool_constraint(plan: ToolPlan, validator: Any,
                          fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (the body's SamplingParams constraints) with the grammar of the calls
    ``plan`` allows. Every tool's schema is compiled, also with ``tool_choice: "none"``
    (a bad one is a 400 naming ``tools``); tools with ``response_format`` /
    ``structured_outputs`` are a 400, as both would constrain the output."""
    if not plan.tools:
        return fields
    if plan.active and "structured_outputs" in fields:
        raise bad_request("tools cannot be combined with response_format or "
                          "structured_outputs: send one of them", "tools")
    check = plan if plan.active else ToolPlan(plan.tools, "required", plan.tools, True)
    try:
        spec = StructuredOutputsParams(grammar=tool_grammar(check))
        await run_in_threadpool(validator.compile_grammar, spec)
    except (ValueError, InvalidRequestError) as exc:
        message = str(exc).replace("structured_outputs: ", "", 1)
        raise bad_request(f"tools: a function's parameters schema cannot be used: {message}",
                          "tools") from exc
    return {**fields, "structured_outputs": spec} if plan.active else fields
