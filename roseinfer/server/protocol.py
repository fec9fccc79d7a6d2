"""Pydantic models of the HTTP API: OpenAI request/response shapes plus our extras.

Requests are validated strictly (``"2"`` is not an int, ``true`` is not a number)
so wrong types are a 400 before anything is tokenized or queued. Nothing is silently
ignored: an unknown field is a 400 naming it (chat / completions bodies keep theirs
for the route to refuse in OpenAI's words), an OpenAI field roseinfer cannot honour
(functions, audio, ...) is a 400 unless its value asks for nothing, and only labels that
cannot change the output (``user``, ``metadata``, ...) are accepted and ignored.
Floats must be finite (JSON's ``NaN``/``Infinity`` literals are refused), every string
must be valid Unicode (``Text``: no lone surrogates, which ``json.loads`` lets through
from ``"\\ud800"`` or raw invalid UTF-8), and lists are bounded (the ``MAX_*``
constants, docs/reliability.md, "Limits").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from roseinfer.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from roseinfer.structured_outputs import MAX_CHOICES

# Documented bounds (docs/reliability.md, "Limits"), besides those of SamplingParams and the body size.
MAX_PROMPTS_PER_REQUEST = 256  # prompts in one /v1/completions request (a batch)
MAX_MESSAGES = 4096  # messages in one chat or /tokenize request
MAX_CONTENT_PARTS = 1024  # text parts in one chat message

_REQUEST = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
_TOP_REQUEST = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


def _valid_unicode(value: Any) -> Any:
    """Refuse lone surrogates: they cannot be tokenized or encoded back to UTF-8.

    It runs before the str validation, so every text field says the same thing
    (constrained strs would otherwise fail with a vaguer message of their own)."""
    if not isinstance(value, str):
        return value  # the str validation that follows refuses it
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_unicode",
            "Input should be valid Unicode text, found a lone surrogate {code} at index {index}",
            {"code": f"U+{ord(value[exc.start]):04X}", "index": exc.start},
        ) from None
    return value


Text = Annotated[str, BeforeValidator(_valid_unicode)]
TokenIds = list[Annotated[int, Field(ge=0)]]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS),
                       BeforeValidator(_valid_unicode)]
Role = Literal["system", "developer", "user", "assistant", "tool"]
JsonObject = dict[str, Any]


def _unsupported(reason: str, *neutral: Any) -> AfterValidator:
    """A field roseinfer does not implement: accepted only when null or one of the
    ``neutral`` values that ask for nothing, otherwise a 400 naming it."""

    def check(value: Any) -> Any:
        if value is None or any(value == n for n in neutral):
            return value
        raise PydanticCustomError("unsupported", reason)

    return AfterValidator(check)


_NO_FUNCTIONS = "functions / function_call are deprecated and not supported: use tools"
MAX_TOOLS = 128  # tools in one chat request


class FunctionDefinition(BaseModel):
    model_config = _REQUEST
    name: Text
    description: Text | None = None
    parameters: JsonObject | None = None  # a JSON schema; absent: no arguments
    strict: bool | None = None  # calls always follow the schema when tools constrain output


class ToolDefinition(BaseModel):
    model_config = _REQUEST
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(BaseModel):
    model_config = _REQUEST
    name: Text
    arguments: Text  # JSON text
    parsed_arguments: Any = None  # the openai SDK's parse() copy of arguments: ignored


class ToolCall(BaseModel):
    """A call in an assistant message (request) or in a response message."""

    model_config = _REQUEST
    id: Text
    type: Literal["function"] | None = "function"
    function: CalledFunction
    index: int | None = None  # a streamed call's position, as SDK stream helpers keep it


def _shaped(model: type[BaseModel], what: str) -> AfterValidator:
    """A list of JSON objects that must each be a ``model``: a 400 naming the list."""

    def check(value: list[Any] | None) -> list[Any] | None:
        if value is None:
            return None
        out = []
        for i, item in enumerate(value):
            try:
                out.append(model.model_validate(item))
            except ValueError as exc:
                first = exc.errors()[0] if hasattr(exc, "errors") else {}
                where = ".".join(str(p) for p in first.get("loc", ()))
                raise PydanticCustomError("invalid_" + what, "{what} {i} is invalid: {why}", {
                    "what": what, "i": i,
                    "why": f"{where}: {first.get('msg', exc)}" if where else str(exc)}) from None
        return out

    return AfterValidator(check)


class StreamOptions(BaseModel):
    model_config = _REQUEST
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # accepted; chunks never carry padding


class TextPart(BaseModel):
    model_config = _REQUEST
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = _REQUEST
    role: Role
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None  # passed to the chat template, as ``name`` is
    tool_calls: Annotated[list[JsonObject] | None, _shaped(ToolCall, "tool call")] = None
    function_call: Annotated[JsonObject | None, _unsupported(_NO_FUNCTIONS)] = None
    audio: Annotated[JsonObject | None, _unsupported("audio is not supported")] = None
    refusal: Annotated[Text | None, _unsupported(
        "refusal messages are not supported: send the text as content")] = None
    # What a response message carries, accepted back as it came (``message.model_dump()``):
    # the reasoning of a thinking model goes to the template; annotations (citations of
    # the reply itself) are labels and never shown to the model.
    reasoning_content: Text | None = None
    reasoning: Text | None = None  # vLLM's newer name of reasoning_content
    annotations: Annotated[list[JsonObject], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    parsed: Any = None  # the openai SDK's parse() result (the content, parsed): ignored

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``. The schema is always enforced (as with ``strict:
    true``); ``name`` and ``description`` are labels (the model is not shown them)."""

    model_config = _REQUEST
    name: Annotated[Text, Field(min_length=1, max_length=64)]
    description: Text | None = None
    schema_: JsonObject = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or
    ``json_schema`` (with ``json_schema``)."""

    model_config = _REQUEST
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` body field: exactly one kind (``json`` is a schema,
    as an object or its JSON text; ``grammar`` is Lark-like or GBNF)."""

    model_config = _REQUEST
    json_: JsonObject | Text | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: Annotated[list[Text], Field(max_length=MAX_CHOICES)] | None = None
    grammar: Text | None = None
    disable_any_whitespace: bool = False


LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]


class SamplingFields(BaseModel):
    """Fields shared by chat and completions (OpenAI's plus common extras)."""

    model_config = _TOP_REQUEST
    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # extras (vLLM-style)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: Annotated[TokenIds, Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # output constraints (mapped by roseinfer.server.structured)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: Annotated[dict[Text, LogitBias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: Annotated[TokenIds, Field(min_length=1,
                                                 max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None,
                        constraints: Mapping[str, Any] | None = None) -> SamplingParams:
        """SamplingParams from these fields plus ``constraints`` (the output-constraint
        fields, already mapped); ValueError on inconsistent values."""
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, **self.sampling_kwargs(),
                              **(constraints or {}))

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments of these fields (not ``max_tokens``,
        ``logprobs``, ``prompt_logprobs`` nor the output constraints)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return dict(
            n=self.n or 1,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            min_tokens=self.min_tokens or 0,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[JsonObject], Field(max_length=MAX_TOOLS),
                     _shaped(ToolDefinition, "tool")] | None = None
    tool_choice: Literal["none", "auto", "required"] | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    # extras (vLLM's chat options; docs/serving.md)
    chat_template_kwargs: dict[Text, Any] | None = None  # extra template variables
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open
    strict_tool_arguments: bool | None = None  # None: the server's --strict-tool-arguments
    # OpenAI features roseinfer does not implement: a 400 unless the value asks for nothing
    functions: Annotated[list[JsonObject] | None, _unsupported(_NO_FUNCTIONS, [])] = None
    function_call: Annotated[Literal["none", "auto"] | JsonObject | None,
                             _unsupported(_NO_FUNCTIONS, "none")] = None
    audio: Annotated[JsonObject | None, _unsupported("audio output is not supported")] = None
    modalities: Annotated[list[Literal["text", "audio"]] | None, _unsupported(
        'only text output is supported: modalities must be ["text"]', ["text"])] = None
    prediction: Annotated[JsonObject | None, _unsupported(
        "predicted outputs are not supported")] = None
    reasoning_effort: Annotated[Text | None, _unsupported(
        'this model does not reason: reasoning_effort must be "none"', "none")] = None
    verbosity: Annotated[Text | None, _unsupported("verbosity is not supported")] = None
    web_search_options: Annotated[JsonObject | None, _unsupported(
        "web search is not supported")] = None
    moderation: Annotated[JsonObject | None, _unsupported("moderation is not supported")] = None
    # labels: accepted and ignored (they cannot change what is generated)
    store: bool | None = None
    metadata: dict[Text, Text] | None = None
    service_tier: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    prompt_cache_options: JsonObject | None = None


class CompletionRequest(SamplingFields):
    # A text, a batch of texts, one token-id prompt or a batch of them.
    prompt: (Text | Annotated[list[Text], Field(max_length=MAX_PROMPTS_PER_REQUEST)] | TokenIds
             | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS_PER_REQUEST)])
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None  # refused unless empty (the route)
    best_of: int | None = Field(None, ge=1)  # only best_of == n (the route)


class GenerateRequest(BaseModel):
    """Body of the plain ``POST /generate`` endpoint."""

    model_config = _REQUEST
    prompt: Text | TokenIds
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_k: int = Field(0, ge=-1)
    top_p: float = Field(1.0, gt=0, le=1)
    stop_on_eos: bool = True
    do_sample: bool = True
    stream: bool = False


class TokenizeRequest(BaseModel):
    model_config = _REQUEST
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST
    model: Text | None = None
    tokens: TokenIds
