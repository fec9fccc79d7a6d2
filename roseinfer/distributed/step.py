"""One tensor-parallel step: the message rank 0 broadcasts, and what every rank runs.

A step is described by ``StepMessage``: the flat token ids, per sequence (in the
runner's order, decodes first) its computed-token count, new-token count and block
table, and the flat rows whose logits are wanted.  Rank 0 packs it into two int64
tensors and broadcasts them (``lead``): a fixed header ``[kind, T, N, W, R]`` (an
idle worker waits in this one), then the payload ``ids[T] | computed[N] | new[N] |
table_len[N] | tables[N, W] | rows[R]``.  ``STOP`` in the header ends the workers.

Every rank then rebuilds the same ``AttentionMetadata`` (``build_attention_metadata``),
runs its shard (the collectives are inside the model, ``layers``), computes its
vocabulary columns of the wanted rows and gathers them on rank 0 (``ShardExecutor``).
A worker checks every index of a step against its own tensors before running it
(``_check``): a step message is only numbers, and a bad one is an error, never an
out-of-bounds read or write in a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from roseinfer.distributed.comm import Communicator
from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata
from roseinfer.model.config import ModelConfig
from roseinfer.runner.kv_pool import allocate_kv_caches

STEP, STOP = 0, 1
_HEADER = 5


@dataclass(slots=True)
class StepMessage:
    token_ids: list[int]  # [T] flat, sequences in order
    seqs: list[SeqSpec]  # decodes (one new token) first
    rows: list[int]  # flat rows whose logits rank 0 wants, in its order

    def pack(self) -> tuple[Tensor, Tensor]:
        """(header [5], payload) int64 tensors."""
        width = max((len(s.block_table) for s in self.seqs), default=0)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in self.seqs]
        payload = (self.token_ids + [s.num_computed_tokens for s in self.seqs]
                   + [s.num_new_tokens for s in self.seqs]
                   + [len(s.block_table) for s in self.seqs]
                   + [b for t in tables for b in t] + self.rows)
        header = [STEP, len(self.token_ids), len(self.seqs), width, len(self.rows)]
        return torch.tensor(header, dtype=torch.int64), torch.tensor(payload, dtype=torch.int64)

    @staticmethod
    def payload_size(header: Tensor) -> int:
        _, t, n, w, r = header.tolist()
        return t + 3 * n + n * w + r

    @classmethod
    def unpack(cls, header: Tensor, payload: Tensor) -> StepMessage:
        _, t, n, w, r = header.tolist()
        values = payload.tolist()
        ids, rest = values[:t], values[t:]
        computed, new, lens = rest[:n], rest[n:2 * n], rest[2 * n:3 * n]
        tables = rest[3 * n:3 * n + n * w]
        rows = rest[3 * n + n * w:]
        assert len(rows) == r, "a step payload of the wrong size"
        seqs = [SeqSpec(computed[i], new[i], tables[i * w:i * w + lens[i]]) for i in range(n)]
        return cls(ids, seqs, rows)


class ShardExecutor:
    """One rank's model shard and KV pool (its KV heads only), run step by step."""

    def __init__(self, model: nn.Module, config: ModelConfig, vocab_sizes: tuple[int, ...],
                 comm: Communicator, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model, self.config, self.comm = model, config, comm
        self.vocab_sizes = vocab_sizes
        self.block_size, self.device = block_size, device
        self.num_blocks = num_blocks
        # One tensor per layer: [2 (K, V), slots, this rank's KV heads, head_dim].
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, kv_dtype, device)

    def lead(self, message: StepMessage) -> Tensor:
        """Rank 0: broadcast the step, run it; logits [R, V] float32 of ``message.rows``."""
        header, payload = message.pack()
        self.comm.broadcast(header)
        self.comm.broadcast(payload)
        logits = self.run(message)
        assert logits is not None
        return logits

    def follow(self) -> bool:
        """Ranks 1..: wait for rank 0's next step and run it; False on ``STOP``."""
        header = self.comm.broadcast(torch.zeros(_HEADER, dtype=torch.int64), idle=True)
        if int(header[0]) == STOP:
            return False
        self._check_header(header)
        payload = self.comm.broadcast(
            torch.zeros(StepMessage.payload_size(header), dtype=torch.int64))
        message = StepMessage.unpack(header, payload)
        self._check(message)
        self.run(message)
        return True

    def _check_header(self, header: Tensor) -> None:
        """A step header within this rank's limits (before its payload is allocated)."""
        kind, t, n, w, r = header.tolist()
        if kind != STEP or min(t, n, w, r) < 0 or n > t or w > self.num_blocks \
                or t > self.num_blocks * self.block_size or r > 2 * t:
            raise ValueError(f"a step header out of range: {header.tolist()}")

    def _check(self, message: StepMessage) -> None:
        """Every index a step uses lies inside this rank's tensors (the C++ kernels do not
        check them): token ids in the vocabulary, block ids in the pool, each sequence's
        tokens within its blocks, rows among the step's tokens.  Python's min / max over
        the lists ``unpack`` made, costing about as much as ``unpack`` itself (batch 64,
        20 blocks each: 0.2-0.36 ms vs 0.19-0.22 ms on the loaded 2-core test machine)."""
        ids, seqs, rows, t = message.token_ids, message.seqs, message.rows, \
            len(message.token_ids)
        size = self.block_size
        ok = (_inside(ids, 0, sum(self.vocab_sizes)) and _inside(rows, 0, t)
              and sum(s.num_new_tokens for s in seqs) == t)
        for s in seqs:
            if not ok:
                break
            ok = (s.num_computed_tokens >= 0 and s.num_new_tokens >= 1
                  and s.num_computed_tokens + s.num_new_tokens <= len(s.block_table) * size
                  and _inside(s.block_table, 0, self.num_blocks))
        if not ok:
            raise ValueError("a step message out of range (token ids, blocks or rows)")

    def stop_workers(self) -> None:
        """Rank 0: tell the workers to exit."""
        self.comm.broadcast(torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64))

    @torch.inference_mode()
    def run(self, message: StepMessage) -> Tensor | None:
        """This rank's part of the step; rank 0 gets the logits [R, V], the others None."""
        meta = build_attention_metadata(message.seqs, self.block_size, self.device)
        ids = torch.tensor(message.token_ids, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(ids, meta.positions, self.kv_caches, meta)  # [T, hidden]
        if not message.rows:
            return (torch.empty(0, sum(self.vocab_sizes), device=self.device)
                    if self.comm.rank == 0 else None)
        rows = torch.tensor(message.rows, dtype=torch.long, device=self.device)  # [R]
        local = self.model.compute_logits(hidden[rows]).float()  # [R, V / N]
        return self.comm.gather_columns(local, self.vocab_sizes)


def _inside(values: list[int], low: int, high: int) -> bool:
    """low <= every value < high."""
    return not values or (min(values) >= low and max(values) < high)
