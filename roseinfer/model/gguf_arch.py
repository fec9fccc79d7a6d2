"""GGUF architectures: llama.cpp metadata -> ModelConfig, tensor names -> Hugging Face names.

What llama.cpp's ``convert_hf_to_gguf.py`` does to each family, undone here:

* llama: Q/K rows permuted (``unpermute_qk``); Llama 3.x rope scaling as a
  ``rope_freqs`` tensor (recognised as ``llama3``).  Mistral converts to ``llama``.
* qwen2 / qwen3: nothing permuted; qwen2 has q/k/v biases, qwen3 ``attn_q_norm`` /
  ``attn_k_norm``.
* gemma / gemma2 / gemma3: every norm weight stored as ``1 + weight``; Gemma 2/3's
  ``ffn_norm`` is the pre-feed-forward norm, ``post_attention_norm`` / ``post_ffw_norm``
  the sandwich norms.  Not in the file, so taken as llama.cpp takes them: the layer
  pattern (Gemma 2 alternates; Gemma 3 has 5 sliding per global layer unless
  ``attention.sliding_window_pattern`` says otherwise), Gemma 3's local rope base
  (10000 unless ``rope.freq_base_swa``), and ``query_pre_attn_scalar`` = ``head_dim``
  except for the 27B models (46 / 62 layers: ``hidden / heads``) or ``attention.scale``.
* phi3: fused ``attn_qkv`` and ``ffn_up`` (= gate_up); longrope as
  ``rope_factors_long`` / ``rope_factors_short`` tensors plus ``rope.scaling.*`` keys;
  partial rotary as ``rope.dimension_count``; ``attention.sliding_window`` 0 = none.
* gpt2: Conv1D matrices stored transposed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from roseinfer.model.config import ModelConfig

if TYPE_CHECKING:
    from roseinfer.model.gguf_file import GGUFFile

ARCHITECTURES: Mapping[str, str] = MappingProxyType({
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
})
_GEMMAS = ("gemma", "gemma2", "gemma3")
# Tensors folded into ModelConfig.rope_scaling rather than loaded.
ROPE_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight",
                          "rope_factors_short.weight"})

_LLAMA_BLOCK: Mapping[str, str] = MappingProxyType({
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
})
_GEMMA2_BLOCK: Mapping[str, str] = MappingProxyType({
    **_LLAMA_BLOCK, "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
})
_PHI3_BLOCK: Mapping[str, str] = MappingProxyType({
    **_LLAMA_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj",
})
_LLAMA_TOP: Mapping[str, str] = MappingProxyType({
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
})
_GPT2_BLOCK: Mapping[str, str] = MappingProxyType({
    "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj", "attn_norm": "ln_1", "ffn_norm": "ln_2",
})
_GPT2_TOP: Mapping[str, str] = MappingProxyType({
    "token_embd": "transformer.wte", "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f", "output": "lm_head",
})
_GPT2_CONV1D = frozenset({"attn_qkv", "attn_output", "ffn_up", "ffn_down"})


def gguf_model_config(gf: GGUFFile) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata (and tensor table, for vocab and tying)."""
    arch = gf.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{gf.path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    md = gf.metadata
    hidden = int(gf.arch_key("embedding_length"))
    heads = int(gf.arch_key("attention.head_count"))
    kv_heads = gf.arch_key("attention.head_count_kv") or heads
    embd = gf.tensors.get("token_embd.weight")
    if embd is not None:
        vocab = embd.shape[0]
    elif gf.arch_key("vocab_size") is not None:
        vocab = int(gf.arch_key("vocab_size"))
    else:
        vocab = len(md.get("tokenizer.ggml.tokens", ()))
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = md.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = md.get("tokenizer.ggml.bos_token_id")
    head_dim = int(gf.arch_key("attention.key_length") or hidden // heads)
    layers = int(gf.arch_key("block_count"))
    common: dict[str, Any] = dict(
        architecture=ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        intermediate_size=int(gf.arch_key("feed_forward_length") or 4 * hidden),
        max_position_embeddings=int(gf.arch_key("context_length") or 2048),
        tie_word_embeddings="output.weight" not in gf.tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos_ids),
    )
    if arch == "gpt2":
        return ModelConfig(**common, norm_eps=float(gf.arch_key("attention.layer_norm_epsilon", 1e-5)),
                           attention_bias=True, hidden_act="gelu_new")
    window = int(gf.arch_key("attention.sliding_window") or 0) or None
    if window is not None and window >= common["max_position_embeddings"]:
        window = None  # never binds
    rope_dims = int(gf.arch_key("rope.dimension_count") or head_dim)
    return ModelConfig(
        **common,
        norm_eps=float(gf.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gf.arch_key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gf, rope_dims),
        attention_bias=arch == "qwen2",
        hidden_act="gelu_pytorch_tanh" if arch in _GEMMAS else "silu",
        sliding_window=window,
        layer_types=_layer_types(gf, arch, layers),
        qk_norm=arch in ("qwen3", "gemma3"),
        query_pre_attn_scalar=_query_pre_attn_scalar(gf, arch, hidden, heads, head_dim, layers),
        attn_logit_softcapping=(_opt(gf.arch_key("attn_logit_softcapping"))
                                if arch == "gemma2" else None),
        final_logit_softcapping=(_opt(gf.arch_key("final_logit_softcapping"))
                                 if arch in ("gemma2", "gemma3") else None),
        rope_local_theta=(float(gf.arch_key("rope.freq_base_swa", 10000.0))
                          if arch == "gemma3" else None),
        partial_rotary_factor=rope_dims / head_dim,
    )


def _opt(value: Any) -> float | None:
    return None if value is None else float(value)


def _layer_types(gf: GGUFFile, arch: str, layers: int) -> tuple[str, ...]:
    """Per-layer attention types: llama.cpp's ``set_swa_pattern`` (n: layer i is sliding
    iff i % n < n - 1) or an explicit per-layer bool array."""
    if arch not in ("gemma2", "gemma3"):
        return ()
    pattern = gf.arch_key("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _query_pre_attn_scalar(gf: GGUFFile, arch: str, hidden: int, heads: int, head_dim: int,
                           layers: int) -> float | None:
    if arch not in ("gemma2", "gemma3"):
        return None
    scale = gf.arch_key("attention.scale")
    if scale is not None:
        return float(scale) ** -2
    big = (arch, layers) in (("gemma2", 46), ("gemma3", 62))  # the 27B models
    return float(hidden // heads if big else head_dim)


def _rope_scaling(gf: GGUFFile, rotary_dim: int) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``rope.scaling.*`` keys, a llama3 ``rope_freqs`` tensor or
    Phi-3's longrope factor tensors."""
    long_info = gf.tensors.get("rope_factors_long.weight")
    short_info = gf.tensors.get("rope_factors_short.weight")
    if long_info is not None and short_info is not None:
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": gf.read_tensor(long_info).float().tolist(),
            "short_factor": gf.read_tensor(short_info).float().tolist(),
            "original_max_position_embeddings": int(
                gf.arch_key("rope.scaling.original_context_length")
                or gf.arch_key("context_length")),
        }
        if gf.arch_key("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(gf.arch_key("rope.scaling.attn_factor"))
        return scaling
    kind = gf.arch_key("rope.scaling.type")
    if kind not in (None, "none"):
        scaling = {"rope_type": str(kind), "factor": float(gf.arch_key("rope.scaling.factor", 1.0))}
        orig = gf.arch_key("rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        for key, hf_key in (("attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                            ("yarn_beta_slow", "beta_slow")):
            if gf.arch_key(f"rope.scaling.{key}") is not None:
                scaling[hf_key] = float(gf.arch_key(f"rope.scaling.{key}"))
        return scaling
    info = gf.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    factors = gf.read_tensor(info).double().numpy()
    theta = float(gf.arch_key("rope.freq_base", 10000.0))
    return _llama3_scaling_from_factors(factors, theta, rotary_dim, gf.path)


def llama3_rope_factors(theta: float, dim: int, factor: float, low: float, high: float,
                        orig: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for HF ``rope_type: llama3``."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _llama3_scaling_from_factors(factors: np.ndarray, theta: float, dim: int,
                                 path: Path) -> dict[str, Any]:
    factor = float(factors.max())
    # Every Llama 3.x model uses low=1, high=4, original context 8192; verify, don't guess.
    for low, high, orig in ((1.0, 4.0, 8192),):
        want = llama3_rope_factors(theta, dim, factor, low, high, orig)
        if want.shape == factors.shape and np.allclose(want, factors, rtol=1e-4, atol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise ValueError(f"{path}: rope_freqs.weight does not match llama3 rope scaling; "
                     "this GGUF's RoPE frequencies are not supported")


def hf_name(gguf_name: str, arch: str) -> tuple[str, str] | None:
    """(HF name, GGUF part like 'attn_q') for a GGUF tensor name, or None if unknown."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    block = {"gpt2": _GPT2_BLOCK, "gemma2": _GEMMA2_BLOCK, "gemma3": _GEMMA2_BLOCK,
             "phi3": _PHI3_BLOCK}.get(arch, _LLAMA_BLOCK)
    top = _GPT2_TOP if arch == "gpt2" else _LLAMA_TOP
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block:
        prefix = "transformer.h" if arch == "gpt2" else "model.layers"
        return f"{prefix}.{parts[1]}.{block[parts[2]]}.{kind}", parts[2]
    if len(parts) == 1 and stem in top:
        return f"{top[stem]}.{kind}", stem
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute(w, n_head)`` on Q/K rows (weights [out, in] or biases [out])."""
    half = w.shape[0] // n_head // 2
    return (w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape).contiguous())


def to_hf_tensor(tensor: torch.Tensor, arch: str, part: str, config: ModelConfig) -> torch.Tensor:
    """A GGUF tensor's values as the Hugging Face checkpoint holds them."""
    if arch == "llama" and part in ("attn_q", "attn_k"):
        return unpermute_qk(tensor, config.num_heads if part == "attn_q" else config.num_kv_heads)
    if arch == "gpt2" and part in _GPT2_CONV1D and tensor.dim() == 2:
        return tensor.t().contiguous()
    if arch in _GEMMAS and part.endswith("norm"):
        return tensor.float() - 1.0  # llama.cpp stores Gemma's (1 + weight)
    return tensor
