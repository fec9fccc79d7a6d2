"""The memory-bandwidth limit of decoding: read bandwidth and weight bytes per step.

A decode step reads every weight of the model once, whatever the batch (the embedding
only gathers its rows, unless it doubles as the LM head). One stream can therefore not
exceed ``read bandwidth / weight bytes`` tokens per second; the throughput benchmark
prints batch 1's decode speed as a percentage of that limit.

* ``read_bandwidth_gbs``: the best of a few timed ``torch.sum`` passes over a 1 GiB
  float32 tensor with the engine's threads (a STREAM-style read, no writes), on
  transparent huge pages where the OS offers them, as the packed weights are
  (``csrc/weight_memory.h``): on 4 KiB pages the same read is ~25% slower here.
* ``weight_bytes_per_step``: for a GGUF file, the bytes its tensors take as stored (what
  the kernels read, since weights are used as stored); for other checkpoints an estimate
  from the shapes and the load-time format (Q8_0: 34 bytes per 32 weights, fp16: 2,
  fp32: 4).
* ``linear_bytes_per_step``: the same split by decoder linear (qkv, o, gate/up, down over
  all layers), which ``roseinfer bench profile`` divides by the C++ stack's time in each.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from roseinfer.model.config import ModelConfig
from roseinfer.model.gguf_header import map_file, parse_header
from roseinfer.runner.kv_pool import anonymous_pages

_BYTES_PER_WEIGHT = {"int8": 34 / 32, "fp16": 2.0, "fp16+bf16": 2.0, "none": 4.0}


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best read bandwidth (GB/s, 1e9 bytes) of ``repeats`` sums over ``nbytes`` of fp32."""
    data = torch.frombuffer(anonymous_pages(nbytes), dtype=torch.float32)  # as the KV pool
    data.fill_(1.0)
    data.sum()  # page in and warm the threads
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return data.numel() * 4 / best / 1e9


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors that one decode step reads: all but the token
    embedding, which counts only when it is also the LM head (no ``output.weight``)."""
    mm = map_file(path)
    try:
        _, tensors = parse_header(mm, path)
    finally:
        mm.close()
    total = sum(info.nbytes for name, info in tensors.items() if name != "token_embd.weight")
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        total += tensors["token_embd.weight"].nbytes
    return total


# A decoder linear's kind, as the C++ stack times it, by GGUF tensor name.
LINEAR_KINDS = ("qkv", "o", "gate_up", "down")
_GGUF_KIND = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "attn_qkv": "qkv",
              "attn_output": "o", "ffn_gate": "gate_up", "ffn_up": "gate_up",
              "ffn_down": "down"}


def gguf_linear_bytes(path: Path) -> dict[str, int]:
    """Stored bytes of each kind of decoder linear over all layers (``LINEAR_KINDS``):
    the ``blk.N.<name>.weight`` tensors of a GGUF."""
    mm = map_file(path)
    try:
        _, tensors = parse_header(mm, path)
    finally:
        mm.close()
    out = dict.fromkeys(LINEAR_KINDS, 0)
    for name, info in tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" \
                and parts[2] in _GGUF_KIND:
            out[_GGUF_KIND[parts[2]]] += info.nbytes
    return out


def linear_weights(config: ModelConfig) -> dict[str, int]:
    """Weights of each kind of decoder linear over all layers (``LINEAR_KINDS``)."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q, inter, n = config.num_heads * config.head_dim, config.intermediate_size, config.num_layers
    return {"qkv": n * h * (q + 2 * kv), "o": n * q * h, "gate_up": n * 2 * h * inter,
            "down": n * inter * h}


def _decoder_bytes_per_weight(quantization: str) -> float:
    return 18 / 32 if quantization == "q4_0" else _BYTES_PER_WEIGHT.get(quantization, 4.0)


def estimated_weight_bytes(config: ModelConfig, quantization: str) -> int:
    """Bytes one decode step reads for a checkpoint converted at load: decoder linears
    and the LM head at ``quantization``'s bytes per weight (norms and biases ignored;
    ``q4_0``: decoder Q4_0, LM head int8)."""
    decoder, head = sum(linear_weights(config).values()), config.vocab_size * config.hidden_size
    head_bpw = _BYTES_PER_WEIGHT["int8"] if quantization == "q4_0" else \
        _BYTES_PER_WEIGHT.get(quantization, 4.0)
    return int(decoder * _decoder_bytes_per_weight(quantization) + head * head_bpw)


def linear_bytes_per_step(model_path: Path, config: ModelConfig,
                          quantization: str) -> dict[str, int]:
    """Bytes each kind of decoder linear reads per decode step (``LINEAR_KINDS``): exact
    for GGUF files, else estimated from the shapes as ``estimated_weight_bytes``."""
    if model_path.suffix == ".gguf":
        return gguf_linear_bytes(model_path)
    bpw = _decoder_bytes_per_weight(quantization)
    return {k: int(n * bpw) for k, n in linear_weights(config).items()}


def weight_bytes_per_step(model_path: Path, config: ModelConfig, quantization: str) -> int:
    """Weight bytes read per decode step (exact for GGUF files, estimated otherwise)."""
    if model_path.suffix == ".gguf":
        return gguf_weight_bytes(model_path)
    return estimated_weight_bytes(config, quantization)


def bandwidth_limit_tok_s(weight_bytes: int, bandwidth_gbs: float) -> float:
    """Decode tok/s one stream cannot exceed: steps per second at which the weights are
    read once each."""
    return bandwidth_gbs * 1e9 / weight_bytes
