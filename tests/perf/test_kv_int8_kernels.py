"""The C++ kernels over an int8 KV cache (csrc/kv_q8.h, csrc/attention_q8.cpp): the
quantizer gives the PyTorch quantizer's bits, attention matches a float64 model of the
documented arithmetic, and the AVX2 and portable implementations agree bitwise."""

from __future__ import annotations

import pytest
import torch

from roseinfer.kernels import cpu_kernels_available
from roseinfer.model import kv_int8

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels unavailable")


def random_int8_cache(slots: int, hkv: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """[2, slots, Hkv, Dh + 4] int8 rows of random values of varied magnitude (a zero row
    included: scale 0)."""
    x = torch.randn(2, slots, hkv, head_dim, generator=gen)
    x = x * torch.rand(2, slots, hkv, 1, generator=gen).mul(4)
    x[0, 0] = 0.0
    return kv_int8.quantize_rows(x).contiguous()


def _case(head_dim: int, heads: tuple[int, int], bs: int, d: int, width: int, seed: int):
    h, hkv = heads
    gen = torch.Generator().manual_seed(seed)
    cache = random_int8_cache(d * width * bs, hkv, head_dim, gen)
    tables = torch.randperm(d * width, generator=gen).view(d, width).to(torch.int32)
    q = torch.randn(d, h, head_dim, generator=gen)
    lens = torch.randint(1, width * bs + 1, (d,), generator=gen, dtype=torch.int32)
    lens[0] = width * bs
    rows = torch.arange(d, dtype=torch.int32)
    return q, cache, tables, rows, lens


@pytest.mark.parametrize("head_dim", [64, 20])
def test_rope_and_cache_writes_the_pytorch_quantizer_bits(head_dim: int) -> None:
    """At position 0 (cos 1, sin 0: rotary is the identity) the cache rows the C++ op
    writes are bitwise those of ``kv_int8.quantize_rows`` (AVX2 body and scalar tail)."""
    gen = torch.Generator().manual_seed(0)
    t, h, hkv = 9, 4, 2
    qkv = torch.randn(t, (h + 2 * hkv) * head_dim, generator=gen) * 3
    qkv[2, h * head_dim:(h + 1) * head_dim] = 0.0  # an all-zero K head
    k = qkv[:, h * head_dim:(h + hkv) * head_dim].reshape(t, hkv, head_dim).clone()
    v = qkv[:, (h + hkv) * head_dim:].reshape(t, hkv, head_dim).clone()
    cos_sin = torch.cat([torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)], dim=1)
    cache = torch.zeros(2, 32, hkv, head_dim + 4, dtype=torch.int8)
    slots = torch.randperm(32, generator=gen)[:t]
    torch.ops.roseinfer.rope_and_cache_(qkv, torch.zeros(t, dtype=torch.long), cos_sin, cache,
                                        slots, h, hkv)
    assert torch.equal(cache[0, slots], kv_int8.quantize_rows(k))
    assert torch.equal(cache[1, slots], kv_int8.quantize_rows(v))


@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2)])
def test_attention_matches_a_float64_model(head_dim: int, heads: tuple[int, int]) -> None:
    """Each row's output = float64 softmax((qq . kq) * qs * ks * scale) @ (vq * vs), with
    each query head quantized like a cache row (qq, qs), to float32 accuracy (head dim
    40: the portable implementation serves it)."""
    h, hkv = heads
    q, cache, tables, rows, lens = _case(head_dim, heads, 8, 6, 5, seed=1)
    scale = head_dim**-0.5
    got = torch.ops.roseinfer.paged_attention(q, cache, tables, rows, lens, 8, scale)
    values = kv_int8.dequantize_rows(cache, torch.float64)  # exact: q * s in float64
    for i in range(q.shape[0]):
        pos = torch.arange(int(lens[i]))
        slots = tables[i].long()[pos // 8] * 8 + pos % 8
        k = values[0][slots].transpose(0, 1)  # [Hkv, L, Dh]
        v = values[1][slots].transpose(0, 1)
        qi = kv_int8.dequantize_rows(kv_int8.quantize_rows(q[i]), torch.float64)
        qi = qi.view(hkv, h // hkv, head_dim)  # [Hkv, G, Dh]: qq * qs
        p = torch.softmax(qi @ k.transpose(1, 2) * scale, dim=-1)  # [Hkv, G, L]
        want = (p @ v).reshape(h, head_dim)
        torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("bs", [16, 5])
def test_avx2_equals_portable(head_dim: int, heads: tuple[int, int], bs: int) -> None:
    """The AVX2 kernel and the portable one (lane by lane) give the same bits: groups of
    query heads in passes of 3 / 3 + 1 / 1, contexts of every length mod 8."""
    q, cache, tables, rows, lens = _case(head_dim, heads, bs, 12, 6, seed=2)
    args = (q, cache, tables, rows, lens, bs, head_dim**-0.5)
    simd = torch.ops.roseinfer.paged_attention(*args)
    portable = torch.ops.roseinfer.paged_attention_portable(*args)
    assert torch.equal(simd, portable)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bs", [16, 32, 5])
def test_rows_alone_equal_rows_in_a_batch(head_dim: int, bs: int) -> None:
    """A row alone takes the per-(row, KV head) items; in a batch of decode rows enough for
    every thread, on AMX machines, the kernel that walks one row's every KV head block by
    block (csrc/attention_q8_amx.h).  Both give the same bits."""
    q, cache, tables, rows, lens = _case(head_dim, (9, 3), bs, 12, 6, seed=4)
    scale = head_dim**-0.5
    batch = torch.ops.roseinfer.paged_attention(q, cache, tables, rows, lens, bs, scale)
    for i in range(q.shape[0]):
        alone = torch.ops.roseinfer.paged_attention(q[i:i + 1], cache, tables, rows[i:i + 1],
                                                    lens[i:i + 1], bs, scale)
        assert torch.equal(alone[0], batch[i]), i


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("bs", [4, 16])  # 16: whole blocks of 16 take the AMX tiles' Q.K
@pytest.mark.parametrize("nrows", [1, 8])  # 8 decode rows: the row kernel on AMX machines
def test_integer_dot_at_the_extremes(portable: bool, bs: int, nrows: int) -> None:
    """Q.K is an exact integer dot: K bytes at -128 / 127 (the quantizer never writes -128,
    the kernel must still not saturate) against queries at +-127, scores up to
    64 * 128 * 127, match the float64 model."""
    head_dim = 64
    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(2, max(8, bs), 1, head_dim + 4, dtype=torch.int8)
    signs = torch.randint(0, 2, (8, head_dim), generator=gen).bool()
    cache[0, :8, 0, :head_dim] = torch.where(signs, torch.tensor(-128, dtype=torch.int8),
                                            torch.tensor(127, dtype=torch.int8))
    cache[1, :8, 0, :head_dim] = torch.randint(-127, 128, (8, head_dim), generator=gen,
                                              dtype=torch.int8)
    scales = torch.tensor([1e-3, 2e-3] * 4).view(8, 1, 1)
    cache[:, :8, :, head_dim:] = scales.expand(2, 8, 1, 1).contiguous().view(torch.int8)
    q = torch.where(signs[:3], -1.0, 1.0).view(1, 3, head_dim) * 5.0  # qq = +-127
    q[0, 2] = -q[0, 2]
    tables = torch.arange(max(1, 8 // bs), dtype=torch.int32).view(1, -1).repeat(nrows, 1)
    args = (q.expand(nrows, 3, head_dim).contiguous(), cache, tables,  # nrows sequences, one cache
            torch.arange(nrows, dtype=torch.int32), torch.full((nrows,), 8, dtype=torch.int32),
            bs, 0.125)
    op = torch.ops.roseinfer.paged_attention_portable if portable else torch.ops.roseinfer.paged_attention
    out = op(*args)
    assert all(torch.equal(out[i], out[0]) for i in range(nrows))
    got = out[0]
    values = kv_int8.dequantize_rows(cache, torch.float64)[:, :8, 0]  # [2, 8, Dh]
    qi = kv_int8.dequantize_rows(kv_int8.quantize_rows(q[0]), torch.float64)  # [3, Dh]
    want = torch.softmax(qi @ values[0].T * 0.125, dim=-1) @ values[1]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)
