"""Tiny random HF models converted to roseinfer engines, for fast engine tests.

Their engines run on ``engine_device()``: the CPU, or the device named by
``ROSEINFER_TEST_DEVICE`` (``cuda``), so the engine suites can be run on a GPU too
(docs/testing.md, On a GPU)."""

from __future__ import annotations

import os

import torch
import transformers

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.model.config import ModelConfig
from roseinfer.model.registry import create_model


def tiny_hf_llama(seed: int = 0, vocab: int = 256, max_positions: int = 512
                  ) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def engine_device() -> str:
    """Where the tests' engines run: ``ROSEINFER_TEST_DEVICE``, else the CPU."""
    return os.environ.get("ROSEINFER_TEST_DEVICE", "cpu")


def engine_from_hf(hf_model: transformers.PreTrainedModel, **options) -> LLMEngine:
    mcfg = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    options.setdefault("device", engine_device())
    dtype = getattr(torch, str(options.get("dtype", "float32")))
    model = create_model(mcfg, dtype, torch.device(options["device"]))
    model.load_weights(hf_model.state_dict().items())
    options.setdefault("num_threads", 1)
    options.setdefault("quantization", "none")  # exact: compared with HF
    return LLMEngine(EngineConfig(**options), model=model, model_config=mcfg)
