"""A chat with tools as the model sees it: the tools' prompt and the conversation.

A chat template that renders ``tools`` (detected by rendering with and without a probe
tool) gets the tools, the assistant's calls and the ``tool`` messages as they are.
Otherwise the tools are listed in ``DEFAULT_TOOL_PROMPT`` (appended to the system
message, or as one), past calls are written as their ``<tool_call>`` text and a tool's
result is a user turn holding a ``<tool_response>`` block. Messages are OpenAI-shaped
dicts; a malformed one is an ``InvalidRequestError`` naming ``messages``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from roseinfer.engine.validation import InvalidRequestError
from roseinfer.outputs import ToolCall
from roseinfer.tool_calls.grammar import CLOSE, OPEN
from roseinfer.tool_calls.plan import Tool

# The system prompt for models whose chat template does not render tools (README).
DEFAULT_TOOL_PROMPT = (
    "You may call one or more functions to help with the user's request. The functions "
    "are described as JSON below, inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one block per call, each holding a JSON object with "
    "the function's name and its arguments:\n"
    '<tool_call>{{"name": <function-name>, "arguments": <arguments-json-object>}}'
    "</tool_call>"
)
_PROBE_TOOL = {"type": "function", "function": {
    "name": "roseinfer_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}
_OWN_KEYS = ("role", "content", "name", "tool_call_id", "tool_calls")


def tool_prompt(tools: Sequence[Tool]) -> str:
    """``DEFAULT_TOOL_PROMPT`` listing ``tools`` (one JSON object a line)."""
    listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return DEFAULT_TOOL_PROMPT.format(tools=listed)


def call_text(name: str, arguments: str) -> str:
    """A past call as the model would have written it (plain rendering)."""
    body = json.dumps({"name": name, "arguments": _json_or_text(arguments)},
                      ensure_ascii=False)
    return f"{OPEN}{body}{CLOSE}"


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


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


def conversation(messages: Sequence[Mapping[str, Any]], native: bool,
                 tools: Sequence[Tool] | None = None) -> list[dict[str, Any]]:
    """The messages as template input (``developer`` is ``system``, content parts are
    joined). ``native``: calls and ``tool`` messages go to the template as they are;
    else calls are written as ``<tool_call>`` text and tool results as a user turn
    holding a ``<tool_response>`` block. ``tools`` (when not native): the default tool
    prompt is added to the system message (or is the system message)."""
    conv: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages: message {i} must be an object with a "
                                      "role", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        text = _text(m.get("content"), i)
        entry: dict[str, Any] = {"role": role, "content": text}
        for key in ("name", "tool_call_id"):
            if m.get(key):
                entry[key] = m[key]
        entry.update((k, v) for k, v in m.items() if k not in _OWN_KEYS)
        calls = [_call(c, i) for c in m.get("tool_calls") or ()]
        if calls and native:
            entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": _json_or_text(c.arguments)}} for c in calls]
        elif calls:
            entry["content"] += "".join(call_text(c.name, c.arguments) for c in calls)
        if role == "tool" and not native:
            entry = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
        conv.append(entry)
    if tools:
        prompt = tool_prompt(tools)
        if conv and conv[0]["role"] == "system":
            conv[0] = {**conv[0], "content": f"{conv[0]['content']}\n\n{prompt}"}
        else:
            conv.insert(0, {"role": "system", "content": prompt})
    return conv


def _text(content: object, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and all(
            isinstance(p, Mapping) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidRequestError(f"messages: message {i} content must be a string or a list of "
                              "text parts", "messages")


def _call(call: object, i: int) -> ToolCall:
    """A past call: a ``ToolCall`` or OpenAI's ``{"id", "type", "function": {"name",
    "arguments"}}`` (arguments as JSON text, or as an object)."""
    if isinstance(call, ToolCall):
        return call
    function = call.get("function") if isinstance(call, Mapping) else None
    if isinstance(function, Mapping) and isinstance(function.get("arguments"), Mapping):
        function = {**function, "arguments": json.dumps(function["arguments"],
                                                        ensure_ascii=False)}
    if (not isinstance(call, Mapping) or not isinstance(call.get("id"), str)
            or not isinstance(function, Mapping) or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)):
        raise InvalidRequestError(f"messages: message {i} has a tool call that is not "
                                  '{"id", "type": "function", "function": {"name", '
                                  '"arguments"}}', "messages")
    return ToolCall(call["id"], function["name"], function["arguments"])


def _mentions_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool] | None) -> bool:
    return bool(tools) or any(isinstance(m, Mapping) and (m.get("tool_calls") or m.get(
        "role") == "tool") for m in messages)


def chat_text(tok: Any, messages: Sequence[Mapping[str, Any]],
              tools: Sequence[Tool] | None = None, add_generation_prompt: bool = True, *,
              continue_final_message: bool = False,
              template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text of a conversation through ``tok``'s chat template, with ``tools``
    shown to the model (the template probe runs only when tools or calls are present).
    ``template_kwargs`` are extra template variables (e.g. ``enable_thinking``);
    ``continue_final_message``: the last (assistant) message is left open, the text cut
    right after its content, for the model to go on writing it."""
    native = _mentions_tools(messages, tools) and template_renders_tools(tok)
    conv = conversation(messages, native, None if native else tools)
    generation = add_generation_prompt and not continue_final_message
    if (native and tools) or template_kwargs:
        extra = dict(template_kwargs or {})
        if native and tools:
            extra["tools"] = [t.openai() for t in tools]
        text = str(tok.hf.apply_chat_template(conv, tokenize=False,
                                              add_generation_prompt=generation, **extra))
    else:
        text = str(tok.apply_chat_template(conv, add_generation_prompt=generation))
    return _open_final(text, conv) if continue_final_message else text


def _open_final(text: str, conv: Sequence[Mapping[str, Any]]) -> str:
    """``text`` cut right after the last message's content (what transformers'
    ``continue_final_message`` does), so that message stays open."""
    final = str(conv[-1].get("content") or "")
    if not final.strip():
        raise InvalidRequestError("continue_final_message: the last message has no content "
                                  "to continue", "messages")
    end = text.rfind(final.strip())
    if end < 0:
        raise InvalidRequestError("continue_final_message: the chat template does not show "
                                  "the last message's content as it is", "messages")
    kept = final.lstrip()  # trailing whitespace is kept when the template kept it
    if text[end:end + len(kept)] != kept:
        kept = final.strip()
    return text[:end + len(kept)]


def chat_prompt_ids(tok: Any, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Tool] | None = None,
                    add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """``chat_text`` tokenized (no special tokens added: the template wrote them)."""
    text = chat_text(tok, messages, tools, add_generation_prompt,
                     continue_final_message=continue_final_message,
                     template_kwargs=template_kwargs)
    return tok.encode(text, add_special_tokens=False)
