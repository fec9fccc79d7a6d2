"""OpenAI-compatible ``POST /v1/embeddings``.

``input`` is a string, a list of strings, one token-id list or a list of them; each
becomes one embedding request (``PoolingParams``: the server's ``--embedding-pooling``
and ``--no-embedding-normalize``), batched by the engine with everything else.
``dimensions`` keeps the first values and L2-normalizes them again (OpenAI's v3
models); ``encoding_format: "base64"`` sends each vector as little-endian float32
bytes, as the OpenAI SDK decodes them. Every input is checked (empty, too long,
outside the vocabulary: a 400 naming ``input``) before any is queued.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from roseinfer.engine.pooling import truncate
from roseinfer.engine.request_stream import PendingRequest
from roseinfer.engine.validation import InvalidRequestError
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.errors import APIError, bad_request, refuse_unknown_fields
from roseinfer.server.prompt_gate import PromptGate, get_gate
from roseinfer.server.protocol import MAX_PROMPTS_PER_REQUEST, Text, TokenIds
from roseinfer.server.state import ServerState, collect, get_state

router = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    input: (Text | Annotated[list[Text], Field(max_length=MAX_PROMPTS_PER_REQUEST)] | TokenIds
            | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS_PER_REQUEST)])
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted, unused


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _items(body: EmbeddingRequest) -> list[str | list[int]]:
    x = body.input
    if isinstance(x, str):
        return [x]
    if not x:
        raise bad_request("input must not be empty", "input")
    if isinstance(x[0], int):
        return [x]  # type: ignore[list-item]
    return list(x)  # type: ignore[arg-type]


async def _encode(state: ServerState, gate: PromptGate, items: list[str | list[int]]
                  ) -> list[list[int]]:
    """Every input's token ids, each checked (chars first, then ids and length)."""
    for item in items:
        if isinstance(item, str):
            gate.check_chars(state, len(item), "input")
    out = []
    for item in items:
        ids = await gate.encode(state, item, "input") if isinstance(item, str) else list(item)
        try:
            state.validator.check_prompt(ids, "input")
        except InvalidRequestError as exc:
            raise bad_request(str(exc), "input") from exc
        out.append(ids)
    return out


def _encode_vector(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    arrival = time.monotonic()
    state = get_state(request)
    refuse_unknown_fields(body)
    model = state.check_model(body.model)
    hidden = state.engine.engine.model_config.hidden_size
    if body.dimensions is not None and body.dimensions > hidden:
        raise bad_request(f"dimensions must be at most {hidden} (this model's hidden size), "
                          f"got {body.dimensions}", "dimensions")
    prompts = await _encode(state, get_gate(request), _items(body))
    pooling = state.settings.embedding_pooling
    params = SamplingParams(max_tokens=1)
    base = f"embd-{uuid.uuid4().hex}"
    rids = [f"{base}-{i}" for i in range(len(prompts))]
    stream = state.submit([PendingRequest(rid, ids, params, arrival_time=arrival,
                                          pooling=pooling)
                           for rid, ids in zip(rids, prompts, strict=True)])
    finals = await collect(stream, request)
    data = []
    for i, rid in enumerate(rids):
        out = finals[rid]
        if out.embedding is None:
            raise APIError(500, f"The request failed in the engine: {out.error}",
                           code="request_failed")
        vec = truncate(out.embedding, body.dimensions, pooling.normalize)
        data.append(EmbeddingData(index=i, embedding=_encode_vector(vec, body.encoding_format)))
    num = sum(len(ids) for ids in prompts)
    return EmbeddingResponse(data=data, model=model,
                             usage=EmbeddingUsage(prompt_tokens=num, total_tokens=num))
