"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request is checked (``protocol``), joined to its ``previous_response_id``'s stored
conversation, turned into a ``ChatTurn`` (``convert``) and run by the chat pipeline;
its events build the response (``writer``), sent whole or as Server-Sent Events
(``event: <type>`` / ``data: <json>``, no ``[DONE]``, as OpenAI sends them). Both modes
read the pipeline's event stream through the same writer, so the stream's final
``response`` equals the whole one. A response made with ``store`` true (the default) is
kept in the app's ``ResponseStore`` once it has finished.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from roseinfer.server.chat_events import (
    ChatError,
    ChatEvent,
    ChatUsage,
    ChoiceFinish,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    chat_events,
)
from roseinfer.server.chat_pipeline import prepare_chat, submit_chat
from roseinfer.server.errors import APIError
from roseinfer.server.prompt_gate import get_gate
from roseinfer.server.responses_api.convert import chat_turn, output_items
from roseinfer.server.responses_api.objects import (
    ResponseObject,
    ResponseUsage,
    echoed,
)
from roseinfer.server.responses_api.protocol import (
    InputItem,
    ResponsesRequest,
    check_request,
    function_tools,
    input_items,
)
from roseinfer.server.responses_api.store import ResponseStore
from roseinfer.server.responses_api.writer import Event, ResponseWriter, new_id, sse_event
from roseinfer.server.routes_lora import resolve_model
from roseinfer.server.state import get_state
from roseinfer.server.streaming import ClientDisconnectedError, StreamResponse, until_disconnect

router = APIRouter()


def get_store(request: Request) -> ResponseStore:
    return request.app.state.responses_store


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param,
                    code="response_not_found" if param is None else "previous_response_not_found")


class _Run:
    """One response being made: the pipeline's events applied to its writer."""

    def __init__(self, writer: ResponseWriter, store: ResponseStore | None,
                 conversation: list[InputItem]) -> None:
        self.writer = writer
        self.store = store  # None: store false
        self.conversation = conversation
        self.truncated = False

    async def apply(self, event: ChatEvent) -> list[Event]:
        w = self.writer
        if isinstance(event, ReasoningDelta):
            return w.reasoning(event.text)
        if isinstance(event, TextDelta):
            return w.text(event.text)
        if isinstance(event, ToolCallStart):
            return w.call_start(event.id, event.name)
        if isinstance(event, ToolCallDelta):
            return w.call_arguments(event.arguments)
        if isinstance(event, ToolCallEnd):
            return w.call_end()
        if isinstance(event, ChoiceFinish):
            self.truncated = event.reason == "length"
            return []
        if isinstance(event, ChatUsage):
            events = w.finish(self.truncated, ResponseUsage.of(
                event.prompt_tokens, event.completion_tokens, event.cached_tokens,
                reasoning_tokens=event.reasoning_tokens))
            if self.store is not None:
                self.store.put(w.response, self.conversation + output_items(w.response.output))
            return events
        if isinstance(event, ChatError):
            error = event.error
            return w.fail(error.message, error.code, error.param, error.status_code >= 500)
        return []  # ChoiceStart: one choice, nothing to say

    async def stream(self, events: AsyncIterator[ChatEvent]) -> AsyncIterator[str]:
        for out in self.writer.start():
            yield sse_event(out)
        async for event in events:
            for out in await self.apply(event):
                yield sse_event(out)

    async def whole(self, events: AsyncIterator[ChatEvent]) -> ResponseObject:
        async for event in events:
            if isinstance(event, ChatError):
                raise event.error
            await self.apply(event)
        return self.writer.response


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response | Any:
    arrival = time.monotonic()
    state = get_state(request)
    store = get_store(request)
    check_request(body)
    model, lora = resolve_model(request, body.model)  # a LoRA adapter's name, or the base
    tools = function_tools(body)
    conversation = input_items(body)
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        conversation = [*previous.conversation, *conversation]
    prepared = await prepare_chat(state, get_gate(request), chat_turn(body, conversation, tools),
                                  arrival)
    rid = new_id("resp")
    stream = submit_chat(state, prepared, rid, lora)
    response = ResponseObject(id=rid, created_at=int(time.time()), model=model,
                              **echoed(body, tools))
    run = _Run(ResponseWriter(response), store if body.stored else None, conversation)
    events = chat_events(state, prepared, stream)
    if body.stream:
        return StreamResponse(run.stream(events), on_close=stream.abort)
    try:
        return await until_disconnect(run.whole(events), request.receive, stream.abort)
    except ClientDisconnectedError as exc:
        raise APIError(499, "client disconnected", code="client_closed_request") from exc
    finally:
        stream.abort()


@router.get("/v1/responses/{response_id}", response_model=None)
async def get_response(response_id: str, request: Request) -> ResponseObject:
    entry = get_store(request).get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry.response


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    if not get_store(request).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
