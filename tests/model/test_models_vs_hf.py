"""Compare roseinfer models on a paged KV cache against Hugging Face full-sequence forwards.

Tiny random fp32 models; block size 4 with shuffled, non-contiguous block ids; several
sequences of different lengths per step, chunked prefill mixed with decodes.  The KV
cache starts as NaN so reading any never-written slot would poison the outputs.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata
from roseinfer.model.config import ModelConfig
from roseinfer.model.layers import compute_inv_freq
from roseinfer.model.registry import create_model, get_model_class

BLOCK_SIZE = 4
NUM_BLOCKS = 40
CPU = torch.device("cpu")

_LLAMA_KW = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=160,
    max_position_embeddings=64,
)
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    "llama_gqa": lambda: transformers.LlamaConfig(**_LLAMA_KW),
    "llama_tied_bias": lambda: transformers.LlamaConfig(
        **_LLAMA_KW, tie_word_embeddings=True, attention_bias=True
    ),
    "llama3_rope": lambda: transformers.LlamaConfig(**_LLAMA_KW, rope_scaling=dict(_LLAMA3)),
    "llama_linear_rope": lambda: transformers.LlamaConfig(
        **_LLAMA_KW, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "mistral": lambda: transformers.MistralConfig(**_LLAMA_KW),
    "qwen2": lambda: transformers.Qwen2Config(**_LLAMA_KW),
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=160, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    ),
}
_HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "gpt2": transformers.GPT2LMHeadModel,
}


def _hf_model(case: str) -> transformers.PreTrainedModel:
    cfg = CASES[case]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = _HF_CLASSES[cfg.model_type](cfg).eval()
    # Re-randomise everything (HF zero-inits biases, tiny init std) so every tensor matters.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_norm = "norm" in name or ".ln_" in name
            p.copy_(1.0 + 0.1 * noise if is_norm and name.endswith("weight") else 0.15 * noise)
    return model


def _ours(hf: transformers.PreTrainedModel, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = create_model(config, dtype, CPU)
    model.load_weights(hf.state_dict().items())
    return model


def _kv_caches(config: ModelConfig, dtype: torch.dtype) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS * BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    return [torch.full(shape, float("nan"), dtype=dtype) for _ in range(config.num_layers)]


def _run_schedule(
    model: torch.nn.Module,
    tokens: list[torch.Tensor],
    schedule: list[list[tuple[int, int]]],
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Feed ``tokens[s]`` step by step; step = [(seq, num_new)], returns logits per token."""
    config = model.config
    caches = _kv_caches(config, dtype)
    pool = list(range(NUM_BLOCKS))
    random.Random(7).shuffle(pool)
    tables: list[list[int]] = [[] for _ in tokens]
    computed = [0] * len(tokens)
    logits: list[list[torch.Tensor]] = [[] for _ in tokens]
    for step in schedule:
        specs, ids = [], []
        for s, n in step:
            while len(tables[s]) * BLOCK_SIZE < computed[s] + n:
                tables[s].append(pool.pop())
            specs.append(SeqSpec(computed[s], n, list(tables[s])))
            ids.append(tokens[s][computed[s] : computed[s] + n])
        meta = build_attention_metadata(specs, BLOCK_SIZE, CPU)
        with torch.inference_mode():
            hidden = model(torch.cat(ids), meta.positions, caches, meta)  # [T, hidden]
            step_logits = model.compute_logits(hidden)  # [T, V]
            last = model.compute_logits(hidden[meta.logits_indices])  # [N, V]
        assert step_logits.dtype == torch.float32
        for j, (s, n) in enumerate(step):
            start = int(meta.logits_indices[j]) - n + 1
            logits[s].append(step_logits[start : start + n])
            torch.testing.assert_close(last[j], step_logits[start + n - 1])
            computed[s] += n
    return [torch.cat(chunks) for chunks in logits]


def _tokens(vocab: int, lengths: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


# Sequence lengths: 0 -> 16 (prefill 13 in chunks 5+8, then 3 decodes), 1 -> 12
# (prefill 7 whole, 5 decodes), 2 -> 9 (prefill 6 in chunks 4+2, then decodes),
# 3 -> 3 (one-token prompt: a "decode" with an empty cache, then 2 decodes).
LENGTHS = [16, 12, 9, 3]
SCHEDULE = [
    [(3, 1), (0, 5), (1, 7)],
    [(1, 1), (3, 1), (0, 8), (2, 4)],
    [(0, 1), (1, 1), (3, 1), (2, 2)],
    [(0, 1), (1, 1), (2, 1)],
    [(2, 1), (0, 1), (1, 1)],
    [(1, 1), (2, 1)],
]


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "pytorch-only"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_forward_matches_hf(case: str, kernels: bool, monkeypatch) -> None:
    if not kernels:  # every caller asks roseinfer.kernels first: this forces the fallback
        import roseinfer.kernels

        monkeypatch.setattr(roseinfer.kernels, "cpu_kernels_available", lambda: False)
    hf = _hf_model(case)
    ours = _ours(hf)
    tokens = _tokens(hf.config.vocab_size, LENGTHS)
    for s, n in enumerate(LENGTHS):
        assert sum(k for step in SCHEDULE for t, k in step if t == s) == n
    got = _run_schedule(ours, tokens, SCHEDULE)
    with torch.no_grad():
        for seq_tokens, seq_logits in zip(tokens, got, strict=True):
            want = hf(seq_tokens[None]).logits[0].float()  # [L, V]
            assert want.abs().max() > 1.0  # the comparison is not trivially small
            torch.testing.assert_close(seq_logits, want, rtol=1e-4, atol=1e-4)


def test_bf16_model_runs_close_to_fp32() -> None:
    hf = _hf_model("llama_gqa")
    ours = _ours(hf, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert not ours.training
    tokens = _tokens(hf.config.vocab_size, [6, 1])
    got = _run_schedule(ours, tokens, [[(1, 1), (0, 5)], [(0, 1)]], torch.bfloat16)
    with torch.no_grad():
        want = hf(tokens[0][None]).logits[0]
    assert torch.isfinite(got[0]).all()
    assert (got[0] - want).abs().mean() < 0.1 * want.abs().mean()


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ],
)
def test_inv_freq_matches_transformers(scaling: dict | None) -> None:
    kw = dict(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072)
    cfg = transformers.LlamaConfig(**kw, rope_theta=500000.0, rope_scaling=scaling)
    rope_type = scaling["rope_type"] if scaling else "default"
    init = ROPE_INIT_FUNCTIONS.get(rope_type)
    want = init(cfg, CPU)[0] if init else 1.0 / (
        500000.0 ** (torch.arange(0, 128, 2).float() / 128)
    )
    ours = ModelConfig.from_hf_dict(cfg.to_dict())
    got = compute_inv_freq(128, ours.rope_theta, ours.rope_scaling, 131072)
    torch.testing.assert_close(got, want)


def test_unknown_architecture() -> None:
    with pytest.raises(ValueError, match="FooForCausalLM.*LlamaForCausalLM"):
        get_model_class("FooForCausalLM")
    assert get_model_class("qwen2") is get_model_class("Qwen2ForCausalLM")
    assert get_model_class("gpt2").__name__ == "GPT2LMHeadModel"


def test_unsupported_rope_type() -> None:
    with pytest.raises(ValueError, match="yarn"):
        compute_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 2.0}, 64)


@pytest.mark.parametrize("case", ["llama_gqa", "gpt2"])
def test_missing_and_unknown_tensors(case: str) -> None:
    hf = _hf_model(case)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    state = dict(hf.state_dict())
    victim = next(k for k in state if k.endswith("k_proj.weight") or k.endswith("c_fc.bias"))
    partial = {k: v for k, v in state.items() if k != victim}
    with pytest.raises(ValueError, match="never loaded") as exc:
        create_model(config, torch.float32, CPU).load_weights(partial.items())
    assert ".1." not in str(exc.value)  # names only what is missing (layer 0 here)
    extra = dict(state, **{"model.layers.0.bogus.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="bogus"):
        create_model(config, torch.float32, CPU).load_weights(extra.items())


def test_gpt2_accepts_unprefixed_names_and_attn_bias() -> None:
    hf = _hf_model("gpt2")
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    state["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    state["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = create_model(config, torch.float32, CPU)
    model.load_weights(state.items())
    torch.testing.assert_close(model.transformer.wte.weight, hf.transformer.wte.weight)


def test_untied_llama_requires_lm_head() -> None:
    hf = _hf_model("llama_gqa")
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="lm_head.weight"):
        create_model(config, torch.float32, CPU).load_weights(state.items())
