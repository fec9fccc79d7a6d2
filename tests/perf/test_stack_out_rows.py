"""The decoder stack's ``out_rows``: rows nobody reads stop after the last layer's K/V
writes, and the rows it computes are bitwise those of the whole step."""

from __future__ import annotations

import pytest
import torch

from roseinfer.kernels import cpu_kernels_available
from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata
from roseinfer.model.quantize import quantize_model
from roseinfer.runner.model_runner import StepLayout, output_rows
from tests.perf.test_kernels import _tiny_llama, random_cache

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels unavailable")

# Two decode rows, then prefill chunks of 6 (from scratch) and 5 (after 3 cached) tokens.
SPECS = [SeqSpec(5, 1, [3, 9]), SeqSpec(1, 1, [7]), SeqSpec(0, 6, [0, 2]), SeqSpec(3, 5, [4, 8])]
T = 2 + 6 + 5


def _run(model: torch.nn.Module, caches: list[torch.Tensor], out_rows: list[int] | None,
         bs: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    meta = build_attention_metadata(SPECS, bs, torch.device("cpu"))
    if out_rows is not None:
        meta.out_rows = torch.tensor(out_rows, dtype=torch.long)
    ids = torch.arange(T) * 7 % 97
    caches = [c.clone() for c in caches]
    with torch.inference_mode():
        hidden = model(ids, meta.positions, caches, meta)
    assert model._stack is not None, "the decoder stack should serve this step"
    return hidden, caches


@pytest.mark.parametrize("quantization", ["none", "fp16"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
def test_kept_rows_and_caches_bitwise_the_whole_steps(quantization: str,
                                                      cache_dtype: torch.dtype) -> None:
    model = quantize_model(_tiny_llama(False), quantization)
    cfg, bs = model.config, 4
    gen = torch.Generator().manual_seed(3)
    caches = [random_cache(16 * bs, cfg.num_kv_heads, cfg.head_dim, cache_dtype, gen)
              for _ in range(cfg.num_layers)]
    full, full_caches = _run(model, caches, None, bs)
    # decodes + each chunk's last row (a step that samples all); one prefill chunk's rows;
    # a row of each part; none (a chunk that samples nothing).
    for rows in ([0, 1, 7, 12], [2, 3, 4, 5, 6, 7], [1, 9], []):
        got, got_caches = _run(model, caches, rows, bs)
        assert torch.equal(got[rows], full[rows]), rows
        others = [r for r in range(T) if r not in rows]
        assert torch.equal(got[others], torch.zeros(len(others), cfg.hidden_size)), rows
        for a, b in zip(got_caches, full_caches, strict=True):
            assert torch.equal(a, b), "every row's K/V is written in every layer"


def test_out_rows_must_be_ascending_rows_of_the_step() -> None:
    model = quantize_model(_tiny_llama(False), "none")
    cfg = model.config
    gen = torch.Generator().manual_seed(4)
    caches = [random_cache(64, cfg.num_kv_heads, cfg.head_dim, torch.float32, gen)
              for _ in range(cfg.num_layers)]
    for bad in ([3, 1], [0, T], [2, 2]):
        with pytest.raises(RuntimeError, match="out_rows"):
            _run(model, caches, bad, 4)


def test_output_rows_of_a_layout() -> None:
    def layout(t: int, sample: list[int], prompt: dict | None = None,
               pool: dict | None = None) -> StepLayout:
        return StepLayout(list(range(t)), [], sample, prompt or {}, [], pool or {})

    assert output_rows(layout(3, [0, 1, 2])) is None  # a step of decodes
    assert output_rows(layout(8, [0, 7])) == [0, 7]
    assert output_rows(layout(8, [])) == []  # a chunk that completes nothing
    assert output_rows(layout(8, [0, 7], prompt={1: (1, 8)})) is None  # prompt logprobs
    assert output_rows(layout(9, [8], pool={0: (0, 3)})) == [0, 1, 2, 8]


@pytest.mark.parametrize("case", ["qwen3", "gemma2", "mistral_window"])
def test_per_layer_path_keeps_rows_bitwise(case: str) -> None:
    """Families off the stack: the last layer's residual + MLP run on the rows read."""
    from tests.model.family_helpers import hf_model, ours

    model = quantize_model(ours(hf_model(case)), "fp16")  # the batch-invariant fp16 kernel
    cfg, bs = model.config, 4
    gen = torch.Generator().manual_seed(5)
    caches = [random_cache(16 * bs, cfg.num_kv_heads, cfg.head_dim, torch.float32, gen)
              for _ in range(cfg.num_layers)]
    meta = build_attention_metadata(SPECS, bs, torch.device("cpu"))
    ids = torch.arange(T) * 7 % cfg.vocab_size

    def run(rows: list[int] | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        meta.out_rows = None if rows is None else torch.tensor(rows, dtype=torch.long)
        cs = [c.clone() for c in caches]
        with torch.inference_mode():
            return model(ids, meta.positions, cs, meta), cs

    full, full_caches = run(None)
    assert getattr(model, "_stack", None) is None, f"{case} should run layer by layer"
    for rows in ([0, 1, 7, 12], [1, 9], []):
        got, got_caches = run(rows)
        assert torch.equal(got[rows], full[rows]), (case, rows)
        others = [r for r in range(T) if r not in rows]
        assert not got[others].any(), (case, rows)
        for a, b in zip(got_caches, full_caches, strict=True):
            assert torch.equal(a, b)
