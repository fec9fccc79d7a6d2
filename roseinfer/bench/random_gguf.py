"""Random-weight GGUF files of real model shapes, for speed and memory measurements.

``write_random_gguf(path, shape, fmt)`` writes a llama.cpp-style GGUF (``llama`` or
``qwen2`` architecture) with the default model's tokenizer (its ``tokenizer.*`` metadata
copied from the bundled SmolLM2 GGUF, so every file is servable) and random weights in
one storage format:

* F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: normal(0, 0.02) values quantized by
  ``gguf.quants`` (gguf-py's own quantizers), a few rows at a time;
* Q4_K, Q5_K, Q6_K: gguf-py has no quantizer for them, so each block is random bytes
  with its fp16 scale fields overwritten by finite, sensible values (weights of a few
  hundredths): valid blocks, fine for speed and memory, meaningless as a model;
* Q4_K_M: llama.cpp's mix: Q4_K, with Q6_K for about half of ``attn_v`` / ``ffn_down``
  (its ``use_more_bits`` layers) and for the output matrix (the embedding when tied).

With ``llama_quantize`` (the path of llama.cpp's ``llama-quantize``) an F16 file is
written first and that tool makes the requested type (``Q4_K_M`` etc.) from it.
The file is written tensor by tensor (``GGUFWriter.add_tensor_info`` for the table,
then ``write_tensor_data`` per tensor): memory stays near the largest tensor.
1-D tensors (norms, biases) are F32, as llama.cpp stores them.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

QT = GGMLQuantizationType


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a model (Hugging Face config values)."""

    name: str
    arch: str  # "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool
    context: int = 131072
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES: MappingProxyType[str, ModelShape] = MappingProxyType({
    "llama-1b": ModelShape("llama-1b", "llama", 2048, 16, 32, 8, 8192, tied=True),
    "llama-3b": ModelShape("llama-3b", "llama", 3072, 28, 24, 8, 8192, tied=True),
    "llama-8b": ModelShape("llama-8b", "llama", 4096, 32, 32, 8, 14336, tied=False),
    "qwen-1.5b": ModelShape("qwen-1.5b", "qwen2", 1536, 28, 12, 2, 8960, tied=True,
                            context=32768, rope_theta=1000000.0),
})
FORMATS = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
           "Q4_K_M")
# Byte offsets of the fp16 scale fields of a block, for the types written as random blocks.
_FP16_FIELDS: MappingProxyType[QT, tuple[int, ...]] = MappingProxyType({
    QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q2_K: (80, 82), QT.Q3_K: (108,),
})
_ROWS_PER_CHUNK = 64
_STD = 0.02


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the ``attn_v`` / ``ffn_down`` layers a _M mix stores in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(shape: ModelShape, vocab: int, fmt: str
                ) -> list[tuple[str, tuple[int, ...], QT]]:
    """(GGUF name, torch-order shape, storage type) of every tensor, in file order."""
    base = QT.Q4_K if fmt == "Q4_K_M" else QT[fmt]
    head_type = QT.Q6_K if fmt == "Q4_K_M" else base
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, ...], QT]] = [
        ("token_embd.weight", (vocab, h), head_type if shape.tied else base)]
    for i in range(shape.layers):
        more = fmt == "Q4_K_M" and use_more_bits(i, shape.layers)
        mixed = QT.Q6_K if more else base
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), QT.F32), (p + "attn_q.weight", (h, h), base),
                (p + "attn_k.weight", (kv, h), base), (p + "attn_v.weight", (kv, h), mixed)]
        if shape.arch == "qwen2":
            out += [(p + "attn_q.bias", (h,), QT.F32), (p + "attn_k.bias", (kv,), QT.F32),
                    (p + "attn_v.bias", (kv,), QT.F32)]
        out += [(p + "attn_output.weight", (h, h), base), (p + "ffn_norm.weight", (h,), QT.F32),
                (p + "ffn_gate.weight", (shape.ffn, h), base),
                (p + "ffn_up.weight", (shape.ffn, h), base),
                (p + "ffn_down.weight", (h, shape.ffn), mixed)]
    out.append(("output_norm.weight", (h,), QT.F32))
    if not shape.tied:
        out.append(("output.weight", (vocab, h), head_type))
    return out


def _nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def _random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: QT) -> np.ndarray:
    """Random bytes [rows, row bytes] with sensible fp16 scales (types gguf-py cannot make)."""
    rows = shape[0]
    row_bytes = _nbytes(shape, qtype) // rows
    data = np.frombuffer(bytearray(rng.bytes(rows * row_bytes)), dtype=np.uint8)
    block = GGML_QUANT_SIZES[qtype][1]
    blocks = data.reshape(-1, block)
    for field in _FP16_FIELDS[qtype]:  # d (and dmin): 2e-5 .. 1e-4, normal fp16 numbers
        scale = rng.uniform(6.2e-5, 1.2e-4, size=blocks.shape[0]).astype(np.float16)
        blocks[:, field:field + 2] = scale.view(np.uint8).reshape(-1, 2)
    if qtype == QT.Q6_K:  # int8 sub-block scales in [1, 12]: |w| <= 12 * 32 * 1.2e-4
        blocks[:, 192:208] = rng.integers(1, 13, size=(blocks.shape[0], 16), dtype=np.uint8)
    return data.reshape(rows, row_bytes)


def _quantized(rng: np.random.Generator, shape: tuple[int, ...], qtype: QT) -> np.ndarray:
    """normal(0, 0.02) values in ``qtype`` through gguf-py, _ROWS_PER_CHUNK rows at a time."""
    if qtype in _FP16_FIELDS:
        return _random_blocks(rng, shape, qtype)
    rows, cols = shape
    pieces = []
    for start in range(0, rows, _ROWS_PER_CHUNK):
        n = min(_ROWS_PER_CHUNK, rows - start)
        values = rng.standard_normal((n, cols), dtype=np.float32) * _STD
        if qtype == QT.F16:
            pieces.append(values.astype(np.float16).view(np.uint8))
        else:
            pieces.append(gguf.quants.quantize(values, qtype).view(np.uint8))
    return np.concatenate(pieces).reshape(rows, -1)


def _tensor_data(rng: np.random.Generator, name: str, shape: tuple[int, ...],
                 qtype: QT) -> np.ndarray:
    if qtype == QT.F32:  # norms ~ 1, biases ~ 0
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return (base + _STD * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return _quantized(rng, shape, qtype)


def tokenizer_metadata(source: Path) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF (the default model's, by default)."""
    from roseinfer.model.gguf_loader import read_gguf_metadata

    return {k: v for k, v in read_gguf_metadata(source).items() if k.startswith("tokenizer.")}


def add_metadata_value(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One metadata key/value, typed as llama.cpp's files type it (ints as uint32)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif value and isinstance(value[0], str):
        w.add_array(key, value)
    else:
        w.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)


def _metadata(shape: ModelShape, vocab: int) -> dict[str, Any]:
    a = shape.arch
    return {
        f"{a}.block_count": shape.layers, f"{a}.context_length": shape.context,
        f"{a}.embedding_length": shape.hidden, f"{a}.feed_forward_length": shape.ffn,
        f"{a}.attention.head_count": shape.heads,
        f"{a}.attention.head_count_kv": shape.kv_heads,
        f"{a}.rope.freq_base": shape.rope_theta,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{a}.rope.dimension_count": shape.head_dim, f"{a}.vocab_size": vocab,
        "general.name": f"random {shape.name}",
    }


def write_random_gguf(path: Path, shape: ModelShape, fmt: str, seed: int = 0,
                      tokenizer_source: Path | None = None,
                      llama_quantize: Path | None = None,
                      log: Callable[[str], None] = lambda _: None,
                      tokenizer: dict[str, Any] | None = None) -> Path:
    """Write ``shape`` with random weights stored as ``fmt`` (one of ``FORMATS``, or Q2_K /
    Q3_K as random blocks).  ``tokenizer``: ``tokenizer.*`` metadata to write instead of
    ``tokenizer_source``'s (the default model's); its token list sets the vocabulary."""
    if fmt not in FORMATS and fmt not in ("Q2_K", "Q3_K"):
        raise ValueError(f"unknown format {fmt!r}; supported: {FORMATS}")
    if llama_quantize is not None and fmt not in ("F16", "BF16"):
        f16 = path.with_name(path.stem + ".f16.gguf")
        write_random_gguf(f16, shape, "F16", seed, tokenizer_source, None, log, tokenizer)
        log(f"llama-quantize {f16.name} -> {path.name} ({fmt})")
        subprocess.run([str(llama_quantize), str(f16), str(path), fmt], check=True, timeout=3600)
        f16.unlink()
        return path
    if tokenizer is None and tokenizer_source is None:
        from roseinfer.model.loader import default_model_path

        tokenizer_source = default_model_path()
    tok = tokenizer if tokenizer is not None else tokenizer_metadata(tokenizer_source)
    vocab = len(tok["tokenizer.ggml.tokens"])
    plan = tensor_plan(shape, vocab, fmt)
    w = gguf.GGUFWriter(str(path), shape.arch)
    for key, value in {**_metadata(shape, vocab), **tok}.items():
        add_metadata_value(w, key, value)
    for name, tshape, qtype in plan:
        if qtype == QT.F32:
            w.add_tensor_info(name, tshape, np.dtype(np.float32), _nbytes(tshape, qtype))
        else:
            byte_shape = (tshape[0], _nbytes(tshape, qtype) // tshape[0])
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), _nbytes(tshape, qtype),
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for i, (name, tshape, qtype) in enumerate(plan):
        w.write_tensor_data(_tensor_data(rng, name, tshape, qtype))
        if i % 50 == 0:
            log(f"{path.name}: {i}/{len(plan)} tensors")
    w.close()
    return path


def iter_formats(names: list[str]) -> Iterator[str]:
    """``names`` checked against ``FORMATS`` ("all" = every one)."""
    for name in names:
        if name == "all":
            yield from FORMATS
        elif name in FORMATS:
            yield name
        else:
            raise ValueError(f"unknown format {name!r}; supported: {FORMATS} or 'all'")
