"""Issue 27: the batch-invariance contract holds with the int8 KV cache
(``kv_cache_dtype="int8"``): a row's K/V bytes depend on that token alone, so a
request's logits are bitwise the same alone or batched, chunked, from the prefix cache
or recomputed after preemption.  The cases are test_batch_invariance's own, run here
with the default weights ("auto") over an int8 pool (``KV_INT8``)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.invariance_helpers import (
    KV_INT8,
    Arrival,
    cpu_kernels,
    greedy,
    make_engine,
    random_prompt,
)
from tests.engine.test_batch_invariance import (  # noqa: F401 - collected here, with quant below
    alone,
    hf_model,
    kernels,
    test_alone_vs_batched,
    test_preempted_and_recomputed,
    test_prefix_cache_hit,
    test_prompt_chunking,
)


@pytest.fixture(params=KV_INT8)
def quant(request: pytest.FixtureRequest) -> str:
    return request.param


def test_the_pool_is_int8(hf_model) -> None:  # noqa: F811 - the imported fixture
    engine = make_engine(hf_model, KV_INT8[0])
    assert engine.kv_dtype == torch.int8
    assert all(c.dtype == torch.int8 for c in engine.runner.kv_caches)


def test_pytorch_fallback_reads_the_same_cache(hf_model) -> None:  # noqa: F811
    """The PyTorch path (any device) quantizes and attends like the kernels: the first
    logits row of a prompt agrees closely (not bitwise: its GEMMs round differently; exact
    fp32 weights, which both paths share)."""
    target = Arrival(0, "target", random_prompt(random.Random(8), 50), greedy(1))
    with cpu_kernels(False):
        fallback = alone(hf_model, "none/int8", target)
    with cpu_kernels(True):
        kernel = alone(hf_model, "none/int8", target)
    want, got = kernel.rows("target")[0], fallback.rows("target")[0]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))
