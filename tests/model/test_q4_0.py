"""quantization "q4_0": float weights quantized to GGUF Q4_0 at load (``kernels/q4_0.py``).

The bytes are the ``gguf`` package's (llama.cpp's reference quantizer) for the same
values; the layers run the GGUF Q4_0 kernel; the model equals the exact model of the
dequantized weights within the activations' rounding; batch-invariant; the weight cache
gives it back bitwise; a GGUF's F16 matrices get the same treatment."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from conftest_loader import tiny_llama  # noqa: E402
from family_helpers import random_tokens, run_schedule, schedule_for  # noqa: E402

from roseinfer.config import EngineConfig  # noqa: E402
from roseinfer.kernels import cpu_kernels_available  # noqa: E402
from roseinfer.kernels.q4_0 import quantize_q4_0  # noqa: E402
from roseinfer.model import factory  # noqa: E402
from roseinfer.model.quantize import Fp16Linear, linear_paths  # noqa: E402

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(not cpu_kernels_available(),
                                   reason="Q4_0 layers need the C++ kernels")


def gguf_q4_0(w: torch.Tensor) -> np.ndarray:
    return gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q4_0)


def test_bytes_are_the_gguf_packages() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 256, generator=gen)
    w[0, :32] = 0  # d == 0: every q is 8
    w[1, :32] = torch.tensor([1.0, -1.0] * 16)  # ties of magnitude: the first wins
    w[2, :32] = torch.arange(32) - 16.0
    w[3] *= 1e-6
    w[4] *= 1e4
    assert np.array_equal(quantize_q4_0(w).numpy(), gguf_q4_0(w))
    assert np.array_equal(quantize_q4_0(w.bfloat16()).numpy(), gguf_q4_0(w.bfloat16()))
    with pytest.raises(ValueError, match="32-blocks"):
        quantize_q4_0(torch.zeros(2, 48))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=32, max_size=32),
       st.integers(0, 31), st.sampled_from([1.0, -1.0]))
def test_any_block_quantizes_as_the_gguf_package(values: list[float], at: int,
                                                 sign: float) -> None:
    w = torch.tensor([values, values], dtype=torch.float32)
    w[1, at] = sign * w[1].abs().max()  # a tie of magnitude with another value
    assert np.array_equal(quantize_q4_0(w).numpy(), gguf_q4_0(w))


def q4_0_values(exact: nn.Module, model: nn.Module) -> nn.Module:
    """``exact`` with every decoder linear's weight replaced by its Q4_0 values (gguf's
    dequantizer); checks that ``model`` runs a kernel for each of its layers."""
    for path in linear_paths(exact):  # (the converted model's are Fp16Linear now)
        layer = model.get_submodule(path)
        assert isinstance(layer, Fp16Linear) and layer.kernel is not None
        if path != "lm_head":
            weight = exact.get_submodule(path).weight
            deq = gguf.quants.dequantize(gguf_q4_0(weight), gguf.GGMLQuantizationType.Q4_0)
            weight.data.copy_(torch.from_numpy(deq).reshape(weight.shape))
    return exact


def relative_error(model: nn.Module, exact: nn.Module, tokens: list[torch.Tensor]) -> float:
    """Largest |logit - exact logit| over the largest |exact logit|: with exact holding
    the same weights' values, only the activations' rounding (int16; int8 in front of
    gate/up) and the int8 LM head remain."""
    got = run_schedule(model, tokens, [[(0, len(tokens[0]))]])[0]
    want = run_schedule(exact, tokens, [[(0, len(tokens[0]))]])[0]
    return ((got - want).abs().max() / want.abs().max()).item()


def load(path: Path, quantization: str, cache: bool = False) -> nn.Module:
    return factory.load_model(path, torch.float32, CPU, quantization, cache)[0]


@needs_kernels
def test_hf_checkpoint_runs_q4_0_layers(tmp_path: Path) -> None:
    hf = tiny_llama(tie=False, hidden_size=128, intermediate_size=256)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "m")
    model = load(tmp_path / "m", "q4_0")
    assert model.quantization == "q4_0"
    exact = q4_0_values(load(tmp_path / "m", "none"), model)
    assert relative_error(model, exact, random_tokens(256, [20])) <= 2e-2
    # Batch invariance: chunked and beside another sequence, bitwise alone.
    tokens = random_tokens(256, [11, 7])
    alone = run_schedule(model, tokens[:1], schedule_for([[11]], [0]))[0]
    mixed = run_schedule(model, tokens, schedule_for([[6, 4, 1], [6, 1]], [0, 1]))[0]
    assert torch.equal(alone[:11], mixed[:11])


@needs_kernels
@pytest.mark.usefixtures("private_cache_dir")  # tests/conftest.py
def test_weight_cache_gives_the_model_back_bitwise(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    hf = tiny_llama(tie=True, hidden_size=128, intermediate_size=256)
    hf.save_pretrained(tmp_path / "m")
    first = load(tmp_path / "m", "q4_0", cache=True)

    def no_conversion(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the warm start converted again")

    monkeypatch.setattr(factory, "_load", no_conversion)
    warm = load(tmp_path / "m", "q4_0", cache=True)
    monkeypatch.undo()
    int8 = load(tmp_path / "m", "int8", cache=True)  # another format: its own entry
    tokens = random_tokens(256, [9])
    a, b, c = (run_schedule(m, tokens, [[(0, 9)]])[0] for m in (first, warm, int8))
    assert torch.equal(a, b) and not torch.equal(a, c)


@needs_kernels
def test_gguf_f16_matrices_requantized_to_q4_0(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    from roseinfer.bench.random_gguf import ModelShape, write_random_gguf
    from roseinfer.model.gguf_stream import gguf_kernels_loaded

    if not gguf_kernels_loaded():
        pytest.skip("the C++ GGUF kernels are unavailable")
    shape = ModelShape("tiny-llama", "llama", 256, 2, 4, 2, 512, tied=True, context=640,
                       rope_theta=10000.0)
    tokenizer = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.bos_token_id": 1,
                 "tokenizer.ggml.eos_token_id": 2,
                 "tokenizer.ggml.tokens": [f"t{i}" for i in range(256)]}
    path = tmp_path / "f16.gguf"
    write_random_gguf(path, shape, "F16", seed=1, tokenizer=tokenizer)
    with caplog.at_level("INFO", logger="roseinfer.model"):
        model = factory.load_model(path, torch.float32, CPU, "q4_0", weight_cache=False,
                                   requantize_16bit=True)[0]
    assert "requantized to Q4_0 (the LM head Q8_0) at load" in caplog.text
    assert model.quantization == "q4_0"
    assert relative_error(model, q4_0_values(load(path, "none"), model),
                          random_tokens(256, [16])) <= 2e-2


def test_engine_option() -> None:
    config = EngineConfig(quantization="q4_0")
    assert config.resolved_quantization("cpu") == "q4_0" and config.requantize_16bit_gguf()
    with pytest.raises(ValueError, match="q4_0"):
        EngineConfig(quantization="q4_0", tensor_parallel_size=2)


def test_conversions_in_row_chunks_equal_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_0 and int8 conversions quantize a few rows at a time (bounded temporaries): the
    same bytes as one pass over the matrix, whatever the chunk."""
    import roseinfer.kernels as kernels
    import roseinfer.kernels.q4_0 as q4_0

    w = torch.randn(37, 96, generator=torch.Generator().manual_seed(1))
    whole_q4 = gguf_q4_0(w)
    whole_q8 = kernels.quantize_int8_blocks(w)
    for values in (96, 5 * 96, 1000):  # one row, 5 rows, 10 rows a chunk
        monkeypatch.setattr(q4_0, "CHUNK_VALUES", values)
        monkeypatch.setattr(kernels, "QUANTIZE_CHUNK_VALUES", values)
        assert np.array_equal(quantize_q4_0(w).numpy(), whole_q4)
        q, s = kernels.quantize_int8_blocks(w)
        assert torch.equal(q, whole_q8[0]) and torch.equal(s, whole_q8[1])
