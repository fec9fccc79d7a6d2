"""Request: the engine's record of one generated sequence.

A request owns its token ids (prompt + output), how many of them have K/V in the
cache (``num_computed_tokens``), its block table, its status and finish reason.
The scheduler advances ``num_computed_tokens`` until it catches up with
``num_tokens``; every time it does, one new token is sampled and appended (with
speculative decoding, its accepted drafts too). A constrained request also owns its
grammar matcher (``grammar``), a speculating one its drafter state (``spec``). An
embedding request (``pooling`` set) only prefills and finishes with its pooled vector.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from roseinfer.lora.request import LoRARequest
from roseinfer.outputs import Logprob
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from roseinfer.engine.spec_state import SpecState
    from roseinfer.engine.structured.matcher import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waiting to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed while stepping (alone: the others go on)

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    group_id: str = ""  # the user-facing request this sequence belongs to (n > 1)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first schedule)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hash of each full block
    num_offered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    num_preemptions: int = 0
    stop_reason: str | int | None = None  # matched stop string or stop token id
    error: str | None = None  # why the request failed (status FINISHED_ERROR)
    # Prompt logprobs: recorded by one sequence of a request (the first of n); entries
    # exist for prompt positions [0, num_prompt_logprobs), so a recompute after
    # preemption may take prefix-cache hits below that and computes each position once.
    records_prompt_logprobs: bool = False
    num_prompt_logprobs: int = 0
    # Per generated token (when params.logprobs is set): token id -> Logprob.
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    # Structured outputs: this sequence's own grammar state (None = unconstrained); it
    # advances by sampled tokens only. stopped_by_grammar: finished because the grammar
    # was complete (the last token's text is kept, unlike an EOS / stop id's).
    grammar: GrammarMatcher | None = None
    stopped_by_grammar: bool = False
    # Speculative decoding: the drafts proposed for the next step (the scheduler takes
    # what fits; never part of all_token_ids), and the drafter's per-sequence state.
    spec_token_ids: list[int] = field(default_factory=list)
    spec: SpecState | None = None
    # The LoRA adapter this sequence runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # Embedding requests: how the prompt's final hidden rows are pooled (None: a
    # generation request); the pooled sum / last row so far; the finished vector.
    pooling: PoolingParams | None = None
    pooled: torch.Tensor | None = None
    embedding: list[float] | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def prefix_salt(self) -> int | None:
        """Parent hash of the first KV block in the prefix cache: None for the base model,
        the adapter's (``LoRARequest.prefix_salt``, stable across processes) otherwise, so
        cached prefixes, in memory or on disk, are shared only within one adapter."""
        return None if self.lora_request is None else self.lora_request.prefix_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep the first ``num_output_tokens`` outputs and their logprobs: a stop met
        inside a run of accepted drafts ends the sequence there. Only for a request that
        is finishing (its block hashes may still cover the dropped tokens)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]
        if len(self.output_logprobs) > num_output_tokens:
            del self.output_logprobs[num_output_tokens:]
            total = 0.0  # summed again in order: the same float as the token-by-token sum
            for entry, token in zip(self.output_logprobs, self.output_token_ids, strict=True):
                total += entry[token].logprob
            self.cumulative_logprob = total
