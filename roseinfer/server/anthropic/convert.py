"""An Anthropic Messages request as the pipeline's chat turn (``ChatTurn`` fields).

Only shapes change here; what the turn means is checked once, by the pipeline (tools,
schemas, prompt length, sampling). The mapping:

- ``system`` (a string or text blocks, joined) and ``system``-role messages become
  system messages;
- a user message's ``tool_result`` blocks become ``tool`` messages (in order, before the
  text that follows them); the text of a result with ``is_error`` is prefixed
  ``"Error: "``;
- an assistant message's ``tool_use`` blocks become its ``tool_calls`` (``input`` as
  JSON text), its ``thinking`` blocks its ``reasoning_content``; ``redacted_thinking``
  is dropped;
- a conversation ending with an assistant message is a prefill: the reply continues it
  (``continue_final_message``);
- ``tool_choice`` auto / any / tool / none is OpenAI's auto / required / the named
  function / none, ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``;
- ``thinking`` enabled or adaptive turns the template's ``enable_thinking`` on; absent
  or disabled, off (Anthropic's default is no thinking);
- ``output_config.format``'s schema constrains the final text (``structured``).
"""

from __future__ import annotations

import json
from typing import Any

from roseinfer.server.anthropic.protocol import (
    ConversationFields,
    InputMessage,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from roseinfer.server.errors import bad_request
from roseinfer.structured_outputs import StructuredOutputsParams

ERROR_PREFIX = "Error: "
STRUCTURED_PARAM = "output_config.format"


def chat_messages(body: ConversationFields) -> list[dict[str, Any]]:
    """The conversation as OpenAI-shaped chat messages."""
    out: list[dict[str, Any]] = []
    system = body.system_text()
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        if message.role == "assistant":
            out.append(_assistant(message))
        else:
            out.extend(_user_or_system(message, i))
    return out


def _assistant(message: InputMessage) -> dict[str, Any]:
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.blocks():
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlock):
            raise bad_request(f"{block.type} blocks are not allowed in assistant messages",
                              "messages")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return out


def _user_or_system(message: InputMessage, i: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for block in message.blocks():
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock) and message.role == "user":
            if text:  # text before a result stays before it
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = block.text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": ERROR_PREFIX + result if block.is_error else result})
        else:
            raise bad_request(f"messages.{i}: {block.type} blocks are not allowed in "
                              f"{message.role} messages", "messages")
    if text or not out:
        out.append({"role": message.role, "content": "".join(text)})
    return out


def ends_with_prefill(body: ConversationFields) -> bool:
    return body.messages[-1].role == "assistant"


def tool_fields(body: ConversationFields) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` in OpenAI's shape."""
    if body.tools is None and body.tool_choice is None:
        return {}
    tools = [{"type": "function", "function": {k: v for k, v in (
        ("name", t.name), ("description", t.description), ("parameters", t.input_schema),
        ("strict", t.strict)) if v is not None}} for t in body.tools or ()]
    out: dict[str, Any] = {"tools": tools}
    choice = body.tool_choice
    if choice is None:
        return out
    if isinstance(choice, ToolChoiceNone):
        out["tool_choice"] = "none"
        return out
    if isinstance(choice, ToolChoiceTool):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = "required" if isinstance(choice, ToolChoiceAny) else "auto"
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def thinking_enabled(body: ConversationFields) -> bool:
    return body.thinking is not None and not isinstance(body.thinking, ThinkingDisabled)


def template_kwargs(body: ConversationFields) -> dict[str, Any]:
    return {"enable_thinking": thinking_enabled(body)}


def structured(body: ConversationFields) -> StructuredOutputsParams | None:
    """``output_config.format``'s schema as the constraint on the final text."""
    fmt = body.output_config.format if body.output_config else None
    if fmt is None:
        return None
    try:
        return StructuredOutputsParams(json=fmt.schema_)
    except ValueError as exc:
        raise bad_request(f"output_config.format: {exc}", STRUCTURED_PARAM) from exc


def check_thinking(body: ConversationFields) -> None:
    """Anthropic's rules: an enabled thinking budget is below ``max_tokens``, and a
    thinking reply cannot be forced to open with a call (``tool_choice`` any / tool)."""
    budget = getattr(body.thinking, "budget_tokens", None)
    max_tokens = getattr(body, "max_tokens", None)
    if budget is not None and max_tokens is not None and budget >= max_tokens:
        raise bad_request(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                          f"({max_tokens})", "thinking.budget_tokens")
    if thinking_enabled(body) and isinstance(body.tool_choice, ToolChoiceAny | ToolChoiceTool):
        raise bad_request("Thinking may not be enabled when tool_choice forces tool use "
                          "(any / tool): use auto or none, or disable thinking", "tool_choice")


def conversation_fields(body: ConversationFields) -> dict[str, Any]:
    """The chat turn's fields of the conversation alone (what ``count_tokens`` renders):
    messages, tools, the constraint and the template's options."""
    check_thinking(body)
    prefill = ends_with_prefill(body)
    return {"messages": chat_messages(body), **tool_fields(body),
            "structured": structured(body), "chat_template_kwargs": template_kwargs(body),
            "add_generation_prompt": not prefill, "continue_final_message": prefill}


def turn_fields(body: MessagesRequest) -> dict[str, Any]:
    """The whole request's chat turn fields (``ChatTurn`` keyword arguments)."""
    sampling = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                "stop": tuple(body.stop_sequences) if body.stop_sequences else None}
    return {**conversation_fields(body), "max_tokens": body.max_tokens,
            "sampling": {k: v for k, v in sampling.items() if v is not None}}
