"""Per-step attention metadata for paged KV-cache attention.

The engine describes every scheduled sequence with a :class:`SeqSpec`; the builder
turns the batch into flat index tensors, once per engine step, that every layer's
attention reuses:

* ``positions`` / ``slot_mapping``: rotary position and KV-cache slot of each flat token.
* decode part: the first ``num_decode_tokens`` sequences have exactly one new token;
  their whole context (cached tokens plus the new one) is gathered through a padded
  ``[D, Lmax]`` slot-index matrix with a validity mask, so one batched attention op
  serves them all.
* prefill part: every other sequence gets a :class:`PrefillMetadata` with its query
  range in the flat tokens, its context slot indices and (when part of its context is
  already cached) a causal mask offset by ``num_computed_tokens``.
* per token, for kernels that serve every row alike (``paged_attention``): the block
  table row of its sequence (``token_seq`` into ``block_tables``) and the number of
  positions it attends to (``token_context_lens`` = position + 1).

Slot of position ``p`` of a sequence: ``block_table[p // block_size] * block_size +
p % block_size``.  All index tensors are built with vectorised torch ops on a padded
block table; the only Python loops run over sequences, never over tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass(slots=True)
class SeqSpec:
    """One scheduled sequence in an engine step."""

    num_computed_tokens: int  # tokens of this sequence whose K/V are already in the cache
    num_new_tokens: int  # tokens fed this step (>= 1): positions num_computed .. num_computed+num_new-1
    block_table: list[int]  # block ids covering at least num_computed + num_new tokens


@dataclass(slots=True)
class PrefillMetadata:
    """One multi-token (prefill or prefill-chunk) sequence of the step."""

    query_start: int  # first flat token index of this sequence's new tokens
    query_end: int  # one past its last flat token index
    num_computed_tokens: int  # tokens already in the cache before this step
    context_slot_indices: Tensor  # [num_computed + num_new] int64 KV slots of positions 0..ctx-1
    # [num_new, num_computed + num_new] bool, True = key visible (query i sees keys
    # 0..num_computed+i); None when num_computed == 0 (plain causal attention).
    causal_mask: Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one forward over flat tokens ``[T]``."""

    positions: Tensor  # [T] int64 position of every flat token
    slot_mapping: Tensor  # [T] int64 flat KV slot where each new token's K/V is written
    logits_indices: Tensor  # [num_seqs] int64 flat index of each sequence's last token
    num_decode_tokens: int  # D: sequences 0..D-1 have one new token each = tokens 0..D-1
    # Decode part (D rows; Lmax = longest decode context, 0 when D == 0); its padded
    # [D, Lmax] tables (``decode_slot_indices``, ``decode_mask``) are built on first use:
    # the C++ decoder stack never reads them.
    decode_context_lens: Tensor  # [D] int64 context length (num_computed + 1)
    max_decode_context_len: int  # Lmax
    block_size: int  # tokens per KV block
    # Prefill part, in flat-token order (tokens D..T-1).
    prefills: list[PrefillMetadata] = field(default_factory=list)
    # Every token alike: block tables of all sequences, each token's sequence and length.
    block_tables: Tensor | None = None  # [N, W] int32
    token_seq: Tensor | None = None  # [T] int32 row of block_tables
    token_context_lens: Tensor | None = None  # [T] int32 positions attended (position + 1)
    # LoRA adapters of the step's rows (a ``roseinfer.lora.forward.LoRABatch``), set by
    # the runner when any row has one; the model then runs it (None: base model only).
    lora: Any = None
    # [R] int64 ascending flat rows whose final hidden the caller reads, set by the runner
    # when that is not every row (a prefill chunk: its sampled row at most); None: all.
    # A hint: the C++ decoder stack then stops the other rows after the last layer's K/V
    # writes, the per-layer path after the last layer's attention; both return zeros for
    # them (GPT-2, LoRA and tensor-parallel steps compute every row).
    out_rows: Tensor | None = None
    _decode_tables: tuple[Tensor, Tensor] | None = None  # (slots, mask), built on first use

    @property
    def decode_slot_indices(self) -> Tensor:
        """[D, Lmax] int64 context slots of the decode rows (padding repeats the last one:
        always-written memory, so an uninitialised (NaN) cache never leaks through the
        masked softmax)."""
        return self._decode_part()[0]

    @property
    def decode_mask(self) -> Tensor:
        """[D, Lmax] bool, True where ``decode_slot_indices`` is a real context token."""
        return self._decode_part()[1]

    def _decode_part(self) -> tuple[Tensor, Tensor]:
        if self._decode_tables is None:
            assert self.block_tables is not None, "the builder always sets block_tables"
            self._decode_tables = _decode_tables(
                self.block_tables[:self.num_decode_tokens].long(), self.decode_context_lens,
                self.max_decode_context_len, self.block_size)
        return self._decode_tables

    @property
    def num_tokens(self) -> int:
        """Total number of flat tokens T."""
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the step."""
        return int(self.logits_indices.shape[0])


def _padded_rows(seqs: list[SeqSpec]) -> list[list[int]]:
    """[N][max_blocks] block tables, padded with block 0 (never indexed)."""
    width = max(1, max(len(s.block_table) for s in seqs))
    return [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]


def _padded_block_tables(seqs: list[SeqSpec]) -> Tensor:
    """[N, max_blocks] int64 block tables (``_padded_rows``)."""
    return torch.tensor(_padded_rows(seqs), dtype=torch.int64)  # [N, W]


def _slots_for(
    block_tables: Tensor, seq_idx: Tensor, pos: Tensor, block_size: int
) -> Tensor:
    """Slot of position ``pos[i]`` of sequence ``seq_idx[i]`` (all tensors same shape)."""
    blocks = block_tables[seq_idx, torch.div(pos, block_size, rounding_mode="floor")]
    return blocks * block_size + pos % block_size


def build_attention_metadata(
    seqs: list[SeqSpec], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Build the step's :class:`AttentionMetadata` (decode sequences must come first)."""
    if not seqs:
        raise ValueError("build_attention_metadata needs at least one sequence")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_decodes = 0
    for i, s in enumerate(seqs):
        if s.num_new_tokens < 1:
            raise ValueError(f"sequence {i}: num_new_tokens must be >= 1, got {s.num_new_tokens}")
        if s.num_computed_tokens < 0:
            raise ValueError(f"sequence {i}: negative num_computed_tokens")
        needed = -(-(s.num_computed_tokens + s.num_new_tokens) // block_size)
        if len(s.block_table) < needed:
            raise ValueError(
                f"sequence {i}: block_table has {len(s.block_table)} blocks, "
                f"needs {needed} for {s.num_computed_tokens + s.num_new_tokens} tokens"
            )
        if s.num_new_tokens == 1:
            if num_decodes != i:
                raise ValueError(
                    f"sequence {i} has one new token but follows a multi-token sequence: "
                    "sequences with num_new_tokens == 1 must come first"
                )
            num_decodes += 1

    if num_decodes == len(seqs):
        return _decode_only(seqs, block_size, device)
    block_tables = _padded_block_tables(seqs)  # [N, W]
    num_computed = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.int64)  # [N]
    num_new = torch.tensor([s.num_new_tokens for s in seqs], dtype=torch.int64)  # [N]
    num_seqs = len(seqs)
    cu_new = torch.cumsum(num_new, 0)  # [N] end of each sequence in flat tokens
    total = int(cu_new[-1])
    starts = cu_new - num_new  # [N]

    # Flat tokens: owning sequence, position, slot.
    seq_of_tok = torch.repeat_interleave(torch.arange(num_seqs), num_new)  # [T]
    offset = torch.arange(total) - starts[seq_of_tok]  # [T] index within this step's chunk
    positions = num_computed[seq_of_tok] + offset  # [T]
    slot_mapping = _slots_for(block_tables, seq_of_tok, positions, block_size)  # [T]
    logits_indices = cu_new - 1  # [N]

    # Decode part: context lengths (its padded slot tables are built on first use).
    d = num_decodes
    dec_lens = num_computed[:d] + 1  # [D]
    lmax = int(dec_lens.max()) if d > 0 else 0

    # Prefill part: all context slots of the remaining sequences in one flat tensor.
    prefills: list[PrefillMetadata] = []
    if d < num_seqs:
        p_ctx = num_computed[d:] + num_new[d:]  # [P] context length per prefill
        p_seq = torch.repeat_interleave(torch.arange(d, num_seqs), p_ctx)  # [sum ctx]
        p_starts = torch.cumsum(p_ctx, 0) - p_ctx  # [P]
        p_pos = torch.arange(int(p_ctx.sum())) - p_starts[p_seq - d]  # [sum ctx]
        p_slots = _slots_for(block_tables, p_seq, p_pos, block_size).to(device)  # [sum ctx]
        ctx_slot_list = torch.split(p_slots, p_ctx.tolist())  # P x [ctx_i]
        for j, s in enumerate(seqs[d:]):
            c, n = s.num_computed_tokens, s.num_new_tokens
            mask = None
            if c > 0:
                keys = torch.arange(c + n, device=device)  # [c+n]
                queries = c + torch.arange(n, device=device)  # [n]
                mask = keys.unsqueeze(0) <= queries.unsqueeze(1)  # [n, c+n]
            start = int(starts[d + j])
            prefills.append(
                PrefillMetadata(
                    query_start=start,
                    query_end=start + n,
                    num_computed_tokens=c,
                    context_slot_indices=ctx_slot_list[j],
                    causal_mask=mask,
                )
            )

    return AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        logits_indices=logits_indices.to(device),
        num_decode_tokens=d,
        decode_context_lens=dec_lens.to(device),
        max_decode_context_len=lmax,
        block_size=block_size,
        prefills=prefills,
        block_tables=block_tables.to(torch.int32).to(device),
        token_seq=seq_of_tok.to(torch.int32).to(device),
        token_context_lens=(positions + 1).to(torch.int32).to(device),
    )


def _decode_only(seqs: list[SeqSpec], block_size: int, device: torch.device
                 ) -> AttentionMetadata:
    """The metadata of a step of decode sequences only (one new token each), from Python
    ints: the same values as the general builder, without its ~20 small tensor ops. Its
    tensors are views of two (one int64, one int32): right after a decode step each
    tensor op runs cache-cold, ~10-50 us apiece at batch 1 (docs/performance.md)."""
    pos = [s.num_computed_tokens for s in seqs]
    slots = [s.block_table[p // block_size] * block_size + p % block_size
             for s, p in zip(seqs, pos, strict=True)]
    lens = [p + 1 for p in pos]
    d = len(seqs)
    tables = _padded_rows(seqs)
    width = len(tables[0])
    ints = [*pos, *slots, *range(d), *lens]
    int32s = [*range(d), *lens, *itertools.chain.from_iterable(tables)]
    i64 = torch.tensor(ints, dtype=torch.int64, device=device)
    i32 = torch.tensor(int32s, dtype=torch.int32, device=device)
    return AttentionMetadata(
        positions=i64[:d],
        slot_mapping=i64[d:2 * d],
        logits_indices=i64[2 * d:3 * d],
        num_decode_tokens=d,
        decode_context_lens=i64[3 * d:],
        max_decode_context_len=max(lens),
        block_size=block_size,
        block_tables=i32[2 * d:].view(d, width),
        token_seq=i32[:d],
        token_context_lens=i32[d:2 * d],
    )


def _decode_tables(block_tables: Tensor, lens: Tensor, lmax: int, block_size: int
                   ) -> tuple[Tensor, Tensor]:
    """([D, Lmax] int64 context slots, [D, Lmax] bool mask) of decode rows with block
    tables [D, W] int64 and context lengths [D]; padded columns repeat the last slot."""
    d = int(lens.shape[0])
    cols = torch.arange(lmax, device=lens.device)  # [Lmax]
    mask = cols.unsqueeze(0) < lens.unsqueeze(1)  # [D, Lmax]
    pos = torch.minimum(cols.unsqueeze(0), (lens - 1).unsqueeze(1))  # [D, Lmax] clamped
    rows = torch.arange(d, device=lens.device).unsqueeze(1).expand(d, lmax)  # [D, Lmax]
    return _slots_for(block_tables, rows, pos, block_size), mask
