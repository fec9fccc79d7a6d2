"""Tool calling, independent of the model and of HTTP: OpenAI-shaped tools checked into
a plan (``plan``), the grammar that constrains calls (``grammar``), the conversation as
the model sees it (``render``) and generated text parsed back into calls (``parse``).

The server (``roseinfer.server.tools`` / ``tool_stream``) and ``LLM.chat(tools=...)``
share it, so a request gets the same prompt, grammar and calls through both.
"""

from __future__ import annotations

from roseinfer.outputs import ToolCall
from roseinfer.tool_calls.grammar import (
    CLOSE,
    OPEN,
    answer_rule,
    strict_schema,
    tag_tokens,
    tool_constraint,
    tool_grammar,
)
from roseinfer.tool_calls.parse import (
    ParsedCall,
    ToolCallParser,
    finish_reason,
    new_call_id,
    parse_call,
    parse_tool_calls,
    with_tool_calls,
)
from roseinfer.tool_calls.plan import Tool, ToolPlan, parse_tools, plan_tools
from roseinfer.tool_calls.render import (
    DEFAULT_TOOL_PROMPT,
    call_text,
    chat_prompt_ids,
    chat_text,
    conversation,
    template_renders_tools,
    tool_prompt,
)

__all__ = [
    "CLOSE", "DEFAULT_TOOL_PROMPT", "OPEN", "ParsedCall", "Tool", "ToolCall", "ToolCallParser",
    "ToolPlan", "answer_rule", "call_text", "chat_prompt_ids", "chat_text", "conversation", "finish_reason",
    "new_call_id", "parse_call", "parse_tool_calls", "parse_tools", "plan_tools",
    "strict_schema", "tag_tokens", "template_renders_tools", "tool_constraint", "tool_grammar", "tool_prompt",
    "with_tool_calls",
]
