"""The float caches' attention on four rows of one sequence at once (attention_tile.h: a
prefill chunk's rows share each K/V load) gives every row bitwise what it gets alone."""

from __future__ import annotations

import pytest
import torch

from roseinfer.kernels import cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels unavailable")


def chunk_batch(runs: list[list[int]], width: int, bs: int, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of several sequences, each sequence's rows consecutive (lengths given per
    run): the block tables, each row's sequence and its length."""
    tables = torch.randperm(len(runs) * width, generator=gen).view(len(runs), width)
    seq = [s for s, run in enumerate(runs) for _ in run]
    lens = [n for run in runs for n in run]
    return (tables.to(torch.int32), torch.tensor(seq, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bs", [16, 5])
def test_chunk_rows_equal_each_row_alone(head_dim: int, heads: tuple[int, int],
                                         cache_dtype: torch.dtype, bs: int) -> None:
    """Runs of 1 to 13 rows: prefill chunks (lengths rising by one, from a cached prefix
    or from 1), a verification-like run of equal lengths, lengths out of order; every
    row equals itself alone, which never takes a tile."""
    h, hkv = heads
    gen = torch.Generator().manual_seed(3)
    width = 8
    runs = [list(range(1, 14)), list(range(30, 36)), [7, 7, 7, 7, 7], [3],
            [12, 4, 9, 1, 20, 2, 2, 40], list(range(35, 39))]
    tables, seq, lens = chunk_batch(runs, width, bs, gen)
    assert int(lens.max()) <= width * bs
    cache = torch.randn(2, tables.numel() * bs, hkv, head_dim, generator=gen).to(cache_dtype)
    q = torch.randn(len(lens), h, head_dim, generator=gen)
    scale = head_dim**-0.5
    batch = torch.ops.roseinfer.paged_attention(q, cache, tables, seq, lens, bs, scale)
    for i in range(len(lens)):
        alone = torch.ops.roseinfer.paged_attention(q[i : i + 1], cache, tables, seq[i : i + 1],
                                                    lens[i : i + 1], bs, scale)
        assert torch.equal(alone[0], batch[i]), i


def test_chunk_rows_match_a_float64_attention() -> None:
    """The tiled rows are attention: a 10-row chunk against float64 softmax(QK^T)V."""
    gen = torch.Generator().manual_seed(4)
    h, hkv, head_dim, bs = 9, 3, 64, 16
    tables, seq, lens = chunk_batch([list(range(23, 33))], 4, bs, gen)
    cache = torch.randn(2, tables.numel() * bs, hkv, head_dim, generator=gen).half()
    q = torch.randn(len(lens), h, head_dim, generator=gen)
    got = torch.ops.roseinfer.paged_attention(q, cache, tables, seq, lens, bs, head_dim**-0.5)
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[0].long()[pos // bs] * bs + pos % bs
        k = cache[0][slots].double().transpose(0, 1).repeat_interleave(h // hkv, 0)
        v = cache[1][slots].double().transpose(0, 1).repeat_interleave(h // hkv, 0)
        p = torch.softmax((q[i].double().unsqueeze(1) @ k.transpose(1, 2)) * head_dim**-0.5, -1)
        want = (p @ v).squeeze(1)
        torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_chunks_equal_each_row_alone(head_dim: int, threads: int) -> None:
    """Chunks whose tiles reach across many 16-position blocks (the tiles' transposed keys
    grow tile by tile, a partly filled block redone), two sequences' chunks one after
    the other and a run of equal lengths, split over 1-3 threads: every row equals itself
    alone."""
    h, hkv, bs = 8, 2, 16
    gen = torch.Generator().manual_seed(5)
    runs = [list(range(5, 75)), list(range(90, 107)), [50] * 6]
    tables, seq, lens = chunk_batch(runs, 8, bs, gen)
    cache = torch.randn(2, tables.numel() * bs, hkv, head_dim, generator=gen).half()
    q = torch.randn(len(lens), h, head_dim, generator=gen)
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = torch.ops.roseinfer.paged_attention(q, cache, tables, seq, lens, bs, scale)
    finally:
        torch.set_num_threads(before)
    for i in range(len(lens)):
        alone = torch.ops.roseinfer.paged_attention(q[i : i + 1], cache, tables, seq[i : i + 1],
                                                    lens[i : i + 1], bs, scale)
        assert torch.equal(alone[0], batch[i]), i
