"""Helpers for the loader tests: tiny HF models and tiny GGUF files written the llama.cpp way.

Imported explicitly by ``test_loader.py`` / ``test_gguf_loader.py`` (not a conftest).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from roseinfer.bench.random_gguf import add_metadata_value

TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=50000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

# HF llama names (without the "model.layers.N." prefix) -> GGUF names
LLAMA_BLOCK_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def tiny_llama(tie: bool = False, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random tiny transformers LlamaForCausalLM (GQA: 4 heads, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY_LLAMA, **overrides}, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms are initialised to 1; make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (applied to HF Q/K)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def encode_tensor(w: torch.Tensor, qtype: QT) -> np.ndarray:
    """The array to hand GGUFWriter.add_tensor(..., raw_dtype=qtype) for ``w``."""
    a = w.detach().float().numpy()
    if qtype == QT.F32:
        return a.astype(np.float32)
    if qtype == QT.F16:
        return a.astype(np.float16)
    return gguf.quants.quantize(a, qtype)


def expected_after_roundtrip(w: torch.Tensor, qtype: QT) -> torch.Tensor:
    """What a loader must return for ``w`` stored as ``qtype`` (float32)."""
    if qtype == QT.BF16:
        return w.float().bfloat16().float()
    return torch.from_numpy(gguf.quants.dequantize(encode_tensor(w, qtype), qtype).copy()).float()


def write_gguf(path: Path, arch: str, metadata: dict[str, Any],
               tensors: list[tuple[str, torch.Tensor, QT]],
               tokens: list[str] | None = None, merges: list[str] | None = None) -> Path:
    """Write a GGUF: ``metadata`` keys are relative to ``{arch}.`` unless they contain a '.'
    prefix like 'tokenizer.' or 'general.'; ``tokens`` (and BPE ``merges``) make a gpt2
    tokenizer."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        full = key if key.split(".")[0] in ("general", "tokenizer") else f"{arch}.{key}"
        add_metadata_value(w, full, value)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        if merges:
            w.add_token_merges(merges)
    for name, t, qtype in tensors:
        data = encode_tensor(t, qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_gguf_tensors(model: torch.nn.Module, types: dict[str, QT] | None = None,
                       permute: bool = True) -> list[tuple[str, torch.Tensor, QT]]:
    """HF llama state dict -> GGUF tensors the way llama.cpp converts them.

    ``types`` maps a GGUF part name ("attn_q", "token_embd"...) to its storage type (default F32).
    """
    types = types or {}
    cfg = model.config
    out = []
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = name.split(".")
        kind = parts[-1]
        if parts[0] == "lm_head":
            part, gname = "output", f"output.{kind}"
        elif parts[1] == "embed_tokens":
            part, gname = "token_embd", f"token_embd.{kind}"
        elif parts[1] == "norm":
            part, gname = "output_norm", f"output_norm.{kind}"
        else:
            part = LLAMA_BLOCK_TO_GGUF[".".join(parts[3:-1])]
            gname = f"blk.{parts[2]}.{part}.{kind}"
        if permute and part == "attn_q":
            t = llamacpp_permute(t, cfg.num_attention_heads)
        elif permute and part == "attn_k":
            t = llamacpp_permute(t, cfg.num_key_value_heads)
        out.append((gname, t, types.get(part, QT.F32) if t.dim() == 2 else QT.F32))
    return out


def llama_metadata(cfg: Any) -> dict[str, Any]:
    return {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.freq_base": 50000.0, "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
