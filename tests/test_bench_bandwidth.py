"""The bandwidth-limit arithmetic of ``roseinfer bench throughput`` (bench/bandwidth.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from roseinfer.bench.bandwidth import (
    bandwidth_limit_tok_s,
    estimated_weight_bytes,
    gguf_weight_bytes,
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
