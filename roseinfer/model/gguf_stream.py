"""Load a GGUF straight into the CPU kernels, its weights kept as stored (issue #24).

With the default weight format (``int8``) on CPU, float32 activations and the C++ GGUF
kernels loaded (``kernels.gguf``), a Llama-family GGUF is never dequantized:

* the model is built on the meta device (no fp32 weight is ever allocated);
* each linear layer goes from the memory-mapped file to ``make_gguf_linear`` one at a
  time as raw blocks (fused q/k/v and gate/up as multi-part layers; llama.cpp's Q/K
  row permutation undone by permuting raw rows, each a whole number of blocks); once
  the kernel holds what it needs, the file pages just read are dropped from this
  process (``madvise(MADV_DONTNEED)``: a kernel that reads them later faults them back
  from the page cache), so a load never holds a tensor twice;
* the embedding is a ``GGUFEmbedding`` over the raw matrix in the file (a step
  dequantizes its tokens' rows, so only their pages are ever resident) and the LM head
  runs its format's kernel (tied or not: the kernel packs the matrix once, as stored);
* norms and other 1-D tensors are float32 parameters, as before.

A GGUF type the kernels do not run is a ``ValueError`` naming the tensor and its type
(``quantization="none"`` loads any type dequantized).  F32 matrices (tiny test files)
take the usual conversion (``quantize.convert_linear``: Q8_0), and so do F16 / BF16
matrices when the user asked for it (``requantize_16bit``, quantization ``"q8_0"``:
logged; as stored they read 2 bytes per weight, Q8_0 1.06).  Q4_1 parts of act8 layers
(``act8_layer``) keep the kernels' int8 copy for steps of more than 4 rows
(``extra_copy``: faster there, one byte per weight) only while those copies stay under
``EXTRA_COPY_SHARE`` of the file: the memory target is 1.15 x the file + 0.35 GB, and the
default model (98 MB, 53 M such weights) measures 427 MB RSS without them (target: 463
MB).  Other Q4_1 layers run the GGUF panels (nibbles at every row count, no copy).
Layers named by ``act8_layer`` (gate/up, quantize.ACT8_LAYERS) take int8
activations where their parts are Q4_1 or Q4_0
(``csrc/q4_act8.h``; a Q4_0 file's parts read their nibbles at every step, never a copy).
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch
from gguf import GGMLQuantizationType
from torch import Tensor, nn

from roseinfer.model.config import ModelConfig
from roseinfer.model.gguf_arch import ROPE_TENSORS, gguf_model_config, hf_name, to_hf_tensor
from roseinfer.model.gguf_embedding import GGUFEmbedding
from roseinfer.model.gguf_header import map_file
from roseinfer.model.gguf_loader import GGUFFile, GGUFTensorInfo
from roseinfer.model.llama import LlamaForCausalLM
from roseinfer.model.quantize import (
    INT_FORMATS,
    Fp16Linear,
    act8_layer,
    convert_linear,
    linear_format,
    linear_paths,
    mark_quantized,
    set_module,
)
from roseinfer.model.registry import create_meta_model, get_model_class, materialize, reset_buffers

logger = logging.getLogger("roseinfer.model")

EXTRA_COPY_SHARE = 0.1  # Q4_1 int8 copies (1 byte per weight) kept up to this x file size
_FUSED = MappingProxyType({  # HF projection -> (our fused layer, its part's order)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)})
_F32 = GGMLQuantizationType.F32
_FLOATS = frozenset({_F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def gguf_kernels_loaded() -> bool:
    """The C++ kernels are loaded and include the GGUF formats (``kernels/gguf.py``)."""
    from roseinfer.kernels import cpu_kernels_available

    return (importlib.util.find_spec("roseinfer.kernels.gguf") is not None
            and cpu_kernels_available())


def stream_gguf(source: Path, dtype: torch.dtype, device: torch.device,
                quantization: str, requantize_16bit: bool = False
                ) -> tuple[nn.Module, ModelConfig, Path] | None:
    """(model, config, source) loaded by ``load_gguf_streamed`` when it serves this load:
    a Llama-family GGUF file, on CPU, float32 activations, the ``int8`` (or ``q4_0``)
    format and the GGUF kernels loaded; else None (the caller loads it the dequantizing way).  A
    directory holding one .gguf and no other checkpoint file stands for that file."""
    if source.is_dir():
        ggufs = sorted(source.glob("*.gguf"))
        others = [p for p in source.iterdir()
                  if p.suffix.lower() in (".safetensors", ".bin", ".pt", ".pth")]
        if len(ggufs) != 1 or others:
            return None
        source = ggufs[0]
    if (source.suffix.lower() != ".gguf" or not source.is_file() or device.type != "cpu"
            or dtype != torch.float32 or quantization not in INT_FORMATS
            or not gguf_kernels_loaded()):
        return None
    gf = GGUFFile(source)
    config = gguf_model_config(gf)
    if not issubclass(get_model_class(config.architecture), LlamaForCausalLM):
        return None
    return load_gguf_streamed(gf, config, requantize_16bit, quantization), config, source


@dataclass
class _Layer:
    """The GGUF tensors of one linear layer: weight parts (in row order) and bias parts."""

    weights: dict[int, GGUFTensorInfo] = field(default_factory=dict)
    biases: dict[int, GGUFTensorInfo] = field(default_factory=dict)
    parts: dict[int, str] = field(default_factory=dict)  # order -> GGUF part ("attn_q")


class _RawFile:
    """A read-only mapping of the GGUF: raw tensor views and page release."""

    def __init__(self, path: Path) -> None:
        self.mm = map_file(path)

    def rows(self, info: GGUFTensorInfo) -> Tensor:
        """uint8 [rows, row bytes], a view of the file (no copy, nothing read yet)."""
        with warnings.catch_warnings():  # read-only: nothing ever writes to it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self.mm, dtype=torch.uint8, count=info.nbytes,
                                    offset=info.offset)
        rows = info.shape[0] if len(info.shape) > 1 else 1
        return flat.view(rows, info.nbytes // rows)

    def release(self, info: GGUFTensorInfo) -> None:
        """Drop this process's mapping of the tensor's whole pages (refaulted if read)."""
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page
        end = (info.offset + info.nbytes) // page * page
        if end > start:
            self.mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def _group(gf: GGUFFile, model: nn.Module) -> tuple[dict[str, _Layer], list[tuple[str, str,
                                                                                   GGUFTensorInfo]]]:
    """GGUF tensors by linear layer path, and the others as (HF name, part, info)."""
    layer_paths = set(linear_paths(model))
    layers: dict[str, _Layer] = {}
    others: list[tuple[str, str, GGUFTensorInfo]] = []
    for info in gf.tensors.values():
        if info.name in ROPE_TENSORS:
            continue
        mapped = hf_name(info.name, gf.architecture)
        if mapped is None:
            logger.warning("%s: skipping unknown GGUF tensor %r", gf.path, info.name)
            continue
        name, part = mapped
        stem, _, kind = name.rpartition(".")
        parent, _, leaf = stem.rpartition(".")
        path, order = stem, 0
        if leaf in _FUSED:
            target, order = _FUSED[leaf]
            path = f"{parent}.{target}"
        if path not in layer_paths:
            others.append((name, part, info))
            continue
        layer = layers.setdefault(path, _Layer())
        (layer.weights if kind == "weight" else layer.biases)[order] = info
        layer.parts[order] = part
    return layers, others


def _extra_copy(layers: dict[str, _Layer], file_size: int) -> bool:
    q4 = sum(i.shape[0] * i.shape[1] for path, layer in layers.items() if act8_layer(path)
             for i in layer.weights.values() if i.qtype == GGMLQuantizationType.Q4_1)
    return 0 < q4 <= EXTRA_COPY_SHARE * file_size


def _check_types(path: Path, infos: Iterator[GGUFTensorInfo], kinds: frozenset[int]) -> None:
    for info in infos:
        if info.qtype != _F32 and int(info.qtype) not in kinds:
            raise ValueError(
                f"{path}: tensor {info.name!r} has type {info.qtype.name}, which the CPU "
                f"kernels do not run (they run: "
                f"{', '.join(sorted(GGMLQuantizationType(k).name for k in kinds))}); "
                "load it with quantization='none' to dequantize it to float32")


def _bias(gf: GGUFFile, layer: _Layer, arch: str, config: ModelConfig) -> Tensor | None:
    if not layer.biases:
        return None
    pieces = [to_hf_tensor(gf.read_tensor(layer.biases[o]).float(), arch, layer.parts[o], config)
              for o in sorted(layer.biases)]
    return torch.cat(pieces).contiguous()


def _raw_part(raw: _RawFile, info: GGUFTensorInfo, arch: str, part: str,
              config: ModelConfig) -> Tensor:
    """The part's raw rows, Q/K rows put back in Hugging Face order (a copy) for llama."""
    rows = raw.rows(info)
    if arch == "llama" and part in ("attn_q", "attn_k"):
        rows = to_hf_tensor(rows, arch, part, config)  # permutes whole rows (whole blocks)
    return rows


def _converted(infos: list[GGUFTensorInfo], requantize_16bit: bool) -> bool:
    """The layer takes ``convert_linear`` (Q8_0): an F32 part, or only float parts
    (F32 / F16 / BF16) when 16-bit matrices are to be requantized."""
    return (any(i.qtype == _F32 for i in infos)
            or (requantize_16bit and all(i.qtype in _FLOATS for i in infos)))


def _build_linear(gf: GGUFFile, raw: _RawFile, layer: _Layer, path: str, head: bool,
                  config: ModelConfig, extra_copy: bool, requantize_16bit: bool,
                  quantization: str) -> Fp16Linear:
    from roseinfer.kernels.gguf import make_gguf_linear

    arch = gf.architecture
    order = sorted(layer.weights)
    infos = [layer.weights[o] for o in order]
    bias = _bias(gf, layer, arch, config)
    out_features = sum(i.shape[0] for i in infos)
    in_features = infos[0].shape[1]
    if _converted(infos, requantize_16bit):  # float matrices: the usual conversion
        pieces = [to_hf_tensor(gf.read_tensor(i), arch, layer.parts[o], config)
                  for o, i in zip(order, infos, strict=True)]
        if len({p.dtype for p in pieces}) > 1:  # mixed float types: widened alike
            pieces = [p.float() for p in pieces]
        weight = torch.cat(pieces)
        module, _ = convert_linear(weight, bias, linear_format(quantization), head=head,
                                   act8=act8_layer(path))
        return module
    parts = [(int(i.qtype), _raw_part(raw, i, arch, layer.parts[o], config))
             for o, i in zip(order, infos, strict=True)]
    kernel = make_gguf_linear(parts, bias, act8=act8_layer(path), extra_copy=extra_copy)
    return Fp16Linear.from_kernel(kernel, out_features, in_features, bias)


def _embedding(gf: GGUFFile, raw: _RawFile, info: GGUFTensorInfo, config: ModelConfig
               ) -> nn.Module:
    if info.qtype == _F32:
        return nn.Embedding(config.vocab_size, config.hidden_size, _weight=gf.read_tensor(info))
    return GGUFEmbedding(raw.rows(info), info.qtype, config.vocab_size, config.hidden_size)


@torch.no_grad()
def load_gguf_streamed(gf: GGUFFile, config: ModelConfig, requantize_16bit: bool = False,
                       quantization: str = "int8") -> nn.Module:
    """``gf``'s model (``config``: its), the weights as stored, in ``int8`` format;
    ``requantize_16bit``: F16 / BF16 matrices requantized to Q8_0 instead.  ``q4_0``:
    the same, float matrices (F32 ones too) but the LM head's to Q4_0
    (``kernels/q4_0.py``)."""
    from roseinfer.kernels.gguf import gguf_kernel_types

    path = gf.path
    arch = gf.architecture
    model = create_meta_model(config, torch.float32)
    layers, others = _group(gf, model)
    embd = gf.tensors["token_embd.weight"]
    if "lm_head" not in layers:  # tied: the head reads the embedding matrix
        layers["lm_head"] = _Layer({0: embd}, {}, {0: "output"})
    missing = [p for p in linear_paths(model) if p not in layers]
    if missing:
        raise ValueError(f"{path}: no GGUF tensors for layers {missing[:4]}")
    _check_types(path, (i for layer in layers.values() for i in layer.weights.values()),
                 gguf_kernel_types())
    raw = _RawFile(path)
    extra_copy = _extra_copy(layers, path.stat().st_size)
    requantized = [p for p, layer in layers.items()
                   if requantize_16bit and _converted(list(layer.weights.values()), True)
                   and not _converted(list(layer.weights.values()), False)]
    if requantized:
        asked = "q4_0" if quantization == "q4_0" else "q8_0"
        target = {"q4_0": "Q4_0 (the LM head Q8_0)", "q8_0": "Q8_0"}[asked]
        logger.info("%s: %d F16/BF16 linear layers requantized to %s at load, as asked "
                    "(quantization %s)", path.name, len(requantized), target, asked)
    from roseinfer.model.progress import progress

    for lpath in progress(linear_paths(model), f"loading {path.name}", len(layers), unit="layer"):
        layer = layers[lpath]
        set_module(model, lpath, _build_linear(gf, raw, layer, lpath, lpath == "lm_head", config,
                                               extra_copy, requantize_16bit, quantization))
        for info in layer.weights.values():  # the kernel holds its own copy now
            raw.release(info)  # (the embedding's rows are read again as steps need them)
    model.model.embed_tokens = _embedding(gf, raw, embd, config)
    materialize(model, torch.device("cpu"))  # norms (and rotary caches): small
    reset_buffers(model)
    params = dict(model.named_parameters())
    loaded = set()
    for name, part, info in others:
        if name == "model.embed_tokens.weight":
            continue
        if name not in params:
            raise ValueError(f"{path}: GGUF tensor {info.name!r} ({name}) fits no parameter")
        value = to_hf_tensor(gf.read_tensor(info), arch, part, config)
        params[name].copy_(value.to(params[name].dtype).reshape(params[name].shape))
        loaded.add(name)
    never = sorted(set(params) - loaded - {"model.embed_tokens.weight"})
    if never:
        raise ValueError(f"{path}: parameters never loaded from the GGUF: {never[:4]}")
    model.requires_grad_(False)
    mark_quantized(model, quantization)
    logger.info("%s: weights kept as stored (%s), extra Q4_1 int8 copies: %s", path.name,
                ", ".join(sorted({i.qtype.name for i in gf.tensors.values()})), extra_copy)
    return model.eval()
