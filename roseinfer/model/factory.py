"""load_model: checkpoint on disk -> ready model on the chosen device, dtype and format.

Given a weight format (``quantization``), the model comes back converted
(``quantize_model``) and, on CPU, goes through the weight cache (``weight_cache``):
the first start loads the checkpoint (GGUF tensors are dequantized), converts it and
stores the result; later starts build the model straight from that file (int8 / Q4_1
layers from their stored integers and scales), bitwise the same model.  Only what saves work is
cached: int8 weights (any source) and every format of a GGUF source (dequantizing is
the slow part); an fp32 copy of a safetensors checkpoint would only cost disk.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from roseinfer.model.cache_key import (
    cache_enabled,
    cache_root,
    code_fingerprint,
    source_fingerprint,
)
from roseinfer.model.config import ModelConfig
from roseinfer.model.half_embedding import keep_embeddings_in
from roseinfer.model.loader import Checkpoint, load_checkpoint, resolve_model_path
from roseinfer.model.progress import note, progress, step
from roseinfer.model.quantize import INT_FORMATS, converter_as_loaded, quantize_model
from roseinfer.model.registry import create_meta_model, create_model, materialize, reset_buffers
from roseinfer.model.weight_cache import WeightCache
from roseinfer.model.weight_state import model_from_state, model_state

logger = logging.getLogger("roseinfer.model")

# The code a cached conversion depends on (paths in the roseinfer package).
_CONVERSION_CODE = ("model", "kernels")


def load_model(
    model: str | Path | None, dtype: torch.dtype, device: torch.device,
    quantization: str | None = None, weight_cache: bool | None = None,
    requantize_16bit: bool = False,
) -> tuple[nn.Module, ModelConfig, Path]:
    """Load weights (HF dir, GGUF or .pt; None = default model); return (model, config,
    source).  ``quantization`` (``"none"``, ``"int8"``...): convert to that format, using
    the weight cache unless ``weight_cache`` is False (None: ``cache_key.cache_enabled``);
    None: return the model as loaded (no cache), for the caller's ``quantize_model``.
    ``requantize_16bit``: a GGUF streamed in ``int8`` has its F16 / BF16 matrices
    requantized to Q8_0 (``EngineConfig`` quantization ``"q8_0"``) rather than kept."""
    if quantization is not None:
        from roseinfer.model.gguf_stream import stream_gguf

        streamed = stream_gguf(resolve_model_path(model), dtype, device, quantization,
                               requantize_16bit)
        if streamed is not None:  # GGUF weights as stored, from the mmapped file: no cache
            return streamed
    ckpt = load_checkpoint(model)
    if quantization is None:
        return _load(ckpt, dtype, device), ckpt.config, ckpt.source
    cache = _cache_entry(ckpt, dtype, device, quantization, weight_cache)
    if cache is not None:
        net = _from_cache(cache, ckpt.config, dtype, device, quantization)
        if net is not None:
            return net, ckpt.config, ckpt.source
        note(f"first start of {ckpt.source.name} as {quantization}: converting its weights "
             f"(kept in {cache.directory} for the next starts)")
    records: dict[str, dict[str, Tensor]] = {}
    ckpt, linear_dtype = _linear_storage(ckpt, dtype, device, quantization)
    kept = records if cache is not None else None
    net = _load(ckpt, dtype, device, linear_dtype,
                None if quantization == "none" else (quantization, kept))
    if quantization != "none":
        quantize_model(net, quantization, kept,
                       track=lambda paths: progress(paths, f"converting to {quantization}",
                                                    len(paths), unit="layer"))
    if cache is not None:
        with step("writing the weight cache"):
            cache.save(model_state(net, records))
    return net, ckpt.config, ckpt.source


def _load(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
          linear_dtype: torch.dtype | None = None,
          convert: tuple[str, dict[str, dict[str, Tensor]] | None] | None = None) -> nn.Module:
    """The model as loaded; ``linear_dtype``: its linear weights stored in that dtype
    (a 16-bit checkpoint's, until each layer is converted), and its embeddings too
    (``HalfEmbedding``: rows widened per step).  ``convert``: (quantization, records):
    each linear layer converted as soon as it is loaded (``quantize.converter_as_loaded``;
    the caller's ``quantize_model`` converts the rest)."""
    if linear_dtype is None:
        net = create_model(ckpt.config, dtype, device)
    else:
        net = create_meta_model(ckpt.config, dtype)
        for module in net.modules():
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(module.weight.to(linear_dtype), requires_grad=False)
        keep_embeddings_in(net, linear_dtype, dtype)  # no fp32 copy of the vocabulary
        materialize(net, device)
        reset_buffers(net)
        net.requires_grad_(False)
    weights = progress(ckpt.weights, f"loading {ckpt.source.name}", ckpt.num_tensors)
    if convert is None:
        net.load_weights(weights)
    else:
        net.load_weights(weights, converter_as_loaded(net, *convert))
    return net.eval()


def _linear_storage(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                    quantization: str) -> tuple[Checkpoint, torch.dtype | None]:
    """A bf16 / fp16 checkpoint converted to int8 on CPU keeps its linear weights in their
    dtype until each layer is converted (no fp32 copy of the model): (the checkpoint, with
    its first tensor peeked, and that dtype), else (it, None)."""
    if (quantization not in INT_FORMATS or dtype != torch.float32 or device.type != "cpu"
            or ckpt.source.suffix.lower() == ".gguf"):  # GGUF: dequantized values are fp32
        return ckpt, None
    weights = iter(ckpt.weights)
    first = next(weights, None)
    if first is None:
        return ckpt, None
    ckpt = replace(ckpt, weights=itertools.chain([first], weights))
    if first[1].dtype not in (torch.bfloat16, torch.float16):
        return ckpt, None
    from roseinfer.kernels import cpu_kernels_available

    return ckpt, first[1].dtype if cpu_kernels_available() else None


def _cache_entry(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                 quantization: str, option: bool | None) -> WeightCache | None:
    """The weight-cache entry for this load, or None when nothing is cached."""
    if device.type != "cpu" or not cache_enabled(option):
        return None
    int8_layers = False
    if quantization in INT_FORMATS and dtype == torch.float32:
        from roseinfer.kernels import cpu_kernels_available

        int8_layers = cpu_kernels_available()
    if not int8_layers and ckpt.source.suffix.lower() != ".gguf":
        return None

    kind = {"kind": "weights", "quantization": quantization, "dtype": str(dtype)}
    key = {**kind, "linear_storage": "int8" if int8_layers else "plain",
           "source": source_fingerprint(ckpt.source), "torch": torch.__version__,
           "code": code_fingerprint(_CONVERSION_CODE)}
    return WeightCache(cache_root() / "weights", ckpt.source, kind, key)


def _from_cache(cache: WeightCache, config: ModelConfig, dtype: torch.dtype,
                device: torch.device, quantization: str) -> nn.Module | None:
    start = time.perf_counter()
    state = cache.load()
    if state is None:
        return None
    try:
        net = model_from_state(config, dtype, device, state, quantization)
    except Exception as exc:  # noqa: BLE001 - a stored state that does not build is corrupt
        cache.discard(f"unusable ({exc})")
        return None
    logger.info("weights from the cache %s (%.2f s)", cache.path, time.perf_counter() - start)
    return net
