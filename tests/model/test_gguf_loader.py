"""Tests for roseinfer.model.gguf_loader: tiny GGUFs written with gguf.GGUFWriter, plus the
bundled SmolLM2 GGUF checked against transformers' own GGUF dequantization."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).parent))
from conftest_loader import (  # noqa: E402
    expected_after_roundtrip,
    llama_gguf_tensors,
    llama_metadata,
    tiny_llama,
    write_gguf,
)

from roseinfer.model.config import ModelConfig  # noqa: E402
from roseinfer.model.gguf_loader import (  # noqa: E402
    GGUFFile,
    llama3_rope_factors,
    load_gguf,
)
from roseinfer.model.loader import default_model_path, load_checkpoint  # noqa: E402

TYPES = {"token_embd": QT.F32, "attn_q": QT.Q8_0, "attn_k": QT.Q4_0, "attn_v": QT.F16,
         "attn_output": QT.BF16, "ffn_gate": QT.Q8_0, "ffn_up": QT.Q5_1, "ffn_down": QT.F32,
         "output": QT.F16}


def _part(hf_name: str) -> str:
    table = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "embed_tokens": "token_embd", "lm_head": "output"}
    return next((v for k, v in table.items() if k in hf_name), "norm")


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_llama_gguf_matches_hf(tmp_path: Path, tie: bool) -> None:
    model = tiny_llama(tie=tie)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", llama_metadata(model.config),
                      llama_gguf_tensors(model, TYPES))
    ckpt = load_checkpoint(path)
    assert ckpt.source == path
    cfg = ckpt.config
    assert cfg == ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        max_position_embeddings=128, norm_eps=cfg.norm_eps, rope_theta=50000.0,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_ids=(2,))
    assert cfg.norm_eps == pytest.approx(1e-5)
    ours = dict(ckpt.weights)
    ref = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(ours) == set(ref)
    for name, want in ref.items():
        got = ours[name]
        qtype = TYPES.get(_part(name), QT.F32) if want.dim() == 2 else QT.F32
        assert got.shape == want.shape, name
        if qtype == QT.F32:
            assert got.dtype == torch.float32 and torch.equal(got, want), name
        elif qtype == QT.F16:
            assert got.dtype == torch.float16 and torch.equal(got, want.half()), name
        elif qtype == QT.BF16:
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16()), name
        else:  # quantized: exactly gguf's own round trip, and close to the original
            assert got.dtype == torch.float32
            # (Q/K rows are permuted, but quant blocks run along rows, so that commutes)
            assert torch.equal(got, expected_after_roundtrip(want, qtype)), name
            tol = (0.01 if qtype == QT.Q8_0 else 0.1) * want.abs().max().item()
            assert (got - want).abs().max().item() < tol, name


def test_unpermute_q_k_exact(tmp_path: Path) -> None:
    """F32 Q/K written permuted the llama.cpp way come back exactly in HF order."""
    model = tiny_llama()
    path = write_gguf(tmp_path / "t.gguf", "llama", llama_metadata(model.config),
                      llama_gguf_tensors(model))
    ours = dict(load_gguf(path).weights)
    sd = model.state_dict()
    for layer in range(2):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(ours[name], sd[name])


def test_header_parser_matches_gguf_reader(tmp_path: Path) -> None:
    model = tiny_llama()
    md = {**llama_metadata(model.config), "general.name": "tiny", "tokenizer.ggml.pre": "x"}
    path = write_gguf(tmp_path / "t.gguf", "llama", md, llama_gguf_tensors(model, TYPES),
                      tokens=[f"tok{i}" for i in range(256)])
    gf = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert gf.metadata.keys() == fields.keys()
    for key, value in fields.items():
        if isinstance(value, float):
            assert gf.metadata[key] == pytest.approx(value)
        else:
            assert gf.metadata[key] == value, key
    assert list(gf.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = gf.tensors[t.name]
        assert info.qtype == t.tensor_type
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
        assert info.shape == tuple(reversed([int(d) for d in t.shape]))
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
        assert np.array_equal(gf.read_tensor(info).float().numpy(), want.astype(np.float32))


def test_qwen2_gguf_biases_no_permute(tmp_path: Path) -> None:
    model = tiny_llama(attention_bias=True)
    tensors = llama_gguf_tensors(model, permute=False)
    path = write_gguf(tmp_path / "q.gguf", "qwen2", llama_metadata(model.config), tensors)
    ckpt = load_gguf(path)
    assert ckpt.config.architecture == "Qwen2ForCausalLM" and ckpt.config.attention_bias
    ours = dict(ckpt.weights)
    sd = model.state_dict()
    assert "model.layers.0.self_attn.q_proj.bias" in ours
    for name, t in ours.items():
        assert torch.equal(t, sd[name]), name


def test_tiny_gpt2_gguf_matches_hf(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2,
                                       n_head=4, bos_token_id=0, eos_token_id=0)).eval()
    names = {"attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "mlp.c_fc": "ffn_up",
             "mlp.c_proj": "ffn_down", "ln_1": "attn_norm", "ln_2": "ffn_norm"}
    top = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}
    tensors = []
    for name, t in model.state_dict().items():
        parts = name.split(".")
        if parts[0] == "lm_head" or parts[-1] not in ("weight", "bias"):
            continue  # tied / buffers
        if parts[1] == "h":
            part = names[".".join(parts[3:-1])]
            gname = f"blk.{parts[2]}.{part}.{parts[-1]}"
            if part in ("attn_qkv", "attn_output", "ffn_up", "ffn_down") and t.dim() == 2:
                t = t.t().contiguous()  # llama.cpp stores Conv1D weights as [out, in]
        else:
            gname = f"{top[parts[1]]}.{parts[-1]}"
        tensors.append((gname, t, QT.F32))
    md = {"block_count": 2, "context_length": 64, "embedding_length": 32,
          "feed_forward_length": 128, "attention.head_count": 4,
          "attention.layer_norm_epsilon": 1e-5, "tokenizer.ggml.bos_token_id": 0,
          "tokenizer.ggml.eos_token_id": 0}
    ckpt = load_checkpoint(write_gguf(tmp_path / "g.gguf", "gpt2", md, tensors))
    want_cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    assert ckpt.config == ModelConfig(**{**want_cfg.__dict__, "norm_eps": ckpt.config.norm_eps})
    ours = dict(ckpt.weights)
    sd = {k: v for k, v in model.state_dict().items() if k in ours or k == "lm_head.weight"}
    assert set(ours) == set(sd) - {"lm_head.weight"}
    for name, t in ours.items():
        assert torch.equal(t, sd[name]), name


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    model = tiny_llama()
    md = llama_metadata(model.config)
    factors = torch.from_numpy(llama3_rope_factors(50000.0, 16, 8.0, 1.0, 4.0, 8192)).float()
    tensors = llama_gguf_tensors(model) + [("rope_freqs.weight", factors, QT.F32)]
    ckpt = load_gguf(write_gguf(tmp_path / "l3.gguf", "llama", md, tensors))
    assert ckpt.config.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert not any("rope" in name for name, _ in ckpt.weights)


def test_unknown_architecture_names_it(tmp_path: Path) -> None:
    model = tiny_llama()
    path = write_gguf(tmp_path / "m.gguf", "mamba", llama_metadata(model.config),
                      llama_gguf_tensors(model)[:2])
    with pytest.raises(ValueError, match="mamba"):
        load_checkpoint(path)


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        load_checkpoint(bad)


@pytest.fixture(scope="module")
def transformers_reference() -> dict:
    """transformers' GGUF loading of the bundled model: ``load_gguf_checkpoint`` is what
    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` runs for llama (called directly:
    from_pretrained insists on `accelerate`, which isn't a dependency). The meta-device shell only
    names tensors; a 2-layer shell keeps its name mapping cheap, so blocks 0-1 (plus embeddings
    and norm) are compared by value, every tensor by name and shape."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        shell = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True))
    return load_gguf_checkpoint(str(default_model_path()), return_tensors=True,
                                model_to_load=shell)


def test_bundled_gguf_matches_transformers(transformers_reference: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = transformers_reference["config"]
    ref = transformers_reference["tensors"]
    assert len(ref) == 2 + 2 * 9 and "model.layers.1.mlp.down_proj.weight" in ref
    ckpt = load_checkpoint(None)
    assert ckpt.config == ModelConfig.from_hf_dict(hf_cfg)
    with torch.device("meta"):
        full = LlamaForCausalLM(LlamaConfig(**hf_cfg)).state_dict()
    full.pop("lm_head.weight")  # tied
    shapes = {}
    for name, tensor in ckpt.weights:
        shapes[name] = tuple(tensor.shape)
        if name in ref:
            want = torch.as_tensor(ref[name])
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), name
    assert shapes == {name: tuple(t.shape) for name, t in full.items()}
