"""The response and its stream events, built from the chat pipeline's events.

One ``ResponseWriter`` serves both modes: a streamed response sends the events each call
returns, a whole one drops them and keeps ``response``; so the stream's last
``response.completed`` is the object a non-streamed request gets. The events follow
OpenAI's order: ``response.created`` and ``response.in_progress``; per output item
``response.output_item.added``, for a message ``response.content_part.added``, its
``response.output_text.delta``s, ``.output_text.done``, ``.content_part.done`` (a
reasoning item the same with ``response.reasoning_text.*``; a function call
``response.function_call_arguments.delta`` / ``.done``), ``response.output_item.done``;
then ``response.completed`` (or ``response.incomplete``, or ``error`` and
``response.failed``). Every event has its ``sequence_number``; item events their
``output_index``, ``item_id`` and ``content_index``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from roseinfer.server.responses_api.objects import (
    FunctionCall,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    Reasoning,
    ReasoningPart,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: Event) -> str:
    """One Server-Sent Event: ``event:`` names the type, ``data:`` holds it all."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseWriter:
    """Grows ``response`` from text / reasoning deltas and calls; returns the events."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence = 0
        self.open: OutputMessage | Reasoning | None = None  # the item deltas go to
        self.calling: FunctionCall | None = None  # the call whose arguments come

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _snapshot(self, kind: str) -> Event:
        return self._event(kind, response=self.response.model_dump(mode="json"))

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    def start(self) -> list[Event]:
        return [self._snapshot("response.created"), self._snapshot("response.in_progress")]

    # ------------------------------------------------------------- items
    def _add(self, item: OutputItem) -> Event:
        self.response.output.append(item)
        return self._event("response.output_item.added", output_index=self._index,
                           item=item.model_dump(mode="json"))

    def _open(self, kind: type[OutputMessage] | type[Reasoning]) -> list[Event]:
        if isinstance(self.open, kind):
            return []
        events = self._close("completed")
        if kind is OutputMessage:
            item: OutputMessage | Reasoning = OutputMessage(id=new_id("msg"),
                                                            content=[OutputText()])
            part = OutputText()
        else:
            item = Reasoning(id=new_id("rs"), content=[ReasoningPart()])
            part = ReasoningPart()
        shown = item.model_copy(update={"content": []})  # parts come with their own events
        self.response.output.append(item)
        events.append(self._event("response.output_item.added", output_index=self._index,
                                  item=shown.model_dump(mode="json")))
        events.append(self._event("response.content_part.added", output_index=self._index,
                                  item_id=item.id, content_index=0,
                                  part=part.model_dump(mode="json")))
        self.open = item
        return events

    def _close(self, status: str) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        part = item.content[0]
        where = {"output_index": self.response.output.index(item), "item_id": item.id,
                 "content_index": 0}
        if isinstance(item, OutputMessage):
            done = self._event("response.output_text.done", **where, text=part.text,
                               logprobs=[])
        else:
            done = self._event("response.reasoning_text.done", **where, text=part.text)
        item.status = status  # type: ignore[assignment]
        return [done,
                self._event("response.content_part.done", **where,
                            part=part.model_dump(mode="json")),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=item.model_dump(mode="json"))]

    # ------------------------------------------------------------ deltas
    def text(self, delta: str) -> list[Event]:
        if not delta:
            return []
        events = self._open(OutputMessage)
        assert isinstance(self.open, OutputMessage)
        self.open.content[0].text += delta
        events.append(self._event("response.output_text.delta", output_index=self._index,
                                  item_id=self.open.id, content_index=0, delta=delta,
                                  logprobs=[]))
        return events

    def reasoning(self, delta: str) -> list[Event]:
        if not delta:
            return []
        events = self._open(Reasoning)
        assert isinstance(self.open, Reasoning)
        self.open.content[0].text += delta
        events.append(self._event("response.reasoning_text.delta", output_index=self._index,
                                  item_id=self.open.id, content_index=0, delta=delta))
        return events

    def call_start(self, call_id: str, name: str) -> list[Event]:
        """A function call begins: its item, arguments to come."""
        events = self._close("completed")
        self.calling = FunctionCall(id=new_id("fc"), call_id=call_id, name=name)
        events.append(self._add(self.calling))
        return events

    def _call(self) -> tuple[FunctionCall, dict[str, Any]]:
        if self.calling is None:
            raise RuntimeError("function call arguments before the call began")
        return self.calling, {"output_index": self.response.output.index(self.calling),
                              "item_id": self.calling.id}

    def call_arguments(self, delta: str) -> list[Event]:
        call, where = self._call()
        call.arguments += delta
        return [self._event("response.function_call_arguments.delta", **where, delta=delta)]

    def call_end(self) -> list[Event]:
        call, where = self._call()
        self.calling, call.status = None, "completed"
        return [self._event("response.function_call_arguments.done", **where,
                            arguments=call.arguments),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=call.model_dump(mode="json"))]

    # ------------------------------------------------------------ the end
    def finish(self, truncated: bool, usage: ResponseUsage) -> list[Event]:
        """Close the open item; ``truncated``: stopped by ``max_output_tokens`` (the
        response is ``incomplete``). With no output at all, one empty message."""
        events = self.call_end() if self.calling is not None else []
        if not self.response.output:
            events += self._open(OutputMessage)
        events += self._close("incomplete" if truncated else "completed")
        response = self.response
        response.usage = usage
        if truncated:
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails()
            return [*events, self._snapshot("response.incomplete")]
        response.status = "completed"
        response.completed_at = int(time.time())
        return [*events, self._snapshot("response.completed")]

    def fail(self, message: str, code: str | None = None, param: str | None = None,
             server: bool = True) -> list[Event]:
        """A failure mid-stream: an ``error`` event (``code``: ours), then
        ``response.failed`` (whose ``error.code`` is OpenAI's ``server_error``, or
        ``invalid_prompt`` when not ``server``)."""
        self.open = self.calling = None
        self.response.status = "failed"
        self.response.error = ResponseError(code="server_error" if server else "invalid_prompt",
                                            message=message)
        return [self._event("error", code=code, message=message, param=param),
                self._snapshot("response.failed")]
