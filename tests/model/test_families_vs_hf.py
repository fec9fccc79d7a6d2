"""Every model family against transformers (fp32, eager attention) on the paged KV cache.

Tiny random models of Llama 3.2, Qwen2.5, Qwen3, Mistral / Qwen2 / Phi-3 with a sliding
window, Phi-4-mini (longrope, partial rotary), Gemma, Gemma 2 and Gemma 3: four requests
batched, prompts prefilled in chunks, then 8 decode steps each; with the C++ kernels
and without.  Windowed models use an 8-token window and contexts up to 30.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from family_helpers import (  # noqa: E402
    CASES,
    hf_model,
    ours,
    random_tokens,
    run_schedule,
    schedule_for,
)

from roseinfer.model.config import ModelConfig  # noqa: E402

# seq 0: 22-token prompt in chunks 9 + 13; seq 1: 13 at once; seq 2: 4 as 2 + 2;
# seq 3: a one-token prompt (a "decode" on an empty cache).  Then 8 decodes each.
CHUNKS = [[9, 13] + [1] * 8, [13] + [1] * 8, [2, 2] + [1] * 8, [1] + [1] * 8]
STARTS = [0, 1, 0, 2]
# Which cases the C++ decoder stack serves (plain Llama-shaped layers).
STACK_CASES = {"llama3.2", "qwen2.5", "phi3_128k"}


def _force_pytorch(monkeypatch: pytest.MonkeyPatch, kernels: bool) -> None:
    if not kernels:  # every caller asks roseinfer.kernels first: this forces the fallback
        import roseinfer.kernels

        monkeypatch.setattr(roseinfer.kernels, "cpu_kernels_available", lambda: False)


def _compare(hf, got: list[torch.Tensor], tokens: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for seq_tokens, seq_logits in zip(tokens, got, strict=True):
            want = hf(seq_tokens[None]).logits[0].float()  # [L, V]
            assert want.abs().max() > 1.0  # the comparison is not trivially small
            torch.testing.assert_close(seq_logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "pytorch-only"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_family_matches_hf(case: str, kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _force_pytorch(monkeypatch, kernels)
    hf = hf_model(case)
    model = ours(hf)
    tokens = random_tokens(hf.config.vocab_size, [sum(c) for c in CHUNKS])
    got = run_schedule(model, tokens, schedule_for(CHUNKS, STARTS))
    _compare(hf, got, tokens)
    from roseinfer.kernels import cpu_kernels_available

    if kernels and cpu_kernels_available():  # the fast path exactly where it is exact
        assert (model._stack is not None) == (case in STACK_CASES), case


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "pytorch-only"])
@pytest.mark.parametrize("case", ["mistral_window", "qwen2_window", "phi3_window", "gemma2",
                                  "gemma3"])
def test_window_with_cached_prefix(case: str, kernels: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix-cache hit longer than the window: seq 1 starts on seq 0's first 4 blocks."""
    _force_pytorch(monkeypatch, kernels)
    hf = hf_model(case)
    model = ours(hf)
    tokens = random_tokens(hf.config.vocab_size, [30, 29])
    tokens[1][:16] = tokens[0][:16]
    schedule = schedule_for([[9, 13] + [1] * 8, [5] + [1] * 8], [0, 2])
    got = run_schedule(model, tokens, schedule, shared_prefix={1: (0, 4)})
    got[1] = torch.cat([torch.zeros(16, got[1].shape[1]), got[1]])  # cached rows: not computed
    with torch.no_grad():
        want = [hf(t[None]).logits[0].float() for t in tokens]
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1][16:], want[1][16:], rtol=1e-4, atol=1e-4)


def test_window_binds() -> None:
    """The windowed tiny models really differ from full attention on these lengths."""
    hf = hf_model("mistral_window")
    model = ours(hf)
    assert model.config.sliding_window == 8
    tokens = random_tokens(hf.config.vocab_size, [30])
    hf.config.sliding_window = None  # transformers reads it per forward
    with torch.no_grad():
        full = hf(tokens[0][None]).logits[0]
    got = run_schedule(model, tokens, [[(0, 30)]])[0]
    assert not torch.allclose(got[8:], full[8:], atol=1e-3)
    torch.testing.assert_close(got[:8], full[:8], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "pytorch-only"])
@pytest.mark.parametrize("case", ["phi4_mini", "phi3_128k"])
def test_longrope_past_original_context_matches_hf_decoding(
        case: str, kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3 / Phi-4-mini: a 40-token prompt (under the original 48) decoded to 60 tokens
    equals transformers' incremental decoding, which switches to long factors at 48."""
    _force_pytorch(monkeypatch, kernels)
    hf = hf_model(case)
    model = ours(hf)
    tokens = random_tokens(hf.config.vocab_size, [60])[0]
    got = run_schedule(model, [tokens], schedule_for([[40] + [1] * 20], [0]))[0]
    with torch.no_grad():
        out = hf(tokens[None, :40], use_cache=True)
        want = [out.logits[0]]
        for i in range(40, 60):
            out = hf(tokens[None, i:i + 1], past_key_values=out.past_key_values, use_cache=True)
            want.append(out.logits[0])
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["mistral_window", "qwen3", "phi4_mini"])
def test_layer_path_is_batch_invariant(case: str) -> None:
    """With the kernels (int8 weights, the CPU default) a request's logits are bitwise the
    same alone, prefilled in one chunk, or chunked in a batch: windows, q/k norms and
    partial rotary keep every op row-local.  (Not promised for Gemma: GeGLU's tanh and
    Gemma 2's soft-capped attention are PyTorch ops.)"""
    from roseinfer.kernels import cpu_kernels_available
    from roseinfer.model.quantize import quantize_model

    if not cpu_kernels_available():
        pytest.skip("C++ kernels unavailable")
    model = quantize_model(ours(hf_model(case)), "int8")
    tokens = random_tokens(256, [30, 21, 12])
    alone = run_schedule(model, tokens[:1], schedule_for([[22] + [1] * 8], [0]))[0]
    batched = run_schedule(model, tokens, schedule_for(CHUNKS[:3], STARTS[:3]))[0]
    assert torch.equal(alone, batched)


def test_hub_config_layouts() -> None:
    """config.json as published (transformers 4.x keys) reads like transformers reads it."""
    import transformers

    gemma3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
              "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
              "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
              "final_logit_softcapping": None, "attn_logit_softcapping": None,
              "hidden_activation": "gelu_pytorch_tanh", "eos_token_id": [1, 106]}
    cfg = ModelConfig.from_hf_dict(gemma3)
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in gemma3.items()
                                          if k not in ("architectures", "model_type")})
    assert cfg.layer_types == tuple(hf.layer_types)
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (512, 1e6, 1e4)
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.final_logit_softcapping is None
    assert cfg.eos_token_ids == (1, 106)
    # Gemma 3 4B: image-text wrapper whose sparse text_config relies on defaults.
    mm = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                          "model_type": "gemma3_text", "num_hidden_layers": 34,
                          "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                          "sliding_window": 1024}, "eos_token_id": [1, 106]}
    cfg = ModelConfig.from_hf_dict(mm)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262208)
    assert cfg.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert cfg.layer_types.count("full_attention") == 5
    phi3 = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_hidden_layers": 32,
            "num_attention_heads": 24, "num_key_value_heads": 8, "intermediate_size": 8192,
            "vocab_size": 200064, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
            "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True,
            "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48,
                             "short_factor": [1.0] * 48}}
    cfg = ModelConfig.from_hf_dict(phi3)
    assert cfg.rotary_dim == 96 and cfg.sliding_window is None
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    qwen25 = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "vocab_size": 151936, "max_position_embeddings": 32768, "sliding_window": 32768,
              "use_sliding_window": False, "max_window_layers": 21, "tie_word_embeddings": True}
    cfg = ModelConfig.from_hf_dict(qwen25)
    assert cfg.sliding_window is None and cfg.attention_bias and cfg.tie_word_embeddings
    mistral01 = {"architectures": ["MistralForCausalLM"], "hidden_size": 4096,
                 "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 32000,
                 "max_position_embeddings": 32768, "sliding_window": 4096}
    cfg = ModelConfig.from_hf_dict(mistral01)
    assert cfg.sliding_window == 4096 and cfg.is_sliding_layer(31)


def test_unsupported_architecture_and_rope_type_are_named() -> None:
    with pytest.raises(ValueError, match="FalconForCausalLM.*Gemma2ForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["FalconForCausalLM"], "hidden_size": 8})
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type 'yarn'.*llama3"):
        ModelConfig.from_hf_dict(llama)
    with pytest.raises(ValueError, match=r"rope_scaling\.low_freq_factor"):
        ModelConfig.from_hf_dict({**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("case", sorted(CASES))
def test_loads_from_safetensors_dir(tmp_path: Path, case: str) -> None:
    """``save_pretrained`` output (config.json + safetensors) through the real loader."""
    from roseinfer.model.factory import load_model

    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    model, config, source = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert source == tmp_path and config == ModelConfig.from_hf_dict(hf.config.to_dict())
    tokens = random_tokens(hf.config.vocab_size, [20])
    got = run_schedule(model, tokens, schedule_for([[12] + [1] * 8], [0]))
    _compare(hf, got, tokens)


def test_gemma3_image_text_checkpoint_loads_its_language_model() -> None:
    """A Gemma 3 4B+-style checkpoint: ``text_config`` and ``language_model.`` names
    (either transformers layout) around the text model; vision tensors are skipped."""
    from roseinfer.model.registry import create_model

    hf = hf_model("gemma3")
    text = hf.config.to_dict()
    wrapper = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
               "text_config": text, "eos_token_id": [2, 106]}
    config = ModelConfig.from_hf_dict(wrapper)
    state = hf.state_dict()
    for prefix in ("language_model.model.", "model.language_model."):
        named = [(prefix + k.removeprefix("model."), v) for k, v in state.items()
                 if k != "lm_head.weight"]
        named += [("vision_tower.vision_model.post_layernorm.weight", torch.ones(4)),
                  ("multi_modal_projector.mm_soft_emb_norm.weight", torch.ones(4))]
        model = create_model(config, torch.float32, torch.device("cpu"))
        model.load_weights(named)
        tokens = random_tokens(hf.config.vocab_size, [20])
        _compare(hf, run_schedule(model, tokens, [[(0, 20)]]), tokens)
