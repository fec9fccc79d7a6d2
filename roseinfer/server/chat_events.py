"""A queued chat's engine outputs -> API-neutral events, streamed or collected.

``chat_events`` yields, for each choice (``index``): ``ChoiceStart``, then in output
order ``ReasoningDelta`` / ``TextDelta`` (with its tokens' logprobs) / ``ToolCallStart``,
``ToolCallDelta``, ``ToolCallEnd``, then ``ChoiceFinish``; after every choice,
``ChatUsage``. An engine failure ends the stream with ``ChatError`` (no ``ChatUsage``).
``collect_chat`` waits for the whole result instead (aborting it if the client leaves)
and gives one ``ChoiceResult`` per choice. Both read the text through one
``ChoiceReader`` (reasoning, then content and tool calls), so joining a stream's deltas
gives exactly the collected result. Each API maps these onto its own shapes.

Finish reasons are ``"stop"`` (end of turn, a stop string / token), ``"length"``
(``max_tokens``) and ``"tool_calls"`` (stopped after making calls); ``stop_reason`` is
the matched stop string or token id, when one was.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from roseinfer.engine.request_stream import RequestStream
from roseinfer.outputs import CompletionOutput, ToolCall
from roseinfer.server.chat_pipeline import PreparedChat
from roseinfer.server.chat_reader import ChoiceReader, reasoning_token_count
from roseinfer.server.errors import APIError
from roseinfer.server.logprobs import chat_logprobs, token_decoder
from roseinfer.server.responses import TokenLogprob
from roseinfer.server.state import ServerState, collect, engine_error
from roseinfer.tool_calls import finish_reason, new_call_id


@dataclass(frozen=True, slots=True)
class ChoiceStart:
    index: int


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Content text; ``logprobs``: the tokens of this step (None: not asked). Its text
    may be empty when only logprobs are new (tokens still held by the reader)."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    call_index: int  # 0, 1, ... within the choice
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    call_index: int
    arguments: str  # a piece of the arguments' JSON text


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    call_index: int
    call: ToolCall  # the whole call (id, name, arguments)


@dataclass(frozen=True, slots=True)
class ChoiceFinish:
    index: int
    reason: str  # "stop" | "length" | "tool_calls"
    stop_reason: str | int | None
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class ChatUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (memory or disk)
    reasoning_tokens: int = 0  # generated tokens inside reasoning blocks, all choices


@dataclass(frozen=True, slots=True)
class ChatError:
    error: APIError  # the engine failed: the stream ends here


ChatEvent = (ChoiceStart | TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta
             | ToolCallEnd | ChoiceFinish | ChatUsage | ChatError)


@dataclass
class ChoiceResult:
    """One choice, whole: ``content`` is the text outside calls and reasoning ("" when
    none), ``reasoning`` None when the model did not reason."""

    index: int
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    stop_reason: str | int | None
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None


@dataclass
class ChatResult:
    choices: list[ChoiceResult]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (memory or disk)
    created: int = field(default_factory=lambda: int(time.time()))


def _reader(prepared: PreparedChat) -> ChoiceReader:
    return ChoiceReader(tools=prepared.tools_active, reasoning=prepared.reasoning,
                        inside=prepared.thinking_open)


def _calls(index: int, first: int, calls: list[ToolCall]) -> list[ChatEvent]:
    out: list[ChatEvent] = []
    for k, call in enumerate(calls, first):
        out += [ToolCallStart(index, k, call.id, call.name),
                ToolCallDelta(index, k, call.arguments), ToolCallEnd(index, k, call)]
    return out


def _with_ids(parsed: list) -> list[ToolCall]:  # noqa: ANN001 - ParsedCall records
    return [ToolCall(new_call_id(), c.name, c.arguments) for c in parsed]


async def chat_events(state: ServerState, prepared: PreparedChat,
                      stream: RequestStream) -> AsyncIterator[ChatEvent]:
    """The events of ``stream`` (a ``submit_chat`` result) as they come."""
    readers: dict[int, ChoiceReader] = {}
    done: set[int] = set()
    decode = token_decoder(state.engine.engine.tokenizer)
    completion_tokens = cached_tokens = reasoning_tokens = 0
    try:
        async for out in stream:
            cached_tokens = out.num_cached_tokens
            for c in out.outputs:
                if c.index in done or (not c.delta_token_ids and c.finish_reason is None):
                    continue
                if c.index not in readers:
                    readers[c.index] = _reader(prepared)
                    yield ChoiceStart(c.index)
                reader = readers[c.index]
                lps = None
                if prepared.top_n is not None and c.delta_logprobs:
                    lps = chat_logprobs(c.delta_token_ids, c.delta_logprobs, prepared.top_n,
                                        decode).content
                made = len(reader.calls)
                piece = reader.feed(c.delta_text, final=c.finish_reason is not None,
                                    cut=c.finish_reason == "length")
                if piece.reasoning:
                    yield ReasoningDelta(c.index, piece.reasoning)
                if piece.content or lps is not None:
                    yield TextDelta(c.index, piece.content, lps)
                for event in _calls(c.index, made, _with_ids(piece.calls)):
                    yield event
                if c.finish_reason is not None:
                    done.add(c.index)
                    completion_tokens += len(c.token_ids)
                    if prepared.reasoning:
                        reasoning_tokens += reasoning_token_count(
                            state.engine.engine.tokenizer, c.token_ids, prepared.thinking_open)
                    yield ChoiceFinish(c.index, _reason(c, bool(reader.calls)), c.stop_reason,
                                       len(c.token_ids))
        yield ChatUsage(len(prepared.prompt_ids), completion_tokens, cached_tokens,
                        reasoning_tokens)
    except Exception as exc:  # an engine failure ends the stream with an error event
        yield ChatError(engine_error(exc))


def _reason(c: CompletionOutput, made_calls: bool) -> str:
    return finish_reason(c.finish_reason, made_calls) or "stop"


async def collect_chat(state: ServerState, prepared: PreparedChat, stream: RequestStream,
                       request: Request) -> ChatResult:
    """The whole result of ``stream``; an ``APIError`` when the engine fails (499 when
    the client left first, the request aborted)."""
    final = (await collect(stream, request))[stream.request_ids[0]]
    decode = token_decoder(state.engine.engine.tokenizer)
    choices = []
    for c in final.outputs:
        reader = _reader(prepared)
        piece = reader.feed(c.text, final=True, cut=c.finish_reason == "length")
        lps = None
        if prepared.top_n is not None:
            lps = chat_logprobs(c.token_ids, c.logprobs or [], prepared.top_n, decode).content
        choices.append(ChoiceResult(
            index=c.index, content=piece.content, reasoning=piece.reasoning_or_none,
            tool_calls=_with_ids(piece.calls), finish_reason=_reason(c, bool(piece.calls)),
            stop_reason=c.stop_reason, completion_tokens=len(c.token_ids), logprobs=lps))
    return ChatResult(choices, len(prepared.prompt_ids),
                      sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens)
