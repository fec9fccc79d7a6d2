"""The C++ row argmax (greedy picks) is torch's max(dim=-1) / argmax bit for bit."""

from __future__ import annotations

import pytest
import torch

from roseinfer.kernels import cpu_kernels_available
from roseinfer.runner.sampler import row_max

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels unavailable")

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("v", [1, 5, 8, 13, 64, 49152 + 3])  # scalar tail, vector body, both
def test_row_argmax_equals_torch(v: int) -> None:
    g = torch.Generator().manual_seed(v)
    x = torch.randn(20, v, generator=g)  # 20 rows: split over the threads
    x[1] = 0.0  # every entry ties
    x[2, :] = -INF
    x[3, v // 2] = NAN
    x[4, v - 1] = INF
    x[5, v // 3] = x[5, v - 1] = x[5].max() + 1  # tie: the first one
    x[6] = -0.0
    x[6, v - 1] = 0.0  # -0.0 == 0.0: index 0
    x[7, v - 1], x[7, 0] = NAN, INF
    x[8] = torch.randint(-2, 3, (v,), generator=g).float()  # many exact ties
    values, ids = torch.ops.roseinfer.row_argmax(x)
    want_values, want_ids = x.max(dim=-1)
    assert torch.equal(ids, want_ids) and torch.equal(ids, x.argmax(dim=-1))
    assert torch.equal(values.isnan(), want_values.isnan())
    assert torch.equal(values.nan_to_num(0.0), want_values.nan_to_num(0.0))
    assert ids[3] == v // 2 and ids[7] == v - 1 and ids[6] == 0


def test_row_max_falls_back_to_torch() -> None:
    """Logits the kernel does not take (float64, non-contiguous rows) get torch's answer."""
    x = torch.randn(3, 40, dtype=torch.float64)
    values, ids = row_max(x)
    assert torch.equal(ids, x.argmax(dim=-1)) and values.dtype == torch.float64
    y = torch.randn(40, 3).t()  # float32, strided: the kernel copies it
    assert torch.equal(row_max(y)[1], y.argmax(dim=-1))
