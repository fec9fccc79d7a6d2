"""Greedy tokens from a GGUF Q8_0 LM head (csrc/head_greedy.h): ``Linear.greedy(x)`` is
bitwise ``row_argmax(Linear.forward(x))`` (ids and values; the first of tied maxima, a
non-finite row's first NaN) though from 5 rows it computes most logits only
approximately, for any head shape, row count and input; and only a Q8_0 head without
bias offers it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer.kernels import cpu_kernels_available
from roseinfer.kernels.gguf import make_gguf_linear

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels unavailable")

T = gguf.GGMLQuantizationType


def q8_head(n: int, k: int, seed: int, ties: bool = False,
            bias: torch.Tensor | None = None) -> object:
    """A Q8_0 head [n, k] from gguf's quantizer of random weights (with ``ties``, rows
    repeated: equal logits in different panels)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 0.1)).astype(np.float32)
    if ties:
        for dst in range(n // 3, n, max(1, n // 5)):
            w[dst] = w[0]
    raw = gguf.quants.quantize(w, T.Q8_0).view(np.uint8).reshape(n, -1)
    return make_gguf_linear([(int(T.Q8_0), torch.from_numpy(np.ascontiguousarray(raw)))], bias)


def reference(head: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.roseinfer.row_argmax(head.forward(x))


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    (va, ia), (vb, ib) = a, b
    both_nan = va.isnan() & vb.isnan()
    return torch.equal(ia, ib) and bool(((va == vb) | both_nan).all())


def greedy_head_or_skip(head: object) -> object:
    if not head.has_greedy():
        pytest.skip("this build has no int8 pass for the greedy head (AVX-512 VNNI, VBMI)")
    return head


@pytest.mark.parametrize("n,k", [(49152, 576), (1000, 64), (37, 32), (4099, 128)])
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 12, 16, 23, 64])
def test_greedy_is_the_argmax_of_the_logits(n: int, k: int, rows: int) -> None:
    head = greedy_head_or_skip(q8_head(n, k, seed=n + rows, ties=n == 1000))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen) * 3
    assert same(head.greedy(x), reference(head, x))


def test_greedy_odd_rows_and_ties() -> None:
    """Rows of zeros (every logit 0: id 0), with a NaN, an inf, values whose sums
    overflow fp32, one block alone, and logits tied across panels."""
    head = greedy_head_or_skip(q8_head(1000, 64, seed=3, ties=True))
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(0))  # 5+: the int8 pass
    x[0] = 0
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    x[3] = 3e38
    x[4, 32:] = 0
    x[5] *= 1e-30  # tiny: the int16 and int8 roundings alike
    got, want = head.greedy(x), reference(head, x)
    assert same(got, want)
    assert int(got[1][0]) == int(want[1][0]) == 0  # all-zero logits: the first id


@pytest.mark.parametrize("seed", range(4))
def test_greedy_when_the_int8_logits_rank_otherwise(seed: int) -> None:
    """One large activation per 16 values: the int8 pass rounds every other value of
    the row to 0, and each column's weight there is its block's largest (0.1: the same
    integer in every column), so the int8 logits are all about equal and their argmax
    is the first panel, while the exact one lies anywhere: only the bound finds it."""
    rng = np.random.default_rng(seed)
    n, k = 2048, 64
    w = rng.uniform(-0.09, 0.09, (n, k)).astype(np.float32)
    w[:, ::16] = 0.1
    raw = gguf.quants.quantize(w, T.Q8_0).view(np.uint8).reshape(n, -1)
    head = greedy_head_or_skip(
        make_gguf_linear([(int(T.Q8_0), torch.from_numpy(np.ascontiguousarray(raw)))], None))
    x = torch.from_numpy(rng.standard_normal((12, k)).astype(np.float32))  # 5+: the int8 pass
    x[:, ::16] = 1000.0
    got, want = head.greedy(x), reference(head, x)
    assert same(got, want)
    assert int(want[1].max()) >= 16  # the exact argmax outside the first panel somewhere


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), kb=st.integers(1, 6), rows=st.integers(1, 40),
       scale=st.sampled_from([1e-3, 1.0, 50.0]), seed=st.integers(0, 2**16))
def test_greedy_matches_for_any_head(n: int, kb: int, rows: int, scale: float, seed: int) -> None:
    head = greedy_head_or_skip(q8_head(n, 32 * kb, seed=seed, ties=seed % 2 == 0))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32 * kb, generator=gen) * scale
    assert same(head.greedy(x), reference(head, x))


def test_only_a_q8_0_head_without_bias_has_greedy() -> None:
    assert not q8_head(64, 32, seed=1, bias=torch.zeros(64)).has_greedy()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    raw = gguf.quants.quantize(w, T.Q4_0).view(np.uint8).reshape(64, -1)
    q4 = make_gguf_linear([(int(T.Q4_0), torch.from_numpy(np.ascontiguousarray(raw)))], None)
    assert not q4.has_greedy()
    with pytest.raises(RuntimeError, match="greedy"):
        q4.greedy(torch.zeros(1, 32))
