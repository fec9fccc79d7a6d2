"""Helpers for the tensor-parallel tests: tiny random HF models saved to disk (every
rank loads its shard from there) and engines over them, one thread per rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil
import torch
import transformers

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 23], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40, 41, 42],
           [200, 3], [33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188,
                      199, 210, 221, 232, 243, 254]]


def _save(model: transformers.PreTrainedModel, path: Path) -> Path:
    with torch.no_grad():  # norms start at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return path


def _save_tokenizer(path: Path) -> None:
    """A tiny byte-level BPE tokenizer (ids it lacks decode to nothing)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["hello world, hello there, tensor parallel"] * 20, trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>",
                                         eos_token="</s>").save_pretrained(path)


def save_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random 2-layer Llama (head_dim 32: int8-shardable) saved as safetensors."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=301, hidden_size=192, intermediate_size=224, num_hidden_layers=2,
               num_attention_heads=6, num_key_value_heads=3, head_dim=32,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=False)
    cfg.update(overrides)
    return _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval(), path)


def save_gpt2(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random 2-layer GPT-2 (4 heads of 32, tied embeddings) saved as safetensors."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=257, n_embd=128, n_layer=2, n_head=4, n_positions=256,
               bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    return _save(transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval(), path)


def engine(path: Path | None, size: int = 2, **options: Any) -> LLMEngine:
    """An engine over ``path`` with ``size`` ranks of one thread each."""
    options.setdefault("num_threads", 1)
    options.setdefault("num_kv_blocks", 128)
    options.setdefault("block_size", 4)
    options.setdefault("quantization", "none")
    options.setdefault("weight_cache", False)
    return LLMEngine(EngineConfig(model=None if path is None else str(path),
                                  tensor_parallel_size=size, **options))


def greedy(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def generate(eng: LLMEngine, prompts: list[Any], params: SamplingParams,
             max_steps: int = 2000) -> list[RequestOutput]:
    """Every prompt at once, continuously batched; outputs in prompt order."""
    ids = []
    for prompt in prompts:
        ids.append(eng.next_request_id())
        eng.add_request(ids[-1], prompt, params)
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out
    assert len(done) == len(ids), "the engine did not finish"
    return [done[i] for i in ids]


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def workers() -> list[psutil.Process]:
    """This process's live tensor-parallel workers (the ones it started itself)."""
    me = os.getpid()
    found = []
    for child in psutil.Process().children():
        try:
            cmd = child.cmdline()
            if ("tp-worker" in cmd and "--parent-pid" in cmd and str(me) in cmd
                    and child.status() != psutil.STATUS_ZOMBIE):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found
