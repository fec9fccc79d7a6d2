"""Weight formats: fp16 linears match fp32 closely, and the quality gate on the default model.

Gate on a fixed ~1.1k-token text (tests/data/quality_text.txt), measured through the
engine's prompt logprobs against fp32: a format that can be the default ("int8", "fp16")
needs top-1 next-token agreement >= 98% and perplexity within 1%; the opt-in
"fp16+bf16" (bf16 activations in large GEMMs) >= 95% and 2%.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from roseinfer.config import EngineConfig
from roseinfer.model.quantize import Fp16Linear, quantize_model
from roseinfer.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "data" / "quality_text.txt"


def test_fp16_linear_close_to_fp32() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True)
    fp16 = Fp16Linear(lin.weight, lin.bias, use_fbgemm=True)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = lin(x)
        got = fp16(x)
        # The only error is the weight rounding: compare with fp16-rounded weights in fp32.
        rounded = nn.functional.linear(x, lin.weight.half().float(), lin.bias)
    torch.testing.assert_close(got, rounded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_fp16_cast_path_for_other_dtypes() -> None:
    lin = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    fp16 = Fp16Linear(lin.weight, None, use_fbgemm=True)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert fp16(x).dtype == torch.bfloat16
    torch.testing.assert_close(fp16(x), lin(x), rtol=2e-2, atol=2e-2)


def test_config_quantization_choices() -> None:
    assert EngineConfig(quantization="fp16").quantization == "fp16"
    assert EngineConfig(quantization="int8").resolved_kv_cache_dtype("cpu") == "float16"
    with pytest.raises(ValueError):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError):
        quantize_model(nn.Linear(2, 2), "int4")
    auto = EngineConfig()
    assert auto.quantization == "auto"
    assert auto.resolved_quantization("cpu") == "int8"
    assert auto.resolved_kv_cache_dtype("cpu") == "float16"
    assert auto.resolved_quantization("cuda") == "none"
    assert auto.resolved_kv_cache_dtype("cuda") == "float32"
    assert EngineConfig(quantization="fp16+bf16").resolved_quantization("cpu") == "fp16+bf16"
    assert EngineConfig(kv_cache_dtype="float32").resolved_kv_cache_dtype("cpu") == "float32"
    assert EngineConfig(kv_cache_dtype="int8").resolved_kv_cache_dtype("cpu") == "int8"
    with pytest.raises(ValueError):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig(dtype="bfloat16").resolved_quantization("cpu") == "none"
    assert EngineConfig(quantization="none").resolved_quantization("cpu") == "none"


def prompt_stats(quantization: str, model: str | None = None,
                 **options: object) -> tuple[list[float], list[int]]:
    """Logprob of each actual next token and the model's top-1 token, per position, over
    the gate's text (``model``: the default model when None)."""
    from roseinfer.llm import LLM

    llm = LLM(model, quantization=quantization, max_num_batched_tokens=512, **options)
    out = llm.generate(TEXT.read_text(), SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    entries = out.prompt_logprobs[1:]
    targets = out.prompt_token_ids[1:]
    logprobs = [e[t].logprob for e, t in zip(entries, targets, strict=True)]
    top1 = [next(tid for tid, lp in e.items() if lp.rank == 1) for e in entries]
    return logprobs, top1


def gate_figures(ref: tuple[list[float], list[int]], got: tuple[list[float], list[int]],
                 label: str) -> tuple[float, float]:
    """(relative perplexity change, top-1 agreement) of ``got`` against ``ref`` (fp32),
    both ``prompt_stats``; printed under ``label``."""
    (ref_lp, ref_top), (lp, top) = ref, got
    assert len(ref_lp) > 1000
    ppl_ref = math.exp(-sum(ref_lp) / len(ref_lp))
    ppl = math.exp(-sum(lp) / len(lp))
    agreement = sum(a == b for a, b in zip(ref_top, top, strict=True)) / len(top)
    print(f"{label}: ppl {ppl:.3f} vs fp32 {ppl_ref:.3f} "
          f"({100 * (ppl / ppl_ref - 1):+.2f}%), top-1 agreement {100 * agreement:.2f}%")
    return ppl / ppl_ref - 1, agreement


@pytest.fixture(scope="module")
def fp32_stats() -> tuple[list[float], list[int]]:
    """The gate's reference, computed once for every format below."""
    return prompt_stats("none")


@pytest.mark.slow  # the default model over a 1,128-token text, per format
@pytest.mark.parametrize("quantization",
                         ["fp16", "fp16+bf16", "int8", "none/int8", "auto/int8"])
def test_quality_gate_default_model(quantization: str, fp32_stats) -> None:
    """Weight formats, and (after a slash) the int8 KV cache, opt-in and held to the
    opt-in bound: over exact weights it sits at the gate's line, by machine (top-1 98.4% on
    an AVX2 EPYC, 97.25% on an AVX-512 Xeon, perplexity +0.1% / +0.03%), and over the
    default weights the errors add up (96.8% / 97.25%)."""
    weights, _, kv_dtype = quantization.partition("/")
    options = {"kv_cache_dtype": kv_dtype} if kv_dtype else {}
    ppl_change, agreement = gate_figures(fp32_stats, prompt_stats(weights, **options),
                                         quantization)
    default_capable = quantization not in ("fp16+bf16", "none/int8", "auto/int8")
    assert agreement >= (0.98 if default_capable else 0.95)
    assert abs(ppl_change) <= (0.01 if default_capable else 0.02)
