"""ModelRunner: owns the model and the KV pool; runs one flattened step.

Given the scheduler's chunks it builds the flat batch (token ids, positions,
slot mapping and block tables via ``build_attention_metadata``), runs ONE model
forward over every scheduled token of every request, and returns logits for the
last position of each chunk that completes its request (those are sampled), plus
all-position logits for chunks whose request asked for prompt logprobs. Chunks of an
embedding request (``Request.pooling``) are never sampled: their final hidden rows are
pooled instead (``roseinfer.runner.pooler``; ``StepLogits.pooled``). A chunk with
d speculative drafts (fed after the request's own last token) has d + 1 positions to
sample: the logits of all of them are returned, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from roseinfer.engine.scheduler import ScheduledRequest
from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata
from roseinfer.model.config import ModelConfig
from roseinfer.runner.kv_pool import allocate_kv_caches
from roseinfer.runner.kv_pool import kv_bytes_per_block as kv_bytes_per_block  # re-export
from roseinfer.runner.kv_pool import num_kv_blocks as num_kv_blocks  # re-export
from roseinfer.runner.pooler import pool_chunk

if TYPE_CHECKING:
    from roseinfer.lora.manager import LoRAManager


@dataclass(slots=True)
class StepLogits:
    # [R, V] float32: for each chunk that completes its request, in scheduled order, the
    # rows of its last 1 + d positions (d = its drafts; 1 row without speculation).
    sample_logits: torch.Tensor
    prompt_logits: dict[int, torch.Tensor]  # scheduled index -> [num_new_tokens, V] float32
    # Embedding requests: scheduled index -> [H], the request's pooled state after the
    # chunk (mean: the float64 sum of its rows so far; last: the prompt's last row, on the
    # completing chunk).
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)
    # A greedy step (``execute(..., greedy=True)``) on a model with a greedy head: each
    # sampled row's argmax token and whether its logit is finite, in place of
    # ``sample_logits`` (then empty).
    greedy: tuple[list[int], list[bool]] | None = None


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.device = device
        # One tensor per layer: [2 (K, V), slots, kv_heads, head_dim] (zero pages on CPU).
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, kv_dtype, device)
        self.lora: LoRAManager | None = None  # set by the engine when LoRA is enabled

    @property
    def failure(self) -> BaseException | None:
        """Why the model can no longer run, noticed between steps (never, here)."""
        return None

    def shutdown(self) -> None:
        """Release what the runner started (nothing, here: see TensorParallelRunner)."""

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], greedy: bool = False) -> StepLogits:
        """The step's forward. ``greedy``: every sampled row takes its argmax (plain
        greedy requests, nothing masked); the model may then give the tokens alone
        (``StepLogits.greedy``), the same as the argmax of the logits."""
        layout = layout_step(scheduled)
        meta = build_attention_metadata(layout.seqs, self.block_size, self.device)
        if self.lora is not None and any(layout.row_loras):
            meta.lora = self.lora.batch(layout.row_loras)
        read = output_rows(layout)
        if read is not None:  # the model may stop the other rows after their K/V writes
            meta.out_rows = torch.tensor(read, dtype=torch.long, device=self.device)  # [R]
        input_ids = torch.tensor(layout.token_ids, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)  # [T, H]
        t = hidden.shape[0]
        sampled = None  # [R, H]: the rows to sample (a step of decodes: every row, no gather)
        if layout.sample_rows:
            sampled = hidden if layout.sample_rows == list(range(t)) else hidden[
                torch.tensor(layout.sample_rows, dtype=torch.long, device=self.device)]
        chosen = None
        if greedy and sampled is not None and hasattr(self.model, "compute_greedy"):
            chosen = self.model.compute_greedy(sampled)
        if sampled is None or chosen is not None:
            sample_logits = torch.empty(0, self.config.vocab_size, device=self.device)
        else:
            sample_logits = self.model.compute_logits(sampled)  # [R, V]
        prompt_logits = {i: self.model.compute_logits(hidden[a:b])  # [num_new_tokens, V]
                         for i, (a, b) in layout.prompt_ranges.items()}
        pooled = {}
        for i, (a, b) in layout.pool_ranges.items():
            s = scheduled[i]
            req = s.request  # a chunk from position 0 (first, or after preemption) restarts
            prev = req.pooled if req.num_computed_tokens > 0 else None
            part = pool_chunk(hidden[a:b], req.pooling, s.completes, prev)
            if part is not None:
                pooled[i] = part
        if sample_logits.dtype != torch.float32:
            sample_logits = sample_logits.float()
        return StepLogits(sample_logits, prompt_logits, pooled, chosen)


@dataclass(slots=True)
class StepLayout:
    """Where a step's chunks sit in the flat batch (``layout_step``)."""

    token_ids: list[int]  # [T] every chunk's own tokens then its drafts, decodes first
    seqs: list[SeqSpec]  # one per chunk, in that order
    # Flat rows to sample: per chunk that completes its request, in scheduled order, its
    # last 1 + d positions (d = its drafts).
    sample_rows: list[int]
    # Scheduled index -> flat rows [start, end) of a chunk whose prompt logprobs are kept.
    prompt_ranges: dict[int, tuple[int, int]]
    row_loras: list[int]  # [T] each row's LoRA adapter id (0: base model); [] without adapters
    # Scheduled index -> flat rows [start, end) of an embedding request's chunk.
    pool_ranges: dict[int, tuple[int, int]] = field(default_factory=dict)


def output_rows(layout: StepLayout) -> list[int] | None:
    """The flat rows whose final hidden a step reads (sampled, prompt-logprob and pooled
    rows), ascending; None when that is every row (a step of decodes)."""
    t = len(layout.token_ids)
    if len(layout.sample_rows) == t:
        return None
    rows = set(layout.sample_rows)
    for a, b in (*layout.prompt_ranges.values(), *layout.pool_ranges.values()):
        rows.update(range(a, b))
    return None if len(rows) == t else sorted(rows)


def layout_step(scheduled: list[ScheduledRequest]) -> StepLayout:
    """The flat batch of a step: decode-type chunks (one new token) first, as the
    attention metadata expects, each part grouped by LoRA adapter (one segment each);
    rows to sample and prompt-logprob rows."""
    loras = [0 if s.request.lora_request is None else s.request.lora_request.lora_int_id
             for s in scheduled]
    with_loras = any(loras)  # else no per-row ids: the common step pays nothing for them
    order = sorted(range(len(scheduled)),
                   key=lambda i: (scheduled[i].num_new_tokens != 1, loras[i]))
    row_loras: list[int] = []
    seqs: list[SeqSpec] = []
    flat_ids: list[int] = []
    end: dict[int, int] = {}  # scheduled index -> one past its last flat row
    for i in order:
        s = scheduled[i]
        req = s.request
        start = req.num_computed_tokens
        own = s.num_new_tokens - len(s.spec_token_ids)
        flat_ids.extend(req.all_token_ids[start:start + own])
        flat_ids.extend(s.spec_token_ids)
        if with_loras:
            row_loras.extend([loras[i]] * s.num_new_tokens)
        seqs.append(SeqSpec(start, s.num_new_tokens, req.block_table))
        end[i] = len(flat_ids)
    sample_rows = [r for i, s in enumerate(scheduled) if s.samples
                   for r in range(end[i] - 1 - len(s.spec_token_ids), end[i])]
    prompt_ranges = {
        i: (end[i] - s.num_new_tokens, end[i]) for i, s in enumerate(scheduled)
        if s.request.records_prompt_logprobs
        and s.request.num_computed_tokens < s.request.num_prompt_tokens
    }
    pool_ranges = {i: (end[i] - s.num_new_tokens, end[i]) for i, s in enumerate(scheduled)
                   if s.request.pooling is not None}
    return StepLayout(flat_ids, seqs, sample_rows, prompt_ranges, row_loras, pool_ranges)
