"""Response shapes of the Responses API: the ``response`` object, its output items
(``message`` with ``output_text`` parts, ``function_call``, ``reasoning``) and ``usage``,
as OpenAI's reference and the official SDK's models define them; ``echoed`` gives the
request parameters a response repeats back."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from roseinfer.server.responses_api.protocol import FunctionTool, ResponsesRequest, TextFormat

Status = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: Status = "in_progress"


class ReasoningPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class Reasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningPart] = Field(default_factory=list)
    encrypted_content: None = None
    status: Status = "in_progress"


OutputItem = OutputMessage | FunctionCall | Reasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int = 0,
           reasoning_tokens: int = 0) -> ResponseUsage:
        return cls(input_tokens=input_tokens, output_tokens=output_tokens,
                   total_tokens=input_tokens + output_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: Literal["server_error", "invalid_prompt"]
    message: str


class ResponseObject(BaseModel):
    """The ``response`` object. ``output_text`` is not here: the SDKs compute it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # the request's parameters, echoed (``echoed``)
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"},
                                                          "verbosity": "medium"})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None
    background: bool = False
    service_tier: str = "default"
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


def _tool(tool: FunctionTool) -> dict[str, Any]:
    # calls always follow the tool's schema (the tool grammar): strict, whatever was asked
    return {"type": "function", "name": tool.name, "description": tool.description,
            "parameters": tool.parameters, "strict": True}


def _format(fmt: TextFormat | None) -> dict[str, Any]:
    if fmt is None or fmt.type != "json_schema":
        return {"type": "text" if fmt is None else fmt.type}
    return {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_,
            "description": fmt.description, "strict": True}


def echoed(body: ResponsesRequest, tools: list[FunctionTool]) -> dict[str, Any]:
    """``ResponseObject`` fields repeating the request (OpenAI's defaults where unset)."""
    reasoning = body.reasoning
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": dict(body.metadata or {}),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": reasoning.effort if reasoning else None,
                      "summary": (reasoning.summary or reasoning.generate_summary)
                      if reasoning else None},
        "store": body.stored,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": _format(body.format), "verbosity": "medium"},
        "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
        "tools": [_tool(t) for t in tools],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
    }
