"""Request shapes of ``POST /v1/responses`` (OpenAI's Responses API), validated strictly.

The body keeps unknown top-level fields for the route to refuse by name (as chat does);
a few vLLM-style sampling extras (``PASS_THROUGH``) go on to the chat pipeline. Input
items are checked one by one (``input_items``), so an error names ``input.<i>.<field>``.
Every field the official SDK sends back from a response it received (``status``,
``annotations``, ``logprobs``, ``phase``, nulls, ...) is accepted; a field that would ask
for something roseinfer cannot do (images, built-in tools, ``truncation: "auto"``,
``background``, ...) is a 400 naming it (``unsupported``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from roseinfer.server.errors import APIError, bad_request
from roseinfer.server.protocol import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, JsonObject, Text

_ITEM = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
Status = Literal["in_progress", "completed", "incomplete"]
MAX_METADATA = 16  # OpenAI's bounds on metadata
MAX_METADATA_VALUE = 512

# Chat sampling fields accepted as extras (vLLM's Responses API takes them too): they are
# validated by the chat pipeline like any chat body's.
PASS_THROUGH = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "stop", "stop_token_ids", "logit_bias", "min_tokens",
                "ignore_eos")
_TEXT_PARTS = ("input_text", "output_text")


class TextPart(BaseModel):
    """``input_text`` or ``output_text`` (an assistant message sent back, with its
    ``annotations`` and ``logprobs``)."""

    model_config = _ITEM
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[JsonObject] | None = None
    logprobs: list[JsonObject] | None = None
    prompt_cache_breakpoint: JsonObject | None = None


class MessageItem(BaseModel):
    model_config = _ITEM
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]
    id: Text | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = _ITEM
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text  # JSON text
    id: Text | None = None
    status: Status | None = None
    namespace: Text | None = None
    caller: JsonObject | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _ITEM
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]
    id: Text | None = None
    status: Status | None = None
    name: Text | None = None
    namespace: Text | None = None
    caller: JsonObject | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class SummaryText(BaseModel):
    model_config = _ITEM
    type: Literal["summary_text"]
    text: Text


class ReasoningText(BaseModel):
    model_config = _ITEM
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(BaseModel):
    """A reasoning item sent back: its text goes to the next assistant turn."""

    model_config = _ITEM
    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # roseinfer never makes one, and cannot read another's
    status: Status | None = None

    def text(self) -> str:
        parts = self.content or self.summary
        return "".join(part.text for part in parts)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                      "function_call_output": FunctionCallOutputItem,
                                      "reasoning": ReasoningItem}


class FunctionTool(BaseModel):
    model_config = _ITEM
    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None  # calls always follow the schema (the tool grammar)


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (flat: ``name``,
    ``schema``, ``description``, ``strict``)."""

    model_config = _ITEM
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[Text, Field(min_length=1, max_length=64)] | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _ITEM
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    """``reasoning``: accepted; a thinking model's reasoning comes as reasoning items."""

    model_config = _ITEM
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(BaseModel):
    model_config = _ITEM
    include_obfuscation: bool | None = None  # accepted; events never carry padding


Metadata = Annotated[dict[Annotated[Text, Field(max_length=64)],
                          Annotated[Text, Field(max_length=MAX_METADATA_VALUE)]],
                     Field(max_length=MAX_METADATA)]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: Text | None = None
    input: Text | Annotated[list[JsonObject], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: Annotated[list[JsonObject], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Metadata | None = None
    store: bool | None = None  # None: true, as OpenAI's default
    previous_response_id: Text | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Text] | None = None
    # refused unless they ask for nothing (``unsupported``)
    top_logprobs: int | None = None
    background: bool | None = None
    conversation: Text | JsonObject | None = None
    prompt: JsonObject | None = None
    # labels: accepted, they cannot change what is generated
    user: Text | None = None
    max_tool_calls: int | None = Field(None, ge=0)  # counts built-in tool calls only
    service_tier: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None

    @property
    def stored(self) -> bool:
        return self.store is not False

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None


# include values that only ask for the outputs of built-in tools (never made here) or for
# encrypted reasoning (roseinfer's reasoning items carry their text instead)
_HARMLESS_INCLUDES = frozenset({
    "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs"})

_UNSUPPORTED: tuple[tuple[str, Callable[[ResponsesRequest], bool], str], ...] = (
    ("truncation", lambda b: b.truncation == "auto",
     'truncation "auto" is not supported: an input longer than the context is a 400; '
     'send "disabled"'),
    ("top_logprobs", lambda b: bool(b.top_logprobs), "top_logprobs is not supported"),
    ("background", lambda b: bool(b.background), "background responses are not supported"),
    ("conversation", lambda b: b.conversation is not None,
     "conversations are not supported: use previous_response_id or send the items"),
    ("prompt", lambda b: b.prompt is not None, "prompt templates are not supported"),
    ("include", lambda b: bool(set(b.include or ()) - _HARMLESS_INCLUDES),
     "include: only " + ", ".join(sorted(_HARMLESS_INCLUDES)) + " are supported"),
    ("text.verbosity", lambda b: b.text is not None and b.text.verbosity not in (None, "medium"),
     'text.verbosity is not supported: send "medium" or leave it out'),
)


def check_request(body: ResponsesRequest) -> None:
    """A 400 naming the first unknown field, or a field asking for what is not done."""
    for name in body.model_extra or {}:
        if name not in PASS_THROUGH:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    for param, asks, why in _UNSUPPORTED:
        if asks(body):
            raise bad_request(why, param)
    if body.input is None and body.previous_response_id is None:
        raise bad_request("'input' is a required field", "input")


def invalid(exc: ValidationError, where: str | None) -> APIError:
    """A pydantic error as a 400 naming the field (``where``: the path to the model)."""
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if not _is_tag(p))
    param = ".".join(p for p in (where, loc) if p) or None
    msg = first.get("msg", "invalid value")
    if param is None:
        return bad_request(msg)
    if first.get("type") == "missing":
        return bad_request(f"'{param}' is a required field", param)
    return bad_request(f"{param}: {msg}", param)


def _is_tag(part: Any) -> bool:
    """Union members add their type to an error's location ("str", "list[...]")."""
    return isinstance(part, str) and ("[" in part or part in ("str", "list"))


def _check_parts(parts: Any, where: str) -> None:
    """Only text parts: an image, file or audio part is a 400 naming it."""
    if not isinstance(parts, list):
        return
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in _TEXT_PARTS:
            raise bad_request(f"{where}.{k}: only text content is supported (input_text, "
                              f"output_text), not {kind!r}", f"{where}.{k}.type")


def input_items(body: ResponsesRequest) -> list[InputItem]:
    """The body's ``input`` as checked items (a string is one user message)."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=body.input)]
    out: list[InputItem] = []
    for i, raw in enumerate(body.input):
        where = f"input.{i}"
        kind = raw.get("type", "message")
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported "
                              f"(supported: {', '.join(_ITEMS)})", f"{where}.type")
        _check_parts(raw.get("content" if kind == "message" else "output"), where +
                     (".content" if kind == "message" else ".output"))
        try:
            out.append(model.model_validate(raw))  # type: ignore[arg-type]
        except ValidationError as exc:
            raise invalid(exc, where) from None
    return out


def function_tools(body: ResponsesRequest) -> list[FunctionTool]:
    """The body's tools; a built-in tool (web search, file search, ...) is a 400."""
    out = []
    for i, raw in enumerate(body.tools or ()):
        kind = raw.get("type")
        if kind != "function":
            raise bad_request(f"tools.{i}: tools of type {kind!r} are not supported: only "
                              f"function tools are (built-in tools run on OpenAI's side)",
                              f"tools.{i}.type")
        try:
            out.append(FunctionTool.model_validate(raw))
        except ValidationError as exc:
            raise invalid(exc, f"tools.{i}") from None
    return out
