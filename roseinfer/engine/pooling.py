"""Embedding requests in the engine's step: gather pooled hidden rows, finish with a vector.

An embedding request (``Request.pooling``) runs through the same step loop as the
others but only prefills: each step's forward gives its chunk's pooled part
(``StepLogits.pooled``, from ``roseinfer.runner.pooler``). ``accumulate`` adds it to the
request (the runner folds each chunk into the state the request holds; a chunk from
position 0 — the first, or the first after a preemption — starts over), and once the
prompt is complete ``finish`` turns the sum / last row into the embedding (mean: divided
by the prompt length, then float32; L2-normalized unless ``normalize`` is off) and
finishes the request with ``"stop"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from roseinfer.engine.request import Request, RequestStatus
from roseinfer.engine.scheduler import ScheduledRequest, Scheduler
from roseinfer.engine.validation import InvalidRequestError
from roseinfer.pooling_params import PoolingParams
from roseinfer.runner.model_runner import StepLogits
from roseinfer.sampling_params import SamplingParams


def accumulate(scheduled: Sequence[ScheduledRequest], logits: StepLogits | None,
               failed: dict[Request, str]) -> list[Request]:
    """Add the step's pooled parts to their requests (call before the scheduler's
    ``update``: ``num_computed_tokens`` is still where each chunk starts). Returns the
    embedding requests whose prompt this step completed."""
    done: list[Request] = []
    if logits is None:
        return done
    for i, s in enumerate(scheduled):
        req = s.request
        if req.pooling is None or req in failed or req.is_finished:
            continue
        state = logits.pooled.get(i)
        if state is not None:
            req.pooled = state
        if s.completes:
            if req.pooled is None:
                failed[req] = "the runner gave no hidden states to pool"
            elif not bool(torch.isfinite(req.pooled).all()):
                failed[req] = "the model produced non-finite hidden states (NaN or inf)"
            else:
                done.append(req)
    return done


def finish(scheduler: Scheduler, done: Sequence[Request]) -> list[Request]:
    """Set each request's ``embedding`` and finish it (``"stop"``); returns them."""
    finished: list[Request] = []
    for req in done:
        if req.is_finished or req.pooled is None or req.pooling is None:
            continue  # aborted during the step
        vec = req.pooled
        if req.pooling.pooling == "mean":
            vec = (vec / req.num_prompt_tokens).float()
        if req.pooling.normalize:
            vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
        req.embedding = vec.tolist()
        req.pooled = None
        scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
        finished.append(req)
    return finished


def truncate(embedding: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first ``dimensions`` values (OpenAI's ``dimensions``), L2-normalized again
    when the embeddings are normalized; the whole vector when ``dimensions`` is None."""
    if dimensions is None or dimensions >= len(embedding):
        return embedding
    head = embedding[:dimensions]
    if not normalize:
        return head
    norm = math.sqrt(math.fsum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


def check_request(pooling: PoolingParams, params: SamplingParams,
                  tensor_parallel_size: int) -> None:
    """``InvalidRequestError`` unless the engine can run this embedding request."""
    if not isinstance(pooling, PoolingParams):
        raise InvalidRequestError("pooling must be a PoolingParams", "pooling")
    if params.n != 1 or params.max_tokens != 1:  # never drafts nor samples beyond its prompt
        raise InvalidRequestError("an embedding request has one sequence (n == 1) and "
                                  "max_tokens == 1", "params")
    if params.prompt_logprobs is not None:
        raise InvalidRequestError("an embedding request has no prompt logprobs",
                                  "prompt_logprobs")
    if tensor_parallel_size > 1:
        raise InvalidRequestError("embeddings are not supported with tensor parallelism",
                                  "pooling")
