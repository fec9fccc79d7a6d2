"""The quality gate for GGUF formats used as stored, on the default model's weights.

The default model (Q4_1, embedding Q8_0) is written again in each format gguf-py can
write (``roseinfer.bench.requantize``); each file then runs as stored (its format's
kernel, int16 activations: ``quantization="auto"``) and in exact fp32 of the SAME
dequantized weights (``"none"``). On the gate's ~1.1k-token text (tests/data/
quality_text.txt) a format that can be a default needs top-1 next-token agreement
>= 98% and perplexity within 1% of that fp32 model. The file's own format (Q4_1) is
gated in test_quantize.py; this covers the others.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from roseinfer.bench.requantize import requantize
from roseinfer.llm import LLM
from roseinfer.model.loader import default_model_path
from roseinfer.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "data" / "quality_text.txt"


def _prompt_stats(model: Path, quantization: str) -> tuple[list[float], list[int]]:
    """Logprob of each actual next token and the model's top-1 token, per position."""
    llm = LLM(model=str(model), quantization=quantization, max_num_batched_tokens=512,
              kv_cache_memory_gb=0.1)
    out = llm.generate(TEXT.read_text(), SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    entries = out.prompt_logprobs[1:]
    targets = out.prompt_token_ids[1:]
    logprobs = [e[t].logprob for e, t in zip(entries, targets, strict=True)]
    top1 = [next(tid for tid, lp in e.items() if lp.rank == 1) for e in entries]
    return logprobs, top1


@pytest.mark.slow  # writes the default model again (~150 MB) and runs the text twice
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_quality_gate_gguf_format_as_stored(fmt: str, tmp_path: Path) -> None:
    path = requantize(default_model_path(), tmp_path / f"default-{fmt}.gguf", fmt)
    ref_lp, ref_top = _prompt_stats(path, "none")
    lp, top = _prompt_stats(path, "auto")
    assert len(ref_lp) > 1000
    ppl_ref = math.exp(-sum(ref_lp) / len(ref_lp))
    ppl = math.exp(-sum(lp) / len(lp))
    agreement = sum(a == b for a, b in zip(ref_top, top, strict=True)) / len(top)
    print(f"{fmt}: ppl {ppl:.3f} vs fp32 {ppl_ref:.3f} ({100 * (ppl / ppl_ref - 1):+.2f}%), "
          f"top-1 agreement {100 * agreement:.2f}%")
    assert agreement >= 0.98
    assert abs(ppl / ppl_ref - 1) <= 0.01
