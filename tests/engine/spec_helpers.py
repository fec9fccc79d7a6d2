"""Helpers for the speculative decoding tests: a tiny random Llama whose greedy text
partly repeats itself (so n-gram drafts are sometimes accepted and sometimes not),
prompts that repeat a passage, a one-character-per-token tokenizer for stop strings,
and a runner that records, per request, the tokens each step emitted."""

from __future__ import annotations

import functools
import random
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import transformers

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.engine.stats import EngineStats
from roseinfer.model.config import ModelConfig
from roseinfer.model.registry import create_model
from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import SamplingParams
from tests.engine.invariance_helpers import VOCAB, tiny_gqa_llama

# Every proposed draft is fed (adaptive off): the tests want drafts, accepted or not.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "adaptive": False}


@functools.cache
def varied_llama() -> transformers.PreTrainedModel:
    """``tiny_gqa_llama`` with its weights scaled up: sharper logits, so its greedy text
    varies (the unscaled one soon repeats one token) but still repeats in places."""
    hf = tiny_gqa_llama(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    return hf


class CharTokenizer:
    """Token t decodes to its own character (``char(t)``); EOS ids to '' when skipped."""

    def __init__(self, eos_token_ids: tuple[int, ...] = (2,)) -> None:
        self.eos_token_ids = eos_token_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if skip_special_tokens and t in self.eos_token_ids else char(t)
                       for t in ids)


def char(token: int) -> str:
    return chr(0x4E00 + token)


def text(tokens: list[int]) -> str:
    return "".join(char(t) for t in tokens)


def spec_engine(spec: dict | None, quantization: str = "auto",
                tokenizer: CharTokenizer | None = None, **options: object) -> LLMEngine:
    """An engine over ``varied_llama`` (one thread, 1024 blocks unless told)."""
    hf = varied_llama()
    mcfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = create_model(mcfg, torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    options.setdefault("num_threads", 1)
    options.setdefault("num_kv_blocks", 1024)
    cfg = EngineConfig(quantization=quantization, speculative_config=spec, **options)
    return LLMEngine(cfg, model=model, model_config=mcfg,
                     tokenizer=tokenizer)  # type: ignore[arg-type]


def repeat_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a random passage 1-4 times, then go on with random tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        passage = [rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 30))]
        prompts.append(passage * rng.randint(1, 4) + [rng.randrange(3, VOCAB)
                                                      for _ in range(5)])
    return prompts


@dataclass
class SpecRun:
    outputs: dict[str, RequestOutput]  # the final output of each request
    deltas: dict[str, list[list[int]]] = field(default_factory=lambda: defaultdict(list))
    texts: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    stats: EngineStats | None = None
    num_steps: int = 0

    def tokens(self, rid: str, index: int = 0) -> list[int]:
        return list(self.outputs[rid].outputs[index].token_ids)


def run_requests(engine: LLMEngine, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams], max_steps: int = 5000
                 ) -> SpecRun:
    """Add every prompt (ids ``r0``, ``r1``, ...), step until all finish; checks that
    every KV block is free afterwards."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params[i] if isinstance(params, list) else params)
    run = SpecRun({})
    while engine.has_unfinished_requests():
        assert run.num_steps < max_steps, "the engine did not finish"
        for out in engine.step():
            assert out.error is None, out.error
            for c in out.outputs:
                if c.delta_token_ids or c.delta_text:
                    run.deltas[out.request_id].append(list(c.delta_token_ids))
                    run.texts[out.request_id].append(c.delta_text)
            if out.finished:
                run.outputs[out.request_id] = out
        run.num_steps += 1
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    run.stats = engine.get_stats()
    return run


def greedy(max_tokens: int = 40, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
