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

from pathlib import Path

import pytest

from roseinfer.bench.requantize import requantize
from roseinfer.model.loader import default_model_path
from tests.model.test_quantize import gate_figures, prompt_stats


@pytest.mark.slow  # writes the default model again (~150 MB) and runs the text twice
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_quality_gate_gguf_format_as_stored(fmt: str, tmp_path: Path) -> None:
    path = requantize(default_model_path(), tmp_path / f"default-{fmt}.gguf", fmt)
    ppl_change, agreement = gate_figures(
        prompt_stats("none", str(path), kv_cache_memory_gb=0.1),
        prompt_stats("auto", str(path), kv_cache_memory_gb=0.1), fmt)
    assert agreement >= 0.98
    assert abs(ppl_change) <= 0.01
