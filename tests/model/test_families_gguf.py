"""GGUF round trips of the new families: tiny HF models written the way llama.cpp's
``convert_hf_to_gguf.py`` writes them (names, permutations, Gemma's ``1 + weight``
norms, Phi-3's fused tensors and longrope factor tensors), loaded back and run on the
paged cache against transformers; plus a GGUF tokenizer with its chat template."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).parent))
from conftest_loader import llamacpp_permute, write_gguf  # noqa: E402
from family_helpers import (  # noqa: E402
    _BASE,
    hf_model,
    random_tokens,
    run_schedule,
    schedule_for,
)

from roseinfer.model.config import ModelConfig  # noqa: E402
from roseinfer.model.gguf_loader import llama3_rope_factors  # noqa: E402
from roseinfer.model.loader import load_checkpoint  # noqa: E402
from roseinfer.model.registry import create_model  # noqa: E402

_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm"}
_SANDWICH = {**_BLOCK, "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_tensors(model: torch.nn.Module, arch: str) -> list[tuple[str, torch.Tensor, QT]]:
    """An HF state dict as llama.cpp's converter writes it for ``arch`` (all F32)."""
    cfg = model.config
    block = _SANDWICH if arch in ("gemma2", "gemma3") else _BLOCK
    out = []
    for name, t in model.state_dict().items():
        parts = name.split(".")
        if parts[0] == "lm_head":
            if cfg.tie_word_embeddings:
                continue
            gname = "output." + parts[-1]
        elif parts[1] == "embed_tokens":
            gname = "token_embd." + parts[-1]
        elif parts[1] == "norm":
            gname = "output_norm." + parts[-1]
        else:
            part = block[".".join(parts[3:-1])]
            gname = f"blk.{parts[2]}.{part}.{parts[-1]}"
            if arch == "llama" and part in ("attn_q", "attn_k"):
                n = cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads
                t = llamacpp_permute(t, n)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # GemmaModel.modify_tensors
        out.append((gname, t, QT.F32))
    return out


def _metadata(cfg: transformers.PretrainedConfig) -> dict:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads,
            "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
            "rope.freq_base": float(cfg.rope_parameters.get("rope_theta", 10000.0)
                                    if "rope_theta" in cfg.rope_parameters
                                    else cfg.rope_parameters["full_attention"]["rope_theta"]),
            "attention.key_length": head_dim, "attention.value_length": head_dim,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def _tiny(case: str) -> tuple[transformers.PreTrainedModel, str, dict, list]:
    """(HF model, GGUF arch, extra metadata, extra tensors) for a round-trip case."""
    if case == "llama3.2":  # llama3 rope as the rope_freqs tensor, tied embeddings
        cfg = transformers.LlamaConfig(**_BASE, tie_word_embeddings=True, rope_theta=500000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192})
        model = _randomised(transformers.LlamaForCausalLM(cfg))
        factors = llama3_rope_factors(500000.0, 16, 32.0, 1.0, 4.0, 8192)
        return model, "llama", {}, [("rope_freqs.weight", torch.from_numpy(factors).float(), QT.F32)]
    if case == "gemma3":  # 6 layers: llama.cpp's fixed pattern (5 sliding, 1 global)
        cfg = transformers.Gemma3TextConfig(**{**_BASE, "num_hidden_layers": 6}, head_dim=16,
                                            sliding_window=8, query_pre_attn_scalar=16,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0})
        model = _randomised(transformers.Gemma3ForCausalLM(cfg))
        return model, "gemma3", {"attention.sliding_window": 8, "rope.scaling.type": "linear",
                                 "rope.scaling.factor": 2.0, "rope.freq_base": 1000000.0}, []
    if case == "gemma2":  # query_pre_attn_scalar = head_dim (llama.cpp's value below 27B)
        cfg = transformers.Gemma2Config(**{**_BASE, "num_hidden_layers": 3}, head_dim=16,
                                        sliding_window=8, query_pre_attn_scalar=16,
                                        attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
        model = _randomised(transformers.Gemma2ForCausalLM(cfg))
        return model, "gemma2", {"attention.sliding_window": 8, "attn_logit_softcapping": 3.0,
                                 "final_logit_softcapping": 4.0}, []
    hf = hf_model(case)
    if case == "mistral_window":  # llama.cpp writes Mistral as llama (window if the key is set)
        return hf, "llama", {"attention.sliding_window": 8}, []
    if case != "phi4_mini":
        return hf, case, {}, []
    cfg = hf.config  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
    orig, rs = cfg.original_max_position_embeddings, cfg.rope_parameters
    scale = cfg.max_position_embeddings / orig
    md = {"rope.dimension_count": int(cfg.partial_rotary_factor * cfg.hidden_size)
          // cfg.num_attention_heads, "rope.scaling.original_context_length": orig,
          "attention.sliding_window": 0,
          "rope.scaling.attn_factor": math.sqrt(1 + math.log(scale) / math.log(orig))}
    extra = [("rope_factors_long.weight", torch.tensor(rs["long_factor"]), QT.F32),
             ("rope_factors_short.weight", torch.tensor(rs["short_factor"]), QT.F32)]
    return hf, "phi3", md, extra


def _randomised(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    model.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(1)
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name and not gemma else 0.12 * noise)
    return model.eval()


@pytest.mark.parametrize("case", ["llama3.2", "mistral_window", "qwen3", "gemma", "gemma2",
                                  "gemma3", "phi4_mini"])
def test_gguf_round_trip_matches_hf(tmp_path: Path, case: str) -> None:
    hf, arch, md, extra = _tiny(case)
    path = write_gguf(tmp_path / f"{case}.gguf", arch, {**_metadata(hf.config), **md},
                      _gguf_tensors(hf, arch) + extra)
    ckpt = load_checkpoint(path)
    want_cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    got_cfg = ckpt.config
    if case == "mistral_window":
        want_cfg = replace(want_cfg, architecture="LlamaForCausalLM")
    if arch == "phi3":  # float32 factors and an explicit attention factor in the file
        assert got_cfg.rope_scaling is not None and want_cfg.rope_scaling is not None
        for key in ("long_factor", "short_factor"):
            assert got_cfg.rope_scaling[key] == pytest.approx(want_cfg.rope_scaling[key])
        got_cfg = replace(got_cfg, rope_scaling=want_cfg.rope_scaling)
    assert got_cfg == replace(want_cfg, norm_eps=got_cfg.norm_eps)
    model = create_model(ckpt.config, torch.float32, torch.device("cpu"))
    model.load_weights(ckpt.weights)
    tokens = random_tokens(hf.config.vocab_size, [26, 12])
    got = run_schedule(model, tokens, schedule_for([[7, 11] + [1] * 8, [4] + [1] * 8], [0, 1]))
    with torch.no_grad():
        for seq, logits in zip(tokens, got, strict=True):
            want = hf(seq[None]).logits[0]
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_gguf_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    hf, _, _, _ = _tiny("qwen3")
    path = write_gguf(tmp_path / "m.gguf", "falcon", _metadata(hf.config),
                      _gguf_tensors(hf, "qwen3")[:2])
    with pytest.raises(ValueError, match="falcon.*phi3.*gemma3"):
        load_checkpoint(path)


_GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                   "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
                   "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                   "{% endif %}")


def test_gemma_gguf_tokenizer_and_chat_template(tmp_path: Path) -> None:
    """A sentencepiece (llama-type) vocabulary in a gemma3 GGUF: transformers' converter
    builds the tokenizer, the template comes from ``tokenizer.chat_template``."""
    import gguf

    from roseinfer.tokenizer import Tokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["\u2581", "h", "i", "u", "s", "e", "r", "\n", "\u2581h", "hi", "\u2581hi", "us",
              "er", "user", "\u2581user", "m", "o", "d", "l"]
    tokens = specials + pieces
    w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(specials) + [-float(i) for i in range(len(pieces))])
    w.add_token_types([3] * len(specials) + [1] * len(pieces))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_chat_template(_GEMMA_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_model_path(tmp_path / "tok.gguf")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [2, 4] and tok.decode(ids, skip_special_tokens=True) == "user\nhi\nmodel\n"
    assert 1 in tok.eos_token_ids
