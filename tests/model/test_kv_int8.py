"""The int8 KV cache's PyTorch arithmetic (roseinfer.model.kv_int8) against a numpy
model of the documented rule, its round trip, and the pool's size accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roseinfer.config import EngineConfig
from roseinfer.model import kv_int8
from roseinfer.model.config import ModelConfig
from roseinfer.runner.kv_pool import allocate_kv_caches, kv_bytes_per_block, num_kv_blocks


def reference_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """docs/CONTRACTS.md's rule in numpy float32: scale = absmax / 127, q = rne(x / scale)."""
    x = x.astype(np.float32)
    scale = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)  # rint: half to even
    return q, scale


def test_quantize_rows_matches_the_documented_rule() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    x[0, 0] = 0.0  # an all-zero row: scale 0, q 0
    x[1, 1, :8] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -127.0])  # scale 1: ties
    packed = kv_int8.quantize_rows(x)
    assert packed.dtype == torch.int8 and packed.shape == (50, 3, 68)
    q, scale = reference_quantize(x.numpy())
    assert np.array_equal(packed[..., :64].numpy(), q)
    assert np.array_equal(kv_int8.scales_of(packed).numpy(), scale)
    assert packed[1, 1, :8].tolist() == [127, 2, 4, -2, 0, 0, 2, -127]  # half to even
    assert not packed[0, 0].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_half_a_step(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 2, 48, generator=gen) * 3).to(dtype)
    packed = kv_int8.quantize_rows(x)
    back = kv_int8.dequantize_rows(packed)  # float32
    step = x.float().abs().amax(-1, keepdim=True) / 127
    assert ((back - x.float()).abs() <= step / 2 + 1e-6 * x.float().abs()).all()  # + q * s rounding
    assert kv_int8.dequantize_rows(packed, dtype).dtype == dtype
    # The largest value of each row is exact up to the scale's rounding.
    torch.testing.assert_close(back.abs().amax(-1), x.float().abs().amax(-1), rtol=1e-6, atol=0)


def _config(head_dim: int = 64) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=192,
                       intermediate_size=256, num_layers=3, num_heads=3, num_kv_heads=3,
                       head_dim=head_dim, max_position_embeddings=256)


def test_pool_holds_about_twice_the_tokens_of_float16() -> None:
    cfg = _config()
    half = kv_bytes_per_block(cfg, 16, torch.float16)
    int8 = kv_bytes_per_block(cfg, 16, torch.int8)
    assert int8 == half * 68 // 128  # 64 values + a 4-byte scale vs 64 fp16 values
    budget = EngineConfig(kv_cache_memory_gb=0.01)
    ratio = num_kv_blocks(budget, cfg, torch.int8) / num_kv_blocks(budget, cfg, torch.float16)
    assert 1.85 < ratio < 1.9
    caches = allocate_kv_caches(cfg, 4, 16, torch.int8, torch.device("cpu"))
    assert len(caches) == 3 and caches[0].shape == (2, 64, 3, 68)
    assert sum(c.numel() for c in caches) == 4 * int8
    assert kv_int8.head_dim_of(caches[0]) == 64
