"""GGUF checkpoints: metadata -> ModelConfig, tensors -> dequantized HF-named weights.

The header (metadata and tensor table) is parsed here with ``struct`` over a
read-only ``mmap``: ``gguf.GGUFReader`` builds one numpy view per vocabulary
string and needs ~4 s for a 49k-token vocabulary, this takes ~0.1 s. Tensor
data stays memory-mapped; each tensor is dequantized with
``gguf.quants.dequantize`` only when the weights iterator reaches it.

Tensor names are mapped to Hugging Face names; llama.cpp's row permutation of
the Q/K projections (llama arch) is undone, and GPT-2 matrices are transposed
back to HF's ``Conv1D`` ``[in, out]`` layout.
"""

from __future__ import annotations

import logging
import math
import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from roseinfer.model.config import ModelConfig
from roseinfer.model.loader import Checkpoint

logger = logging.getLogger(__name__)

ARCHITECTURES: Mapping[str, str] = MappingProxyType({
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
})

_SCALARS: Mapping[int, tuple[str, int]] = MappingProxyType({  # GGUFValueType -> (struct, size)
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
})
_STRING, _ARRAY = 8, 9

# Tensor types read as plain values, not blocks (numpy dtype; BF16 is reinterpreted by torch).
_PLAIN: Mapping[GGMLQuantizationType, Any] = MappingProxyType({
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.BF16: np.uint16,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
})

_LLAMA_BLOCK: Mapping[str, str] = MappingProxyType({
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
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


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. ``shape`` is in torch order (slowest dim first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's parsed header plus memory-mapped access to its tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.metadata, self.tensors = _parse_header(self._mm, self.path)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """Metadata value ``{architecture}.{suffix}``."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def read_tensor(self, info: GGUFTensorInfo) -> torch.Tensor:
        """The tensor as torch: F32/F16/BF16/ints as stored, quantized types -> float32."""
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        plain = _PLAIN.get(info.qtype)
        if plain is not None:
            tensor = torch.from_numpy(raw.view(plain).reshape(info.shape).copy())
            if info.qtype == GGMLQuantizationType.BF16:
                tensor = tensor.view(torch.bfloat16)
            return tensor
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        rows = raw.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)
        try:
            values = dequantize(rows, info.qtype)
        except NotImplementedError as exc:
            raise ValueError(
                f"{self.path}: tensor {info.name!r} has type {info.qtype.name}, "
                f"which gguf {exc}"
            ) from exc
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)


def _parse_header(mm: mmap.mmap, path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    if len(mm) < 24 or mm[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian files "
                         "are not supported)")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = _read_str(mm, pos)
        (vtype,) = struct.unpack_from("<I", mm, pos)
        metadata[key], pos = _read_value(mm, pos + 4, vtype)
    entries = []
    for _ in range(n_tensors):
        name, pos = _read_str(mm, pos)
        (n_dims,) = struct.unpack_from("<I", mm, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        entries.append((name, tuple(reversed(dims)), GGMLQuantizationType(qtype), offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, qtype, offset in entries:
        block, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(shape) // block * type_size
        start = data_start + offset
        if start + nbytes > len(mm):
            raise ValueError(f"{path}: tensor {name!r} extends past the end of the file")
        tensors[name] = GGUFTensorInfo(name, shape, qtype, start, nbytes)
    return metadata, tensors


def _read_str(mm: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", mm, pos)
    end = pos + 8 + length
    return mm[pos + 8:end].decode("utf-8"), end


def _read_value(mm: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALARS:
        fmt, size = _SCALARS[vtype]
        return struct.unpack_from("<" + fmt, mm, pos)[0], pos + size
    if vtype == _STRING:
        return _read_str(mm, pos)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {vtype}")
    etype, count = struct.unpack_from("<IQ", mm, pos)
    pos += 12
    if etype in _SCALARS:
        fmt, size = _SCALARS[etype]
        return list(struct.unpack_from(f"<{count}{fmt}", mm, pos)), pos + count * size
    values = []
    for _ in range(count):
        value, pos = _read_value(mm, pos, etype)
        values.append(value)
    return values, pos


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All metadata key/values of a GGUF file (no tensor data is read)."""
    return GGUFFile(path).metadata


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
    common: dict[str, Any] = dict(
        architecture=ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(gf.arch_key("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(gf.arch_key("attention.key_length") or hidden // heads),
        intermediate_size=int(gf.arch_key("feed_forward_length") or 4 * hidden),
        max_position_embeddings=int(gf.arch_key("context_length") or 2048),
        tie_word_embeddings="output.weight" not in gf.tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos_ids),
    )
    if arch == "gpt2":
        return ModelConfig(**common, norm_eps=float(gf.arch_key("attention.layer_norm_epsilon", 1e-5)),
                           attention_bias=True, hidden_act="gelu_new")
    return ModelConfig(
        **common,
        norm_eps=float(gf.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gf.arch_key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gf, common["head_dim"]),
        attention_bias=arch == "qwen2",
        hidden_act="silu",
    )


def _rope_scaling(gf: GGUFFile, head_dim: int) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``rope.scaling.*`` keys or a llama3 ``rope_freqs`` tensor."""
    kind = gf.arch_key("rope.scaling.type")
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": str(kind),
                                   "factor": float(gf.arch_key("rope.scaling.factor", 1.0))}
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
    dim = int(gf.arch_key("rope.dimension_count") or head_dim)
    return _llama3_scaling_from_factors(factors, theta, dim, gf.path)


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


def _hf_name(gguf_name: str, arch: str) -> tuple[str, str] | None:
    """(HF name, GGUF part like 'attn_q') for a GGUF tensor name, or None if unknown."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    block, top = (_GPT2_BLOCK, _GPT2_TOP) if arch == "gpt2" else (_LLAMA_BLOCK, _LLAMA_TOP)
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


def iter_gguf_weights(gf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every model tensor in the file, one at a time."""
    arch = gf.architecture
    for info in gf.tensors.values():
        if info.name == "rope_freqs.weight":  # folded into config.rope_scaling
            continue
        mapped = _hf_name(info.name, arch)
        if mapped is None:
            logger.warning("%s: skipping unknown GGUF tensor %r", gf.path, info.name)
            continue
        name, part = mapped
        tensor = gf.read_tensor(info)
        if arch == "llama" and part in ("attn_q", "attn_k"):
            tensor = unpermute_qk(tensor, config.num_heads if part == "attn_q"
                                  else config.num_kv_heads)
        elif arch == "gpt2" and part in _GPT2_CONV1D and tensor.dim() == 2:
            tensor = tensor.t().contiguous()
        yield name, tensor


def load_gguf(path: str | Path) -> Checkpoint:
    """Config plus a lazy HF-named weights iterator for a GGUF file."""
    gf = GGUFFile(path)
    config = gguf_model_config(gf)
    return Checkpoint(config=config, weights=iter_gguf_weights(gf, config), source=gf.path)
