"""Helpers for the model-family tests: tiny random HF models of every family and a paged
runner feeding them a schedule of prefill chunks and decodes (imported explicitly).

The KV cache starts as NaN so reading any never-written slot would poison the outputs;
blocks come from a shuffled pool, so block tables are never contiguous.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import transformers

from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata
from roseinfer.model.config import ModelConfig
from roseinfer.model.registry import create_model

BLOCK_SIZE = 4
NUM_BLOCKS = 96
CPU = torch.device("cpu")
WINDOW = 8

_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
_LONG = [1.0 + 0.35 * i for i in range(6)]  # longrope factors for a 12-channel rotary dim
_SHORT = [1.0 + 0.05 * i for i in range(6)]

CASES: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama3.2": lambda: transformers.LlamaConfig(
        **{**_BASE, "num_hidden_layers": 3}, rope_scaling=dict(_LLAMA3), tie_word_embeddings=True),
    "qwen2.5": lambda: transformers.Qwen2Config(  # a real Qwen2.5 config: window off
        **_BASE, tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
        max_window_layers=21),
    "qwen2_window": lambda: transformers.Qwen2Config(
        **_BASE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": lambda: transformers.Qwen3Config(**_BASE, head_dim=32),
    "mistral_window": lambda: transformers.MistralConfig(**_BASE, sliding_window=WINDOW),
    "phi3_window": lambda: transformers.Phi3Config(**_BASE, sliding_window=WINDOW),
    "phi4_mini": lambda: transformers.Phi3Config(  # longrope + partial rotary, tied
        **{**_BASE, "hidden_size": 96, "intermediate_size": 128}, partial_rotary_factor=0.5,
        original_max_position_embeddings=48, tie_word_embeddings=True,
        rope_scaling={"type": "longrope", "long_factor": _LONG, "short_factor": _SHORT}),
    "phi3_128k": lambda: transformers.Phi3Config(  # longrope, full rotary: the C++ stack
        **_BASE, original_max_position_embeddings=48,
        rope_scaling={"type": "longrope", "long_factor": [1.0 + 0.3 * i for i in range(8)],
                      "short_factor": [1.0 + 0.04 * i for i in range(8)]}),
    "gemma": lambda: transformers.GemmaConfig(**_BASE, head_dim=16, hidden_act="gelu"),
    "gemma2": lambda: transformers.Gemma2Config(
        **{**_BASE, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW,
        query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=4.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**_BASE, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW,
        query_pre_attn_scalar=24, sliding_window_pattern=2, rope_local_base_freq=100.0,
        rope_theta=5000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}
_HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM,
    "phi3": transformers.Phi3ForCausalLM, "gemma": transformers.GemmaForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM, "gemma3_text": transformers.Gemma3ForCausalLM,
}


def hf_model(case: str) -> transformers.PreTrainedModel:
    """A tiny random fp32 HF model of ``case``; every tensor re-randomised so all matter."""
    cfg = CASES[case]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = _HF_CLASSES[cfg.model_type](cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            gemma_norm = cfg.model_type.startswith("gemma") and "norm" in name
            if "norm" in name and not gemma_norm:
                p.copy_(1.0 + 0.1 * noise)
            else:  # Gemma norms multiply by (1 + weight): small weights
                p.copy_((0.1 if gemma_norm else 0.15) * noise)
    return model


def ours(hf: transformers.PreTrainedModel, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Our model of the same config and weights (exact fp32: no quantization)."""
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = create_model(config, dtype, CPU)
    model.load_weights(hf.state_dict().items())
    return model


def schedule_for(chunks: list[list[int]], starts: list[int]) -> list[list[tuple[int, int]]]:
    """Steps [(seq, num_new)] from each sequence's chunk sizes (prefill chunks, then 1s for
    decodes) starting at step ``starts[seq]``; one-token entries first in every step."""
    steps: list[list[tuple[int, int]]] = []
    for step in range(max(s + len(c) for s, c in zip(starts, chunks, strict=True))):
        entries = [(seq, c[step - s]) for seq, (s, c) in enumerate(zip(starts, chunks, strict=True))
                   if s <= step < s + len(c)]
        steps.append(sorted(entries, key=lambda e: e[1] != 1))
    return steps


def run_schedule(
    model: torch.nn.Module,
    tokens: list[torch.Tensor],
    schedule: list[list[tuple[int, int]]],
    dtype: torch.dtype = torch.float32,
    shared_prefix: dict[int, tuple[int, int]] | None = None,
) -> list[torch.Tensor]:
    """Feed ``tokens[s]`` step by step; returns every fed token's logits per sequence.

    ``shared_prefix[s] = (donor, n_blocks)``: sequence ``s`` starts with the donor's
    first ``n_blocks`` blocks already computed (a prefix-cache hit; same tokens)."""
    config = model.config
    shape = (2, NUM_BLOCKS * BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(config.num_layers)]
    pool = list(range(NUM_BLOCKS))
    random.Random(7).shuffle(pool)
    tables: list[list[int]] = [[] for _ in tokens]
    computed = [0] * len(tokens)
    logits: list[list[torch.Tensor]] = [[] for _ in tokens]
    for step in schedule:
        specs, ids = [], []
        for s, n in step:
            if computed[s] == 0 and shared_prefix and s in shared_prefix:
                donor, n_blocks = shared_prefix[s]
                tables[s] = list(tables[donor][:n_blocks])
                computed[s] = n_blocks * BLOCK_SIZE
            while len(tables[s]) * BLOCK_SIZE < computed[s] + n:
                tables[s].append(pool.pop())
            specs.append(SeqSpec(computed[s], n, list(tables[s])))
            ids.append(tokens[s][computed[s]: computed[s] + n])
        meta = build_attention_metadata(specs, BLOCK_SIZE, CPU)
        with torch.inference_mode():
            hidden = model(torch.cat(ids), meta.positions, caches, meta)  # [T, hidden]
            step_logits = model.compute_logits(hidden)  # [T, V]
        for j, (s, n) in enumerate(step):
            start = int(meta.logits_indices[j]) - n + 1
            logits[s].append(step_logits[start: start + n])
            computed[s] += n
    return [torch.cat(chunks) for chunks in logits]


def random_tokens(vocab: int, lengths: list[int], seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]
