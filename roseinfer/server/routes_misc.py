"""Plain routes: ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``, ``/generate``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from roseinfer.engine.request_stream import PendingRequest, RequestStream
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.errors import bad_request
from roseinfer.server.prompt_gate import get_gate
from roseinfer.server.protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest
from roseinfer.server.state import collect, get_state, make_params
from roseinfer.server.streaming import StreamResponse

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    engine = get_state(request).engine
    if engine.healthy:
        return JSONResponse({"status": "ok"})
    reason = engine.dead_reason
    detail = f"{type(reason).__name__}: {reason}" if reason else "the engine is not running"
    return JSONResponse({"status": "unhealthy", "detail": detail}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = await run_in_threadpool(get_state(request).metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = get_state(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages must not be empty", "messages")
        ids = await get_gate(request).render_chat(
            state, body.messages, add_generation_prompt=body.add_generation_prompt)
    else:
        ids = await get_gate(request).encode(state, body.prompt or "", "prompt",
                                             body.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = get_state(request)
    state.check_model(body.model)
    if state.engine.engine.tokenizer is None:
        raise bad_request("this model has no tokenizer")
    vocab = state.engine.engine.model_config.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    text = await get_gate(request).decode(state, body.tokens)
    return {"prompt": text}


@router.post("/generate", response_model=None)
async def generate(body: GenerateRequest, request: Request) -> Response | dict[str, str]:
    """The original plain endpoint: ``{"text": ...}`` or a plain-text stream."""
    arrival = time.monotonic()
    state = get_state(request)
    if isinstance(body.prompt, str):
        ids = await get_gate(request).encode(state, body.prompt, "prompt")
    else:
        ids = list(body.prompt)
    state.check_prompt(ids, body.max_new_tokens, "prompt")
    greedy = not body.do_sample or body.temperature == 0
    params = make_params(
        SamplingParams, max_tokens=body.max_new_tokens,
        temperature=0.0 if greedy else body.temperature, top_k=0 if greedy else body.top_k,
        top_p=1.0 if greedy else body.top_p, ignore_eos=not body.stop_on_eos,
    )
    rid = f"gen-{uuid.uuid4().hex}"
    stream = state.submit([PendingRequest(rid, ids, params, arrival_time=arrival)])
    if body.stream:
        return StreamResponse(_text_chunks(stream), on_close=stream.abort,
                              media_type="text/plain; charset=utf-8")
    final = (await collect(stream, request))[rid]
    return {"text": final.outputs[0].text}


async def _text_chunks(stream: RequestStream) -> AsyncIterator[str]:
    # An engine failure propagates: the connection is cut before the final chunk,
    # which a plain-text client sees as an incomplete response.
    async for out in stream:
        if out.outputs[0].delta_text:
            yield out.outputs[0].delta_text
