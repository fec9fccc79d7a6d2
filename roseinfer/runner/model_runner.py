"""ModelRunner: owns the model and the KV pool; runs one flattened step.

Given the scheduler's chunks it builds the flat batch (token ids, positions,
slot mapping and block tables via ``build_attention_metadata``), runs ONE model
forward over every scheduled token of every request, and returns logits for the
last position of each chunk that completes its request (those are sampled), plus
all-position logits for chunks whose request asked for prompt logprobs. A chunk with
d speculative drafts (fed after the request's own last token) has d + 1 positions to
sample: the logits of all of them are returned, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from roseinfer.engine.scheduler import ScheduledRequest
from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata
from roseinfer.model.config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


@dataclass(slots=True)
class StepLogits:
    # [R, V] float32: for each chunk that completes its request, in scheduled order, the
    # rows of its last 1 + d positions (d = its drafts; 1 row without speculation).
    sample_logits: torch.Tensor
    prompt_logits: dict[int, torch.Tensor]  # scheduled index -> [num_new_tokens, V] float32


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
        num_slots = num_blocks * block_size
        # One tensor per layer: [2 (K, V), slots, kv_heads, head_dim].
        self.kv_caches = [
            torch.zeros(2, num_slots, config.num_kv_heads, config.head_dim, dtype=kv_dtype, device=device)
            for _ in range(config.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> StepLogits:
        # Decode-type chunks (one new token) first, as the attention metadata expects.
        order = sorted(range(len(scheduled)), key=lambda i: scheduled[i].num_new_tokens != 1)
        seqs: list[SeqSpec] = []
        flat_ids: list[int] = []
        for i in order:
            s = scheduled[i]
            req = s.request
            start = req.num_computed_tokens
            own = s.num_new_tokens - len(s.spec_token_ids)
            flat_ids.extend(req.all_token_ids[start:start + own])
            flat_ids.extend(s.spec_token_ids)
            seqs.append(SeqSpec(start, s.num_new_tokens, req.block_table))
        meta = build_attention_metadata(seqs, self.block_size, self.device)
        input_ids = torch.tensor(flat_ids, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)  # [T, H]

        # Rows (in flat order) of chunks that complete their request, returned in scheduled order.
        position_of = {i: k for k, i in enumerate(order)}
        completing = [i for i in range(len(scheduled)) if scheduled[i].completes]
        rows = meta.logits_indices[[position_of[i] for i in completing]] if completing else None
        if rows is not None and any(scheduled[i].spec_token_ids for i in completing):
            rows = _draft_rows(rows.tolist(), [len(scheduled[i].spec_token_ids)
                                               for i in completing], self.device)
        if rows is not None:
            sample_logits = self.model.compute_logits(hidden[rows])  # [R, V]
        else:
            sample_logits = torch.empty(0, self.config.vocab_size, device=self.device)

        prompt_logits: dict[int, torch.Tensor] = {}
        for i, s in enumerate(scheduled):
            req = s.request
            if not req.records_prompt_logprobs or req.num_computed_tokens >= req.num_prompt_tokens:
                continue
            end = int(meta.logits_indices[position_of[i]]) + 1
            prompt_logits[i] = self.model.compute_logits(hidden[end - s.num_new_tokens:end])
        return StepLogits(sample_logits.float(), prompt_logits)


def _draft_rows(last_rows: list[int], num_drafts: list[int], device: torch.device
                ) -> torch.Tensor:
    """Flat rows to sample: each chunk's last row preceded by one row per draft."""
    rows = [r for last, d in zip(last_rows, num_drafts, strict=True)
            for r in range(last - d, last + 1)]
    return torch.tensor(rows, dtype=torch.long, device=device)  # [R]
