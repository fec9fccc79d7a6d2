"""Pydantic models of Anthropic's Messages API requests (``POST /v1/messages`` and
``/v1/messages/count_tokens``).

Validated like the OpenAI bodies (``roseinfer.server.protocol``): strict types, finite
floats, valid Unicode, bounded lists. What the official ``anthropic`` SDK sends is
accepted, nulls included (a response's blocks sent back as they came: ``citations:
null``, ``caller``); labels that cannot change the output (``metadata``,
``cache_control``, ``service_tier``, ...) are accepted and ignored; a field or block
roseinfer cannot honour (images, documents, server tools, ``container``, ...) or does
not know is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from roseinfer.sampling_params import MAX_STOP_STRINGS
from roseinfer.server.protocol import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TOOLS,
    JsonObject,
    StopString,
    Text,
    _unsupported,  # null or a neutral value, else a 400
)

_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
# Block types of Anthropic's API that roseinfer does not take, and why (a 400 naming them).
_UNSUPPORTED_BLOCKS = {
    "image": "image blocks are not supported (text-only models)",
    "document": "document blocks are not supported: send the text as a text block",
    "search_result": "search_result blocks are not supported: send the text as a text block",
    "container_upload": "container_upload blocks are not supported",
    "tool_reference": "tool_reference blocks are not supported",
}
_SERVER_BLOCK_SUFFIXES = ("server_tool_use", "_tool_result")


def _block_type(allowed: tuple[str, ...]) -> BeforeValidator:
    """Refuse a block whose ``type`` is not ``allowed``, saying why in words (instead of
    pydantic's list of union tags)."""

    def check(value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if not isinstance(kind, str) or kind in allowed:
            return value
        reason = _UNSUPPORTED_BLOCKS.get(kind)
        if reason is None and kind.endswith(_SERVER_BLOCK_SUFFIXES) and kind != "tool_result":
            reason = f"{kind} blocks (server tools) are not supported"
        raise PydanticCustomError("unsupported_block", reason or "{kind} blocks are not "
                                  "allowed here (expected: {allowed})",
                                  {"kind": kind, "allowed": ", ".join(allowed)})

    return BeforeValidator(check)


class TextBlock(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: Text
    cache_control: JsonObject | None = None  # prompt caching is automatic here
    citations: list[JsonObject] | None = None  # a response's citations sent back: ignored


class ToolUseBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: JsonObject
    cache_control: JsonObject | None = None
    caller: JsonObject | None = None  # who made the call: a label
    toolset_name: Annotated[Text | None, _unsupported("toolsets are not supported")] = None


ToolResultPart = Annotated[TextBlock, _block_type(("text",))]


class ToolResultBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | Annotated[list[ToolResultPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    is_error: bool | None = None
    cache_control: JsonObject | None = None
    toolset_name: Annotated[Text | None, _unsupported("toolsets are not supported")] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ThinkingBlock(BaseModel):
    model_config = _STRICT
    type: Literal["thinking"]
    thinking: Text
    signature: Text  # ours are empty; any value is accepted back


class RedactedThinkingBlock(BaseModel):
    """Never produced here; accepted from a conversation held elsewhere and dropped."""

    model_config = _STRICT
    type: Literal["redacted_thinking"]
    data: Text


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
ContentBlock = Annotated[
    Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
              Field(discriminator="type")],
    _block_type(_BLOCK_TYPES)]
SystemBlock = Annotated[TextBlock, _block_type(("text",))]


class InputMessage(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant", "system"]
    content: Text | Annotated[list[ContentBlock], Field(max_length=MAX_CONTENT_PARTS)]

    def blocks(self) -> list[Any]:
        """The content as blocks (a string is one text block)."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


def _custom_tool_only(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind is not None and kind != "custom":
        raise PydanticCustomError("unsupported_tool", "{kind} tools (server tools) are not "
                                  'supported: only custom tools (type "custom" or absent)',
                                  {"kind": str(kind)})
    return value


class Tool(BaseModel):
    """A custom (client) tool. Its calls always follow ``input_schema`` (as with
    ``strict: true``)."""

    model_config = _STRICT
    name: Text
    input_schema: JsonObject
    description: Text | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: JsonObject | None = None
    eager_input_streaming: bool | None = None  # how arguments stream: they come whole here
    input_examples: Annotated[list[JsonObject] | None, _unsupported(
        "input_examples are not supported: describe the input in description", [])] = None
    defer_loading: Annotated[bool | None, _unsupported(
        "defer_loading is not supported", False)] = None
    allowed_callers: Annotated[list[Text] | None, _unsupported(
        'allowed_callers other than ["direct"] are not supported', ["direct"])] = None


class _ToolChoice(BaseModel):
    model_config = _STRICT
    disable_parallel_tool_use: bool | None = None  # true: at most one call


class ToolChoiceAuto(_ToolChoice):
    type: Literal["auto"]


class ToolChoiceAny(_ToolChoice):
    type: Literal["any"]


class ToolChoiceTool(_ToolChoice):
    type: Literal["tool"]
    name: Text


class ToolChoiceNone(BaseModel):
    model_config = _STRICT
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]
ThinkingDisplay = Literal["summarized", "omitted"]


class _ThinkingOn(BaseModel):
    model_config = _STRICT
    display: ThinkingDisplay | None = None  # "omitted": the block comes back empty


class ThinkingEnabled(_ThinkingOn):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)  # Anthropic's minimum; must be below max_tokens


class ThinkingAdaptive(_ThinkingOn):
    type: Literal["adaptive"]


class ThinkingDisabled(BaseModel):
    model_config = _STRICT
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled,
                     Field(discriminator="type")]


class OutputFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_schema"]
    schema_: JsonObject = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = _STRICT
    format: OutputFormat | None = None  # the final text follows this JSON schema
    effort: Annotated[Text | None, _unsupported("effort is not supported")] = None


class Metadata(BaseModel):
    model_config = _STRICT
    user_id: Text | None = None


class ConversationFields(BaseModel):
    """What both routes read: the conversation, its tools and how the model thinks."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False,
                              populate_by_name=True)
    model: Text
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | Annotated[list[SystemBlock], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tools: Annotated[list[Annotated[Tool, BeforeValidator(_custom_tool_only)]],
                     Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # labels: accepted and ignored (they cannot change what is generated)
    cache_control: JsonObject | None = None
    speed: Literal["standard", "fast"] | None = None
    diagnostics: JsonObject | None = None
    container: Annotated[Any, _unsupported("containers (code execution) are not supported")] = None

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(block.text for block in self.system)


class MessagesRequest(ConversationFields):
    """Body of ``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: Text | None = None


class CountTokensRequest(ConversationFields):
    """Body of ``POST /v1/messages/count_tokens``."""
