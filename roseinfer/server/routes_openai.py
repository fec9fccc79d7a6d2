"""OpenAI-compatible routes: ``/v1/completions`` and ``/v1/models`` (chat completions:
``routes_chat``).

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
from roseinfer.server.errors import APIError, bad_request, refuse_unknown_fields
from roseinfer.server.logprobs import completion_logprobs, token_decoder
from roseinfer.server.prompt_gate import PromptGate, get_gate
from roseinfer.server.protocol import CompletionRequest
from roseinfer.server.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
)
from roseinfer.server.routes_lora import lora_model_cards, resolve_model
from roseinfer.server.state import ServerState, collect, engine_error, get_state, make_params
from roseinfer.server.streaming import SSE_DONE, StreamResponse, sse
from roseinfer.server.structured import check_constraints, constraint_fields

router = APIRouter()
DEFAULT_MODEL_ROOT = "SmolLM2-135M-Instruct (bundled GGUF)"


def _finish(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def _stream_error(exc: BaseException) -> str:
    return sse(engine_error(exc).body())


def _completion_tokens(finals: list[RequestOutput]) -> int:
    return sum(len(c.token_ids) for out in finals for c in out.outputs)


def _cards(state: ServerState) -> list[ModelCard]:
    root = state.engine.engine.config.model or DEFAULT_MODEL_ROOT
    return [ModelCard(id=name, root=root, max_model_len=state.max_model_len)
            for name in state.settings.served_model_names]


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = get_state(request)
    return ModelList(data=_cards(state) + lora_model_cards(request, state.max_model_len))


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    """One served model or adapter (``models.retrieve``); 404 ``model_not_found`` for
    another id."""
    state = get_state(request)
    cards = [card for card in _cards(state) + lora_model_cards(request, state.max_model_len)
             if card.id == model_id]
    if not cards:
        raise APIError(404, f"The model '{model_id}' does not exist", param="model",
                       code="model_not_found")
    return cards[0]


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
    refuse_unknown_fields(body)
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
                                  list(finals.values())),
                                  sum(f.num_cached_tokens for f in finals.values())))


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
        self.decode = token_decoder(state.engine.engine.tokenizer)
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
        cached: dict[int, int] = {}  # prompt index -> its prefix-cache hit tokens

        def chunk(index: int, text: str, finish: str | None,
                  lps: CompletionLogprobs | None) -> str:
            choice = CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=finish)
            body = CompletionResponse(id=self.cid, created=created, model=self.model,
                                      choices=[choice])
            return sse(body.model_dump_json(exclude=exclude))

        try:
            async for out in stream:
                i = self.index_of[out.request_id]
                cached[i] = out.num_cached_tokens
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
                                           usage=Usage.of(self.num_prompt, completion_tokens,
                                                          sum(cached.values())))
                yield sse(usage.model_dump_json())
        except Exception as exc:  # an engine failure ends the stream with an error event
            yield _stream_error(exc)
        yield SSE_DONE
