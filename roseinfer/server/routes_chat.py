"""``POST /v1/chat/completions``: OpenAI's chat shapes over the chat pipeline.

The body becomes a ``ChatTurn`` (``chat_turn``); ``chat_pipeline`` checks, renders and
queues it; ``chat_events`` gives its output, which is shaped here into a
``chat.completion`` or a stream of ``chat.completion.chunk`` Server-Sent Events ending
in ``[DONE]``. Calls come as ``delta.tool_calls`` once each ``<tool_call>`` block
closes, the text outside blocks as content.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from roseinfer.server.chat_events import (
    ChatError,
    ChatEvent,
    ChatUsage,
    ChoiceFinish,
    ChoiceStart,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallStart,
    chat_events,
    collect_chat,
)
from roseinfer.server.chat_pipeline import ChatTurn, FieldNames, prepare_chat, submit_chat
from roseinfer.server.errors import bad_request, refuse_unknown_fields
from roseinfer.server.prompt_gate import get_gate
from roseinfer.server.protocol import ChatCompletionRequest
from roseinfer.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    Usage,
)
from roseinfer.server.routes_lora import resolve_model
from roseinfer.server.state import get_state
from roseinfer.server.streaming import SSE_DONE, StreamResponse, sse
from roseinfer.server.structured import constraint_fields, constraint_param
from roseinfer.server.tool_stream import call_args_delta, call_start_delta, message_calls
from roseinfer.server.tools import message_dicts, tool_dicts

router = APIRouter()


def chat_turn(body: ChatCompletionRequest) -> ChatTurn:
    """The API-neutral turn of a chat completions body (400 for a bad constraint)."""
    constraints = constraint_fields(body)
    structured = constraints.pop("structured_outputs", None)
    return ChatTurn(
        messages=message_dicts(body.messages),
        tools=tool_dicts(body.tools) if body.tools is not None else None,
        tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
        structured=structured, sampling={**body.sampling_kwargs(), **constraints},
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        chat_template_kwargs=body.chat_template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        strict_tool_arguments=body.strict_tool_arguments,
        fields=FieldNames(structured=constraint_param(body)))


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response | Any:
    arrival = time.monotonic()
    state = get_state(request)
    refuse_unknown_fields(body)
    model, lora = resolve_model(request, body.model)  # a LoRA adapter's name, or the base
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    prepared = await prepare_chat(state, get_gate(request), chat_turn(body), arrival)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = submit_chat(state, prepared, rid, lora)
    if body.stream:
        chunks = _chunks(chat_events(state, prepared, stream), rid, model, body.include_usage)
        return StreamResponse(chunks, on_close=stream.abort)
    result = await collect_chat(state, prepared, stream, request)
    choices = []
    for r in result.choices:
        content: str | None = r.content
        if prepared.tools_active:
            content = r.content or None
        message = AssistantMessage(content=content, reasoning_content=r.reasoning,
                                   tool_calls=message_calls(r.tool_calls))
        choices.append(ChatChoice(
            index=r.index, message=message, finish_reason=r.finish_reason,
            logprobs=None if r.logprobs is None else ChatLogprobs(content=r.logprobs)))
    return ChatCompletionResponse(id=rid, model=model, choices=choices, created=result.created,
                                  usage=Usage.of(result.prompt_tokens, result.completion_tokens,
                                                 result.cached_tokens))


async def _chunks(events: AsyncIterator[ChatEvent], rid: str, model: str,
                  include_usage: bool) -> AsyncIterator[str]:
    """The chat stream's SSE chunks of the pipeline's events."""
    created = int(time.time())
    exclude = None if include_usage else {"usage"}

    def chunk(index: int, delta: DeltaMessage, finish: str | None = None,
              logprobs: ChatLogprobs | None = None) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish,
                                 logprobs=logprobs)
        body = ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
        return sse(body.model_dump_json(exclude=exclude))

    async for event in events:
        if isinstance(event, ChoiceStart):
            yield chunk(event.index, DeltaMessage(role="assistant", content=""))
        elif isinstance(event, ReasoningDelta):
            yield chunk(event.index, DeltaMessage(reasoning_content=event.text))
        elif isinstance(event, TextDelta):
            yield chunk(event.index, DeltaMessage(content=event.text), logprobs=None
                        if event.logprobs is None else ChatLogprobs(content=event.logprobs))
        elif isinstance(event, ToolCallStart):
            yield chunk(event.index, call_start_delta(event.call_index, event.id, event.name))
        elif isinstance(event, ToolCallDelta):
            yield chunk(event.index, call_args_delta(event.call_index, event.arguments))
        elif isinstance(event, ChoiceFinish):
            yield chunk(event.index, DeltaMessage(), event.reason)
        elif isinstance(event, ChatUsage) and include_usage:
            usage = ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                        usage=Usage.of(event.prompt_tokens,
                                                       event.completion_tokens,
                                                       event.cached_tokens))
            yield sse(usage.model_dump_json())
        elif isinstance(event, ChatError):
            yield sse(event.error.body())
    yield SSE_DONE
