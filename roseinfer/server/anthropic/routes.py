"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's shapes over
the chat pipeline.

The body becomes a ``ChatTurn`` (``convert``); ``chat_pipeline`` checks, renders and
queues it exactly as it does a chat completion; its events become content blocks
(``blocks``), sent whole as a ``message`` or as the stream's Server-Sent Events
(``sse``). Errors answer in Anthropic's shape (``errors.AnthropicRoute``). The
``anthropic-version`` / ``anthropic-beta`` headers are accepted and not needed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from roseinfer.server.anthropic import sse
from roseinfer.server.anthropic.blocks import (
    BlockWriter,
    MessageAssembler,
    Payload,
    new_message_id,
    stop_reason,
)
from roseinfer.server.anthropic.convert import STRUCTURED_PARAM, conversation_fields, turn_fields
from roseinfer.server.anthropic.errors import AnthropicRoute, anthropic_error
from roseinfer.server.anthropic.protocol import (
    ConversationFields,
    CountTokensRequest,
    MessagesRequest,
)
from roseinfer.server.chat_events import (
    ChatError,
    ChatEvent,
    ChatUsage,
    ChoiceFinish,
    ChoiceResult,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    chat_events,
    collect_chat,
)
from roseinfer.server.chat_pipeline import (
    ChatTurn,
    FieldNames,
    count_chat_tokens,
    prepare_chat,
    submit_chat,
)
from roseinfer.server.errors import APIError
from roseinfer.server.prompt_gate import get_gate
from roseinfer.server.routes_lora import resolve_model
from roseinfer.server.state import get_state
from roseinfer.server.streaming import StreamResponse

router = APIRouter(route_class=AnthropicRoute)
FIELDS = FieldNames(structured=STRUCTURED_PARAM)
ROUTES = ("/v1/messages", "/v1/messages/count_tokens")


def _omit_thinking(body: ConversationFields) -> bool:
    return getattr(body.thinking, "display", None) == "omitted"


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state = get_state(request)
    model, lora = resolve_model(request, body.model)  # a LoRA adapter's name, or the base
    turn = ChatTurn(**turn_fields(body), fields=FIELDS)
    prepared = await prepare_chat(state, get_gate(request), turn, arrival)
    message_id = new_message_id()
    stream = submit_chat(state, prepared, message_id, lora)
    stops, omit = body.stop_sequences, _omit_thinking(body)
    if body.stream:
        events = stream_events(chat_events(state, prepared, stream), message_id, model,
                               len(prepared.prompt_ids), stops, omit)
        return StreamResponse(events, on_close=stream.abort)
    result = await collect_chat(state, prepared, stream, request)
    choice = result.choices[0]
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, stops)
    return JSONResponse(sse.message(message_id, model, message_content(choice, omit), reason,
                                    sequence, result.prompt_tokens, result.completion_tokens,
                                    result.cached_tokens))


def message_content(choice: ChoiceResult, omit_thinking: bool) -> list[Payload]:
    """The blocks of a whole choice, through the same writer as the stream."""
    writer, assembler = BlockWriter(omit_thinking), MessageAssembler()
    assembler.apply(writer.reasoning(choice.reasoning or ""))
    assembler.apply(writer.text(choice.content))
    for call in choice.tool_calls:
        assembler.apply(writer.tool_call(call.name, call.arguments))
    assembler.apply(writer.close())
    return assembler.content


async def stream_events(events: AsyncIterator[ChatEvent], message_id: str, model: str,
                  prompt_tokens: int, stops: list[str] | None, omit_thinking: bool,
                  ping_interval: float = sse.PING_INTERVAL_S) -> AsyncIterator[str]:
    """The stream's SSE events of the pipeline's events."""
    yield sse.event(sse.message_start(message_id, model, prompt_tokens))
    yield sse.event(sse.PING)
    writer = BlockWriter(omit_thinking)
    finish: ChoiceFinish | None = None
    output_tokens = cached_tokens = 0
    async for event in sse.keepalive(events, ping_interval):
        ops: list[Payload] = []
        if event is None:
            yield sse.event(sse.PING)
        elif isinstance(event, ReasoningDelta):
            ops = writer.reasoning(event.text)
        elif isinstance(event, TextDelta):
            ops = writer.text(event.text)
        elif isinstance(event, ToolCallStart):
            ops = writer.tool_call_start(event.name)
        elif isinstance(event, ToolCallDelta):
            ops = writer.tool_call_arguments(event.arguments)
        elif isinstance(event, ToolCallEnd):
            ops = writer.close()
        elif isinstance(event, ChoiceFinish):
            ops, finish = writer.close(), event
        elif isinstance(event, ChatUsage):
            output_tokens, cached_tokens = event.completion_tokens, event.cached_tokens
        elif isinstance(event, ChatError):
            yield sse.error_event(anthropic_error(event.error).body())
            return
        for op in ops:
            yield sse.event(op)
    if finish is None:  # the stream ended without its sequence finishing
        return
    reason, sequence = stop_reason(finish.reason, finish.stop_reason, stops)
    yield sse.event(sse.message_delta(reason, sequence, prompt_tokens, output_tokens,
                                      cached_tokens))
    yield sse.event(sse.MESSAGE_STOP)


@router.post("/v1/messages/count_tokens", response_model=None)
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """``{"input_tokens"}``: the prompt a ``/v1/messages`` request with this conversation
    would have (system, messages and the tools as the model is shown them)."""
    state = get_state(request)
    resolve_model(request, body.model)  # the base model or an adapter
    turn = ChatTurn(**conversation_fields(body), fields=FIELDS)
    return JSONResponse({"input_tokens": await count_chat_tokens(state, get_gate(request), turn)})


@router.api_route("/v1/messages{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                  response_model=None, include_in_schema=False)
async def unknown(request: Request) -> Response:
    """Any other method or path under ``/v1/messages``: a 405 (with ``Allow``) or 404 in
    Anthropic's shape that names what was asked for and what exists."""
    asked = f"{request.method} {request.url.path}"
    if request.url.path in ROUTES:
        raise APIError(405, f"Method not allowed: {asked} (use POST)", headers={"Allow": "POST"})
    raise APIError(404, f"Not found: {asked} (this server has POST {' and POST '.join(ROUTES)})")
