"""Random PEFT LoRA adapters over the tiny GQA Llama, and a runner that records each
request's sampled logits rows (for the LoRA tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from roseinfer.engine.engine import LLMEngine
from roseinfer.lora import LoRARequest
from roseinfer.sampling_params import SamplingParams
from tests.engine.invariance_helpers import recording, tiny_gqa_llama

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path: Path, seed: int, r: int = 8, alpha: float = 16,
                 targets: list[str] | None = None, **config: object
                 ) -> transformers.PreTrainedModel:
    """Save a random LoRA (A and B random, scaled small) over ``tiny_gqa_llama(0)`` to
    ``path``; return PEFT's merged fp32 model (the reference)."""
    peft = pytest.importorskip("peft")
    base = tiny_gqa_llama(0)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                          init_lora_weights=False, **config)
    model = peft.get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(str(path))
    return model.merge_and_unload().eval()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


Job = tuple[str, list[int], int, LoRARequest | None]  # id, prompt, max_tokens, adapter


def run_jobs(engine: LLMEngine, jobs: list[Job], max_steps: int = 2000
             ) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Add every job at once, step until all finish: (tokens, logits rows) per id."""
    tokens: dict[str, list[int]] = {}
    with recording(engine) as rec:
        for rid, prompt, max_tokens, lora in jobs:
            engine.add_request(rid, prompt, greedy(max_tokens), lora_request=lora)
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert not engine.has_unfinished_requests(), "the engine did not finish"
    return tokens, {rid: list(rec.rows[rid]) for rid, *_ in jobs}
