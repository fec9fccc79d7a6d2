"""build_attention_metadata: slot/position math on a hand example, ordering and errors."""

from __future__ import annotations

import time

import pytest
import torch

from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata

CPU = torch.device("cpu")


def _t(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_hand_example() -> None:
    seqs = [
        SeqSpec(5, 1, [7, 2]),  # decode: position 5, context 6 tokens
        SeqSpec(0, 1, [3]),  # one-token prompt: context of 1
        SeqSpec(2, 3, [5, 0]),  # prefill chunk: positions 2..4
        SeqSpec(0, 2, [9]),  # whole prefill: positions 0..1
    ]
    m = build_attention_metadata(seqs, block_size=4, device=CPU)
    assert torch.equal(m.positions, _t([5, 0, 2, 3, 4, 0, 1]))
    # slot = block_table[p // 4] * 4 + p % 4
    assert torch.equal(m.slot_mapping, _t([9, 12, 22, 23, 0, 36, 37]))
    assert torch.equal(m.logits_indices, _t([0, 1, 4, 6]))
    assert m.num_decode_tokens == 2
    assert m.num_tokens == 7 and m.num_seqs == 4
    assert m.max_decode_context_len == 6
    assert torch.equal(m.decode_context_lens, _t([6, 1]))
    assert torch.equal(m.decode_mask, torch.tensor([[True] * 6, [True] + [False] * 5]))
    # Padding repeats the last real slot, so never-written memory is never gathered.
    assert torch.equal(m.decode_slot_indices, _t([[28, 29, 30, 31, 8, 9], [12] * 6]))
    c, d = m.prefills
    assert (c.query_start, c.query_end, c.num_computed_tokens) == (2, 5, 2)
    assert torch.equal(c.context_slot_indices, _t([20, 21, 22, 23, 0]))
    want_mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool
    )
    assert c.causal_mask is not None and torch.equal(c.causal_mask, want_mask)
    assert (d.query_start, d.query_end, d.num_computed_tokens) == (5, 7, 0)
    assert torch.equal(d.context_slot_indices, _t([36, 37]))
    assert d.causal_mask is None


def test_only_prefills_and_only_decodes() -> None:
    m = build_attention_metadata([SeqSpec(0, 3, [1])], 4, CPU)
    assert m.num_decode_tokens == 0 and m.decode_slot_indices.shape == (0, 0)
    assert len(m.prefills) == 1
    m = build_attention_metadata([SeqSpec(4, 1, [1, 6]), SeqSpec(1, 1, [2])], 4, CPU)
    assert m.prefills == [] and m.decode_slot_indices.shape == (2, 5)
    assert torch.equal(m.slot_mapping, _t([24, 9]))


def test_decodes_must_come_first() -> None:
    with pytest.raises(ValueError, match="must come first"):
        build_attention_metadata([SeqSpec(0, 3, [1]), SeqSpec(4, 1, [2, 3])], 4, CPU)


@pytest.mark.parametrize(
    "seqs",
    [
        [],
        [SeqSpec(0, 0, [1])],
        [SeqSpec(3, 2, [1])],  # 5 tokens need 2 blocks of 4
    ],
)
def test_invalid_specs(seqs: list[SeqSpec]) -> None:
    with pytest.raises(ValueError):
        build_attention_metadata(seqs, 4, CPU)


def test_large_decode_batch_is_cheap() -> None:
    block_size = 16
    seqs = []
    for i in range(64):
        ctx = 1000 + 7 * i
        n_blocks = ctx // block_size + 1
        seqs.append(SeqSpec(ctx, 1, list(range(i * 80, i * 80 + n_blocks))))
    build_attention_metadata(seqs, block_size, CPU)  # warm-up
    start = time.perf_counter()
    m = build_attention_metadata(seqs, block_size, CPU)
    elapsed = time.perf_counter() - start
    assert m.decode_slot_indices.shape == (64, 1000 + 7 * 63 + 1)
    assert int(m.slot_mapping[5]) == 5 * 80 * block_size + 1035
    assert elapsed < 0.25, f"building metadata took {elapsed:.3f}s"


def test_decode_only_step_matches_the_general_builder() -> None:
    """A step of decodes only (built from Python ints) gives its rows the same values and
    dtypes as the general builder does when a prefill follows them."""
    decodes = [SeqSpec(5, 1, [7, 2]), SeqSpec(0, 1, [3]), SeqSpec(8, 1, [4, 1, 6])]
    alone = build_attention_metadata(decodes, 4, CPU)
    mixed = build_attention_metadata(decodes + [SeqSpec(0, 2, [9])], 4, CPU)
    d = len(decodes)
    assert alone.num_decode_tokens == mixed.num_decode_tokens == d and alone.prefills == []
    assert alone.max_decode_context_len == mixed.max_decode_context_len == 9
    pairs = [
        (alone.positions, mixed.positions[:d]),
        (alone.slot_mapping, mixed.slot_mapping[:d]),
        (alone.logits_indices, mixed.logits_indices[:d]),
        (alone.decode_context_lens, mixed.decode_context_lens),
        (alone.decode_slot_indices, mixed.decode_slot_indices),
        (alone.decode_mask, mixed.decode_mask),
        (alone.block_tables, mixed.block_tables[:d]),
        (alone.token_seq, mixed.token_seq[:d]),
        (alone.token_context_lens, mixed.token_context_lens[:d]),
    ]
    for a, b in pairs:
        assert a is not None and b is not None
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    assert torch.equal(alone.slot_mapping, _t([9, 12, 24]))
    assert alone.token_seq.dtype == torch.int32 and alone.block_tables.dtype == torch.int32
