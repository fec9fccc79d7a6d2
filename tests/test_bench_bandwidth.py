"""The bandwidth-limit arithmetic of ``roseinfer bench throughput`` (bench/bandwidth.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from roseinfer.bench.bandwidth import (
    bandwidth_limit_tok_s,
    estimated_weight_bytes,
    gguf_linear_bytes,
    gguf_weight_bytes,
    linear_bytes_per_step,
    linear_weights,
    read_bandwidth_gbs,
)
from roseinfer.bench.cpu_info import cpu_flags
from roseinfer.model.config import ModelConfig


def _write_gguf(path: Path, tensors: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_weight_bytes_count_the_embedding_only_as_the_head(tmp_path: Path,
                                                                 tied: bool) -> None:
    tensors = {"token_embd.weight": np.zeros((64, 32), np.float32),
               "blk.0.attn_q.weight": np.zeros((32, 32), np.float16)}
    if not tied:
        tensors["output.weight"] = np.zeros((64, 32), np.float16)
    path = tmp_path / "m.gguf"
    _write_gguf(path, tensors)
    layer = 32 * 32 * 2
    assert gguf_weight_bytes(path) == (layer + 64 * 32 * 4 if tied else layer + 64 * 32 * 2)


def test_estimated_weight_bytes_follow_the_shapes_and_format() -> None:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, max_position_embeddings=256)
    weights = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 100 * 64
    assert estimated_weight_bytes(cfg, "fp16") == 2 * weights
    assert estimated_weight_bytes(cfg, "none") == 4 * weights
    assert estimated_weight_bytes(cfg, "int8") == int(weights * 34 / 32)


def test_limit_and_bandwidth() -> None:
    assert bandwidth_limit_tok_s(10**9, 35.0) == pytest.approx(35.0)
    assert read_bandwidth_gbs(nbytes=1 << 22, repeats=2) > 0


def test_cpu_flags_names_the_model_and_simd_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse avx2 fma "
                    "avx512f avx512_vnni\n\nprocessor\t: 1\nmodel name\t: Test CPU\n")
    assert cpu_flags(info) == "Test CPU: avx2 fma avx512f avx512_vnni"
    assert cpu_flags(tmp_path / "missing") == "?"


def test_gguf_linear_bytes_group_the_decoder_tensors_by_linear(tmp_path: Path) -> None:
    f16 = np.float16
    tensors = {"token_embd.weight": np.zeros((64, 32), np.float32),
               "blk.0.attn_norm.weight": np.zeros(32, np.float32)}
    for layer in (0, 1):
        tensors |= {f"blk.{layer}.attn_q.weight": np.zeros((32, 32), f16),
                    f"blk.{layer}.attn_k.weight": np.zeros((16, 32), f16),
                    f"blk.{layer}.attn_v.weight": np.zeros((16, 32), f16),
                    f"blk.{layer}.attn_q.bias": np.zeros(32, np.float32),
                    f"blk.{layer}.attn_output.weight": np.zeros((32, 32), f16),
                    f"blk.{layer}.ffn_gate.weight": np.zeros((64, 32), f16),
                    f"blk.{layer}.ffn_up.weight": np.zeros((64, 32), f16),
                    f"blk.{layer}.ffn_down.weight": np.zeros((32, 64), f16)}
    path = tmp_path / "m.gguf"
    _write_gguf(path, tensors)
    assert gguf_linear_bytes(path) == {"qkv": 2 * 64 * 32 * 2, "o": 2 * 32 * 32 * 2,
                                       "gate_up": 2 * 128 * 32 * 2, "down": 2 * 32 * 64 * 2}
    assert linear_bytes_per_step(path, None, "auto") == gguf_linear_bytes(path)


def test_estimated_linear_bytes_add_up_to_the_decoder() -> None:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, max_position_embeddings=256)
    weights = linear_weights(cfg)
    assert weights == {"qkv": 2 * 64 * 128, "o": 2 * 64 * 64, "gate_up": 2 * 2 * 64 * 128,
                       "down": 2 * 128 * 64}
    for quant, head in (("fp16", 2.0), ("q4_0", 34 / 32)):
        linear = linear_bytes_per_step(Path("model-dir"), cfg, quant)
        assert sum(linear.values()) + int(100 * 64 * head) == pytest.approx(
            estimated_weight_bytes(cfg, quant), abs=2)
