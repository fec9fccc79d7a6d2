"""The real default model (bundled GGUF), loaded once per test session."""

from __future__ import annotations

import pytest
import torch

from roseinfer.llm import LLM
from roseinfer.model.loader import default_model_path


@pytest.fixture(scope="session")
def default_llm() -> LLM:
    return LLM(max_num_batched_tokens=512, quantization="none")  # exact fp32: compared with HF


@pytest.fixture(scope="session")
def hf_reference():
    """HF transformers' own load of the same GGUF (dequantized to fp32)."""
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()
