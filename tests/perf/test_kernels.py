"""The C++ CPU kernels agree with the PyTorch path (skipped where they cannot build)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from roseinfer.kernels import cpu_kernels_available, make_linear
from roseinfer.model import kv_int8
from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata
from roseinfer.model.config import ModelConfig
from roseinfer.model.quantize import quantize_model
from roseinfer.model.registry import create_model

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels unavailable")


def random_cache(slots: int, hkv: int, head_dim: int, dtype: torch.dtype,
                 gen: torch.Generator) -> torch.Tensor:
    """[2, slots, Hkv, row] of random K/V in a cache of ``dtype`` (int8: quantized rows)."""
    x = torch.randn(2, slots, hkv, head_dim, generator=gen)
    return kv_int8.to_cache_rows(x, dtype).contiguous()


@pytest.mark.parametrize("head_dim", [64, 32, 128])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_paged_attention_matches_sdpa(head_dim: int, cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    d, h, hkv, bs = 5, 6, 2, 4
    lens = torch.tensor([1, 3, 4, 9, 17], dtype=torch.int32)
    width = 5
    num_blocks = d * width
    cache = torch.randn(2, num_blocks * bs, hkv, head_dim, generator=gen).to(cache_dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(d, width).to(torch.int32)
    q = torch.randn(d, h, head_dim, generator=gen)
    rows = torch.arange(d, dtype=torch.int32)  # one query row per sequence
    got = torch.ops.roseinfer.paged_attention(q, cache, tables, rows, lens, bs, head_dim**-0.5)
    for i in range(d):
        pos = torch.arange(int(lens[i]))
        slots = tables[i].long()[pos // bs] * bs + pos % bs
        k = cache[0][slots].float().transpose(0, 1)  # [Hkv, L, Dh]
        v = cache[1][slots].float().transpose(0, 1)
        qi = q[i].view(hkv, h // hkv, head_dim)
        want = F.scaled_dot_product_attention(qi, k, v, scale=head_dim**-0.5).reshape(h, head_dim)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
def test_paged_attention_row_alone_equals_row_in_batch(
    head_dim: int, heads: tuple[int, int], cache_dtype: torch.dtype
) -> None:
    """A row's output is bitwise the same alone and among 40 rows of other lengths (its
    work items then on whichever thread), at any block size, for groups of query heads
    taken in passes of 3 (9/3), 3 + 1 (8/2) and 1 (4/4)."""
    h, hkv = heads
    gen = torch.Generator().manual_seed(1)
    d, width = 40, 8
    for bs in (16, 5, 1):
        num_blocks = d * width
        cache = random_cache(num_blocks * bs, hkv, head_dim, cache_dtype, gen)
        tables = torch.randperm(num_blocks, generator=gen).view(d, width).to(torch.int32)
        q = torch.randn(d, h, head_dim, generator=gen)
        lens = torch.randint(1, width * bs + 1, (d,), generator=gen, dtype=torch.int32)
        rows = torch.arange(d, dtype=torch.int32)
        scale = head_dim**-0.5
        batch = torch.ops.roseinfer.paged_attention(q, cache, tables, rows, lens, bs, scale)
        for i in (0, 17, 39):
            alone = torch.ops.roseinfer.paged_attention(
                q[i : i + 1], cache, tables, rows[i : i + 1], lens[i : i + 1], bs, scale)
            assert torch.equal(alone[0], batch[i]), (bs, i)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)])
def test_paged_attention_fp16_cache_equals_its_fp32_copy(
    head_dim: int, heads: tuple[int, int]
) -> None:
    """An fp16 cache and its fp32 copy hold the same values, and the kernel widens fp16
    exactly: the outputs are bitwise equal, so both cache dtypes run the same arithmetic
    (query heads in passes of 3 (9/3), 3 + 1 (8/2) and 1 (4/4); contexts of 1 to 40)."""
    h, hkv = heads
    gen = torch.Generator().manual_seed(2)
    d, width, bs = 12, 5, 8
    cache = torch.randn(2, d * width * bs, hkv, head_dim, generator=gen).half()
    tables = torch.randperm(d * width, generator=gen).view(d, width).to(torch.int32)
    q = torch.randn(d, h, head_dim, generator=gen)
    lens = torch.randint(1, width * bs + 1, (d,), generator=gen, dtype=torch.int32)
    rows = torch.arange(d, dtype=torch.int32)
    args = (tables, rows, lens, bs, head_dim**-0.5)
    half = torch.ops.roseinfer.paged_attention(q, cache, *args)
    single = torch.ops.roseinfer.paged_attention(q, cache.float(), *args)
    assert torch.equal(half, single)


def test_linear_kernel_fp32_and_fp16() -> None:
    torch.manual_seed(0)
    w, b, x = torch.randn(40, 24), torch.randn(40), torch.randn(7, 24)
    exact = make_linear(w, b, fp16=False)
    torch.testing.assert_close(exact.forward(x), F.linear(x, w, b))
    half = make_linear(w, b, fp16=True)
    torch.testing.assert_close(half.forward(x), F.linear(x, w.half().float(), b),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [24, 64, 200])
def test_linear_kernel_fp32_is_its_portable_kernel_and_batch_invariant(k: int) -> None:
    """The exact fp32 GEMM (``quantization="none"``): the same bits as its portable twin
    (what a build without AVX2 runs; it ran ``at::mm`` until 11-29, whose rows depended
    on the batch), and each row alone as in any batch, with and without a bias, K with
    and without a tail shorter than 32."""
    gen = torch.Generator().manual_seed(k)
    w, b, x = torch.randn(37, k, generator=gen), torch.randn(37, generator=gen), torch.randn(
        9, k, generator=gen)
    for bias in (b, None):
        lin = make_linear(w, bias, fp16=False)
        got = lin.forward(x)
        assert torch.equal(lin.forward_portable(x), got)
        for m in (1, 2, 5):
            assert torch.equal(lin.forward(x[:m]), got[:m])
            assert torch.equal(lin.forward_portable(x[m:m + 1]), got[m:m + 1])


@pytest.mark.parametrize("rows", [3, 8, 40])
def test_linear_kernel_bf16_copy_for_large_inputs(rows: int) -> None:
    torch.manual_seed(0)
    w, b, x = torch.randn(40, 24), torch.randn(40), torch.randn(rows, 24)
    lin = make_linear(w, b, fp16=True, bf16_min_rows=8)
    got = lin.forward(x)
    if rows >= 8:  # bf16 inputs, weights and output (oneDNN), fp32 accumulation
        want = F.linear(x.bfloat16(), w.bfloat16()).float() + b
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # fp16 weights, fp32 math
        torch.testing.assert_close(got, F.linear(x, w.half().float(), b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 64, 200])
def test_linear_kernel_int8_every_input_size(rows: int) -> None:
    """int8 weights with a scale per 32 against int16 activations with a scale per 32
    (exact int32 block dots) for every row count: close to the dequantised fp32 product,
    each row bitwise equal to that row computed alone (batch invariance), and the AVX2
    kernel bitwise equal to the portable one (the same arithmetic on every CPU)."""
    from roseinfer.kernels import quantize_int8_blocks

    torch.manual_seed(0)
    w, b, x = torch.randn(44, 96), torch.randn(44), torch.randn(rows, 96) * 4
    x[0, 5:37] = 0.0  # an all-zero 32-block (scale 0)
    lin = make_linear(w, b, fp16=True, int8=True)
    q, scales = quantize_int8_blocks(w)
    assert q.dtype == torch.int8 and scales.shape == (44, 3)
    dequant = (q.float().view(44, 3, 32) * scales[..., None]).view(44, 96)
    assert (dequant - w).abs().max() <= scales.max() / 2 + 1e-6  # round to nearest
    got = lin.forward(x)
    want = F.linear(x, dequant, b)
    # int16 activations: each value within half a step (its block's max|x| / 32767 / 2)
    half_step = (x.view(rows, 3, 32).abs().amax(-1, keepdim=True) / 32767 / 2).expand(-1, -1, 32)
    bound = half_step.reshape(rows, 96) @ dequant.abs().t()
    assert ((got - want).abs() <= bound + 1e-4 * want.abs() + 1e-5).all()
    assert torch.equal(lin.forward_portable(x), got)
    for m in range(rows):
        assert torch.equal(lin.forward(x[m:m + 1].clone()), got[m:m + 1])


def _q4_1_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight as the gguf package dequantizes a Q4_1 tensor: fp32(fp32(d * q) + m)."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer maps each block's min to 0, max to 15
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    d[0, 0] = 0.0  # a constant block
    return (d * q + m).reshape(n, k)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 64])
def test_linear_kernel_q4_1_exact_weights(rows: int) -> None:
    """A Q4_1 GGUF's weights are recovered exactly and computed as they are: nibbles for
    steps of up to 4 rows, an int8 copy of the same integers above; every row bitwise
    equal alone and in a batch, and to the portable kernel; close to x @ w.T."""
    from roseinfer.kernels.q4_1 import recover_q4_1

    gen = torch.Generator().manual_seed(3)
    w = _q4_1_weight(40, 96, gen)
    rec = recover_q4_1(w)
    assert rec is not None
    q, d, m = rec
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    assert torch.equal((d[..., None] * q.float().view(40, 3, 32) + m[..., None]).view(40, 96), w)
    assert recover_q4_1(torch.randn(40, 96, generator=gen)) is None  # not Q4_1: int8 instead
    b = torch.randn(40, generator=gen)
    lin = make_linear(w, b, fp16=False, int8=True)  # picks the Q4_1 path by itself
    x = torch.randn(rows, 96, generator=gen) * 3
    got = lin.forward(x)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=2e-3)
    assert torch.equal(lin.forward_portable(x), got)
    for r in range(rows):
        assert torch.equal(lin.forward(x[r:r + 1].clone()), got[r:r + 1])


def _act8_reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                    b: torch.Tensor) -> torch.Tensor:
    """csrc/q4_act8.h's arithmetic in float64 (exact for these small integers) and with
    its fp32 roundings: int8 activations per 16 values, per 32-block the exact integer
    dots of its halves, then t = dot0 * dx0, t = fma(dot1, dx1, t), acc = fma(t, d, acc);
    acc = fma(sx, m, acc), sx = fma(sum(xq1), dx1, sum(xq0) * dx0)."""
    rows, k = x.shape
    xb = x.view(rows, k // 16, 16)
    dx = xb.abs().amax(-1) / 127.0  # [rows, K/16] fp32
    safe = torch.where(dx == 0, torch.ones_like(dx), dx)
    xq = torch.round(xb / safe[..., None]).clamp(-127, 127)  # [rows, K/16, 16]
    s = xq.sum(-1)  # exact integers
    s0 = (s[:, 0::2] * dx[:, 0::2]).float()  # fp32 product of an exact integer
    sx = (s[:, 1::2].double() * dx[:, 1::2].double() + s0.double()).float()  # fma
    dots = torch.einsum("rhk,nhk->rnh", xq.double(), q.double().view(-1, k // 16, 16))
    acc = torch.zeros(rows, q.shape[0], dtype=torch.float32)
    for j in range(k // 32):
        t = (dots[..., 2 * j] * dx[:, 2 * j:2 * j + 1].double()).float()  # fp32 product
        t = (dots[..., 2 * j + 1] * dx[:, 2 * j + 1:2 * j + 2].double() + t.double()).float()
        acc = (t.double() * d[None, :, j].double() + acc.double()).float()  # one rounding: fma
        acc = (sx[:, j:j + 1].double() * m[None, :, j].double() + acc.double()).float()
    return acc + b


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 16, 64])
def test_linear_kernel_q4_1_int8_activations(rows: int) -> None:
    """Q4_1 weights against int8 activations (vpmaddubsw): bitwise the documented
    arithmetic (an exact float64 model of it), the portable kernel, each row alone, and
    nibbles (up to 4 rows) vs bytes (more) give the same integers."""
    from roseinfer.kernels import make_q4_linear
    from roseinfer.kernels.q4_1 import recover_q4_1

    gen = torch.Generator().manual_seed(5)
    w = _q4_1_weight(40, 128, gen)
    q, d, m = recover_q4_1(w)
    b = torch.randn(40, generator=gen)
    lin = make_q4_linear(q, d, m, b, act8=True)
    x = torch.randn(rows, 128, generator=gen) * 3
    x[0, :32] = 0.0  # a zero block: dx = 0
    got = lin.forward(x)
    assert torch.equal(got, _act8_reference(x, q, d, m, b))
    assert torch.equal(lin.forward_portable(x), got)
    for r in range(rows):
        assert torch.equal(lin.forward(x[r:r + 1].clone()), got[r:r + 1])
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=0.05, atol=0.5)


def _tiny_llama(bias: bool) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_bias=bias,
    )
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    mcfg = ModelConfig.from_hf_dict(cfg.to_dict())
    model = create_model(mcfg, torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    return model


@pytest.mark.parametrize("quantization", ["none", "fp16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
def test_decode_stack_matches_pytorch_path(quantization: str, bias: bool,
                                           cache_dtype: torch.dtype) -> None:
    model = quantize_model(_tiny_llama(bias), quantization)
    cfg, bs = model.config, 4
    gen = torch.Generator().manual_seed(2)
    lens = [5, 1, 11]  # context already cached per sequence
    caches = [random_cache(64 * bs, cfg.num_kv_heads, cfg.head_dim, cache_dtype, gen)
              for _ in range(cfg.num_layers)]
    tables = [[3, 9, 1], [7], [0, 2, 5, 11]]
    specs = [SeqSpec(n, 1, t) for n, t in zip(lens, tables, strict=True)]
    meta = build_attention_metadata(specs, bs, torch.device("cpu"))
    ids = torch.tensor([4, 50, 96])
    with torch.inference_mode():
        fast_caches = [c.clone() for c in caches]
        fast = model(ids, meta.positions, fast_caches, meta)
        assert model._stack is not None, "the decode stack should serve an all-decode step"
        model._stack, model._stack_state = None, "disabled"
        slow = model(ids, meta.positions, caches, meta)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)
    # Same K/V up to fp32 GEMM rounding (GEMV vs MKL), which can flip one fp16 ulp.
    # An int8 cache: the same quantized values up to one step (absmax / 127) of a row.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.int8: 3e-2}[cache_dtype]
    for a, b in zip(fast_caches, caches, strict=True):
        assert a.dtype == cache_dtype
        if cache_dtype == torch.int8:
            a, b = kv_int8.dequantize_rows(a), kv_int8.dequantize_rows(b)
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
