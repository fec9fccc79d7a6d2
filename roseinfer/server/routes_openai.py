"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Each handler validates (pydantic, unknown fields, the output constraints, then
SamplingParams), renders/tokenizes the prompt, checks its length and compiles its
grammar BEFORE queuing, so a bad request is a 400 that never reaches the engine loop.
Streams are Server-Sent Events ending in ``[DONE]``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from roseinfer.engine.request_stream import PendingRequest, RequestStream
from roseinfer.outputs import CompletionOutput, RequestOutput
from roseinfer.server.errors import bad_request
from roseinfer.server.logprobs import chat_logprobs, completion_logprobs
from roseinfer.server.prompt_gate import PromptGate, get_gate
from roseinfer.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from roseinfer.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    Usage,
)
from roseinfer.server.routes_lora import lora_model_cards, resolve_model
from roseinfer.server.state import ServerState, collect, engine_error, get_state, make_params
from roseinfer.server.streaming import SSE_DONE, StreamResponse, sse
from roseinfer.server.structured import check_constraints, constraint_fields
from roseinfer.server.tool_stream import ToolCallParser, call_deltas, finish_reason, tool_message
from roseinfer.server.tools import plan_tools, tool_constraint

router = APIRouter()
DEFAULT_MODEL_ROOT = "SmolLM2-135M-Instruct (bundled GGUF)"


def _finish(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def _decoder(state: ServerState):  # noqa: ANN202
    tok = state.engine.engine.tokenizer
    if tok is None:
        return str
    return lambda tid: tok.decode([tid], skip_special_tokens=False)


def _stream_error(exc: BaseException) -> str:
    return sse(engine_error(exc).body())


def _completion_tokens(finals: list[RequestOutput]) -> int:
    return sum(len(c.token_ids) for out in finals for c in out.outputs)


def _refuse_unknown_fields(body: SamplingFields) -> None:
    """A field this server does not know could change the output: a 400 naming it."""
    for name in body.model_extra or {}:
        raise bad_request(f"Unrecognized request argument supplied: {name}", name)


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = get_state(request)
    root = state.engine.engine.config.model or DEFAULT_MODEL_ROOT
    return ModelList(data=[ModelCard(id=name, root=root, max_model_len=state.max_model_len)
                           for name in state.settings.served_model_names]
                     + lora_model_cards(request, state.max_model_len))


# ------------------------------------------------------------------------ chat
@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response | Any:
    arrival = time.monotonic()
    state = get_state(request)
    _refuse_unknown_fields(body)
    model, lora = resolve_model(request, body.model)  # a LoRA adapter's name, or the base
    gate = get_gate(request)
    gate.check_chat(state, body.messages, body.tools)  # before any grammar or template work
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    plan = plan_tools(body)
    constraints = await tool_constraint(plan, state.validator, constraint_fields(body))
    prompt_ids = await gate.render_chat(state, body.messages, tools=body.tools,
                                        rendered_tools=plan.tools if plan.active else None)
    max_tokens = state.check_prompt(prompt_ids, body.max_completion_tokens or body.max_tokens,
                                    "messages")
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    params = make_params(body.sampling_params, max_tokens, top_n, constraints=constraints)
    if not plan.active:
        await check_constraints(state, params, body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = state.submit([PendingRequest(rid, prompt_ids, params, arrival_time=arrival,
                                          lora_request=lora)])
    if body.stream:
        events = _chat_events(state, stream, rid, model, len(prompt_ids), top_n,
                              body.include_usage, plan.active)
        return StreamResponse(events, on_close=stream.abort)
    final = (await collect(stream, request))[rid]
    decode = _decoder(state)
    choices = []
    for c in final.outputs:
        message, finish = (tool_message(c.text, c.finish_reason) if plan.active else
                           (AssistantMessage(content=c.text), _finish(c.finish_reason)))
        choices.append(ChatChoice(
            index=c.index, message=message, finish_reason=finish,
            logprobs=chat_logprobs(c.token_ids, c.logprobs or [], top_n, decode)
            if top_n is not None else None))
    return ChatCompletionResponse(id=rid, model=model, choices=choices,
                                  usage=Usage.of(len(prompt_ids), _completion_tokens([final])))


async def _chat_events(state: ServerState, stream: RequestStream, rid: str, model: str,
                       num_prompt: int, top_n: int | None,
                       include_usage: bool, tools: bool = False) -> AsyncIterator[str]:
    """The chat stream; with ``tools``, calls come as ``delta.tool_calls`` once each
    ``<tool_call>`` block closes (``ToolCallParser``), the text outside blocks as content."""
    created = int(time.time())
    parsers: dict[int, ToolCallParser] = {}
    exclude = None if include_usage else {"usage"}
    started: set[int] = set()
    done: set[int] = set()
    decode = _decoder(state)
    completion_tokens = 0

    def chunk(index: int, delta: DeltaMessage, finish: str | None = None,
              logprobs: Any = None) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish,
                                 logprobs=logprobs)
        body = ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
        return sse(body.model_dump_json(exclude=exclude))

    try:
        async for out in stream:
            for c in out.outputs:
                if c.index in done or (not c.delta_token_ids and c.finish_reason is None):
                    continue
                if c.index not in started:
                    started.add(c.index)
                    yield chunk(c.index, DeltaMessage(role="assistant", content=""))
                lps = None
                if top_n is not None and c.delta_logprobs:
                    lps = chat_logprobs(c.delta_token_ids, c.delta_logprobs, top_n, decode)
                if not tools:
                    if c.delta_text or lps is not None:
                        yield chunk(c.index, DeltaMessage(content=c.delta_text), logprobs=lps)
                    if c.finish_reason is not None:
                        done.add(c.index)
                        completion_tokens += len(c.token_ids)
                        yield chunk(c.index, DeltaMessage(), _finish(c.finish_reason))
                    continue
                parser = parsers.setdefault(c.index, ToolCallParser())
                made = len(parser.calls)
                text, calls = parser.feed(c.delta_text)
                if c.finish_reason is not None:
                    text += parser.finish()
                if text or lps is not None:
                    yield chunk(c.index, DeltaMessage(content=text), logprobs=lps)
                for delta in call_deltas(calls, made):
                    yield chunk(c.index, delta)
                if c.finish_reason is not None:
                    done.add(c.index)
                    completion_tokens += len(c.token_ids)
                    yield chunk(c.index, DeltaMessage(),
                                finish_reason(c.finish_reason, bool(parser.calls)))
        if include_usage:
            usage = ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                        usage=Usage.of(num_prompt, completion_tokens))
            yield sse(usage.model_dump_json())
    except Exception as exc:  # an engine failure ends the stream with an error event
        yield _stream_error(exc)
    yield SSE_DONE


# ----------------------------------------------------------------- completions
async def _completion_prompts(state: ServerState, gate: PromptGate,
                              body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text, ids) of every prompt; token-id prompts have no text. Every text is bounded
    in characters before any is tokenized."""
    p = body.prompt
    if isinstance(p, str):
        items: list[str | list[int]] = [p]
    elif not p:
        raise bad_request("prompt must not be empty", "prompt")
    elif isinstance(p[0], int):
        items = [p]  # type: ignore[list-item]
    else:
        items = list(p)  # type: ignore[arg-type]
    for item in items:
        if isinstance(item, str):
            gate.check_chars(state, len(item), "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((item, await gate.encode(state, item, "prompt")))
        else:
            out.append((None, list(item)))
    return out


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response | Any:
    arrival = time.monotonic()
    state = get_state(request)
    _refuse_unknown_fields(body)
    model, lora = resolve_model(request, body.model)  # a LoRA adapter's name, or the base
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request("best_of is not supported (other than best_of == n)", "best_of")
    constraints = constraint_fields(body)
    prompts = await _completion_prompts(state, get_gate(request), body)
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    for _, ids in prompts:
        state.check_prompt(ids, max_tokens, "prompt")
    echo_lp = body.logprobs if body.echo else None
    params = make_params(body.sampling_params, max_tokens, body.logprobs, echo_lp,
                         constraints=constraints)
    await check_constraints(state, params, body)
    base = f"cmpl-{uuid.uuid4().hex}"
    rids = [f"{base}-{i}" for i in range(len(prompts))]
    stream = state.submit([PendingRequest(rid, ids, params, arrival_time=arrival,
                                          lora_request=lora)
                           for rid, (_, ids) in zip(rids, prompts, strict=True)])
    ctx = _CompletionContext(state, base, model, rids, prompts, params.n, body)
    if body.stream:
        return StreamResponse(ctx.events(stream), on_close=stream.abort)
    finals = await collect(stream, request)
    choices = [ctx.choice(i, c, finals[rid]) for i, rid in enumerate(rids)
               for c in finals[rid].outputs]
    return CompletionResponse(id=base, model=model, choices=choices,
                              usage=Usage.of(ctx.num_prompt, _completion_tokens(
                                  list(finals.values()))))


class _CompletionContext:
    """What the completion formatters need: prompts, echo, logprobs, ids."""

    def __init__(self, state: ServerState, cid: str, model: str, rids: list[str],
                 prompts: list[tuple[str | None, list[int]]], n: int,
                 body: CompletionRequest) -> None:
        self.cid, self.model, self.n = cid, model, n
        self.index_of = {rid: i for i, rid in enumerate(rids)}
        self.prompts = prompts
        self.echo = bool(body.echo)
        self.top_n = body.logprobs
        self.include_usage = body.include_usage
        self.decode = _decoder(state)
        self.tokenizer = state.engine.engine.tokenizer
        self.num_prompt = sum(len(ids) for _, ids in prompts)

    def prompt_text(self, i: int) -> str:
        text, ids = self.prompts[i]
        if text is not None:
            return text
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""

    def _echo_logprobs(self, i: int, out: RequestOutput) -> CompletionLogprobs:
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return completion_logprobs(out.prompt_token_ids, entries, self.top_n or 0, self.decode)

    def choice(self, i: int, c: CompletionOutput, out: RequestOutput) -> CompletionChoice:
        prefix = self.prompt_text(i) if self.echo else ""
        lps = None
        if self.top_n is not None:
            lps = self._echo_logprobs(i, out) if self.echo else None
            offset = len(prefix)
            lps = completion_logprobs(c.token_ids, c.logprobs or [], self.top_n, self.decode,
                                      offset, into=lps)
        return CompletionChoice(index=i * self.n + c.index, text=prefix + c.text, logprobs=lps,
                                finish_reason=_finish(c.finish_reason))

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())
        exclude = None if self.include_usage else {"usage"}
        offsets: dict[int, int] = {}
        completion_tokens = 0

        def chunk(index: int, text: str, finish: str | None,
                  lps: CompletionLogprobs | None) -> str:
            choice = CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=finish)
            body = CompletionResponse(id=self.cid, created=created, model=self.model,
                                      choices=[choice])
            return sse(body.model_dump_json(exclude=exclude))

        try:
            async for out in stream:
                i = self.index_of[out.request_id]
                for c in out.outputs:
                    index = i * self.n + c.index
                    if index not in offsets and (c.delta_token_ids or c.finish_reason):
                        offsets[index] = 0
                        if self.echo:
                            text = self.prompt_text(i)
                            lps = self._echo_logprobs(i, out) if self.top_n is not None else None
                            offsets[index] = len(text)
                            yield chunk(index, text, None, lps)
                    elif index not in offsets or offsets[index] < 0:
                        continue  # not started, or already finished
                    lps = None
                    if self.top_n is not None and c.delta_logprobs:
                        lps = completion_logprobs(c.delta_token_ids, c.delta_logprobs,
                                                  self.top_n, self.decode, offsets[index])
                    finish = _finish(c.finish_reason)
                    if c.delta_text or lps is not None or finish:
                        yield chunk(index, c.delta_text, finish, lps)
                    offsets[index] += len(c.delta_text)
                    if finish:
                        offsets[index] = -1
                        completion_tokens += len(c.token_ids)
            if self.include_usage:
                usage = CompletionResponse(id=self.cid, created=created, model=self.model,
                                           choices=[],
                                           usage=Usage.of(self.num_prompt, completion_tokens))
                yield sse(usage.model_dump_json())
        except Exception as exc:  # an engine failure ends the stream with an error event
            yield _stream_error(exc)
        yield SSE_DONE
