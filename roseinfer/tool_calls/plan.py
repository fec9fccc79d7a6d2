"""Tools and ``tool_choice`` as OpenAI shapes them, checked into a ``ToolPlan``.

``parse_tools`` turns plain dicts (``{"type": "function", "function": {"name",
"description", "parameters", "strict"}}``) into ``Tool`` records; ``plan_tools`` adds
``tool_choice`` and ``parallel_tool_calls``. Bad input is an ``InvalidRequestError``
whose ``param`` is ``tools`` or ``tool_choice``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from roseinfer.engine.validation import InvalidRequestError

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_CHOICES = ("none", "auto", "required")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_BAD_CHOICE = ('tool_choice must be "none", "auto", "required" or {"type": "function", '
               '"function": {"name": ...}}')


@dataclass(frozen=True)
class Tool:
    """A function tool: ``parameters`` is its arguments' JSON schema (None: none)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def openai(self) -> dict[str, Any]:
        """The OpenAI shape, as templates and the default tool prompt show it (unset
        fields left out)."""
        function = {k: getattr(self, k) for k in _FUNCTION_KEYS if getattr(self, k) is not None}
        return {"type": "function", "function": function}

    @property
    def schema(self) -> dict[str, Any]:
        """The arguments' schema (an empty object's when ``parameters`` is unset)."""
        return EMPTY_PARAMETERS if self.parameters is None else self.parameters


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for: ``mode`` is none / auto / required (a named
    choice is ``required`` over that tool alone, one call: ``parallel`` False)."""

    tools: tuple[Tool, ...]
    mode: str
    allowed: tuple[Tool, ...]
    parallel: bool

    @property
    def active(self) -> bool:
        return self.mode != "none"


def parse_tools(tools: Sequence[Mapping[str, Any] | Tool] | None) -> tuple[Tool, ...]:
    """``Tool`` records of OpenAI-shaped tool dicts (``Tool`` records pass as they are)."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError("tools must be a list of tools", "tools")
    out = [t if isinstance(t, Tool) else _tool(i, t) for i, t in enumerate(tools)]
    names = [t.name for t in out]
    for name in names:
        if not NAME_RE.fullmatch(name):
            raise InvalidRequestError(
                f"tools: function name {name!r} must be 1 to 64 characters of a-z, A-Z, "
                "0-9, underscores and dashes", "tools")
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique", "tools")
    return tuple(out)


def _tool(i: int, tool: object) -> Tool:
    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"tools: tool {i} is invalid: {why}", "tools")

    if not isinstance(tool, Mapping):
        raise bad("a tool must be an object")
    if tool.get("type") != "function":
        raise bad('type must be "function"')
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise bad("function must be an object")
    extra = set(tool) - {"type", "function"} or set(function) - set(_FUNCTION_KEYS)
    if extra:
        raise bad(f"unknown field(s) {', '.join(sorted(map(str, extra)))}")
    name, description = function.get("name"), function.get("description")
    parameters, strict = function.get("parameters"), function.get("strict")
    if not isinstance(name, str):
        raise bad("function.name is required and must be a string")
    if description is not None and not isinstance(description, str):
        raise bad("function.description must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad("function.parameters must be a JSON schema object")
    if strict is not None and not isinstance(strict, bool):
        raise bad("function.strict must be a bool")
    return Tool(name, description, parameters, strict)


def plan_tools(tools: Sequence[Mapping[str, Any] | Tool] | None,
               tool_choice: str | Mapping[str, Any] | None = None,
               parallel_tool_calls: bool | None = None) -> ToolPlan:
    """The checked tool request. ``tool_choice`` None means ``auto`` with tools and
    ``none`` without; ``parallel_tool_calls`` None means True (OpenAI's defaults)."""
    parsed = parse_tools(tools)
    choice = tool_choice
    if choice is None:
        choice = "auto" if parsed else "none"
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise InvalidRequestError(_BAD_CHOICE, "tool_choice")
    if not parsed and choice != "none":
        raise InvalidRequestError("tool_choice is only allowed when tools are specified",
                                  "tool_choice")
    parallel = parallel_tool_calls is not False
    if isinstance(choice, str):
        return ToolPlan(parsed, choice, parsed, parallel)
    name = _named_choice(choice)
    chosen = tuple(t for t in parsed if t.name == name)
    if not chosen:
        raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in "
                                  "tools", "tool_choice")
    return ToolPlan(parsed, "required", chosen, False)  # a named function: one call


def _named_choice(choice: object) -> str:
    function = choice.get("function") if isinstance(choice, Mapping) else None
    if (not isinstance(choice, Mapping) or choice.get("type") != "function"
            or set(choice) != {"type", "function"} or not isinstance(function, Mapping)
            or set(function) != {"name"} or not isinstance(function["name"], str)):
        raise InvalidRequestError(_BAD_CHOICE, "tool_choice")
    return function["name"]
