"""GGUF weights used as stored (kernels/gguf.py, csrc/gguf_gemm.h): rows dequantize
bitwise as the gguf package does, the GEMM is bitwise its documented arithmetic, the
portable kernel, and each row alone, for every supported type and mixed parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roseinfer.kernels import cpu_kernels_available

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels unavailable")

T = gguf.GGMLQuantizationType
QUANT = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
ALL = [T.F16, T.BF16, *QUANT]
# Offsets of the fp16 scale fields in each stored block.
HALF_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
               T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def random_raw(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """Valid stored rows [n, row_bytes]: random bytes with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    if qtype in (T.F16, T.BF16):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return gguf.quants.quantize(w, qtype).view(np.uint8).reshape(n, 2 * k)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        scale = (rng.uniform(0.001, 0.05, (n, k // values)) * rng.choice([-1, 1], (n, k // values)))
        raw[..., off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


def weight_model(qtype: int, raw: np.ndarray, k: int):
    """(v int [n, k], D float32 [n, k/16] per 16 values, M float32 [n, k/32] or None):
    the integers and scales the kernel multiplies (gguf_formats.h), decoded here from the
    gguf package's layouts."""
    n = raw.shape[0]
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    b = raw.reshape(n, k // values, size)

    def f16(a: np.ndarray) -> np.ndarray:
        return a.copy().view(np.float16).astype(np.float32)[..., 0]

    def nibbles(qs: np.ndarray) -> np.ndarray:  # [.., 16] -> [.., 32]
        return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)

    def bits(qh: np.ndarray) -> np.ndarray:  # [.., 4] -> [.., 32]
        word = qh.copy().view(np.uint32)
        return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64)

    m = None
    if qtype == T.Q8_0:
        v, d = b[..., 2:].view(np.int8).astype(np.int64), f16(b[..., 0:2])
    elif qtype == T.Q4_0:
        v, d = nibbles(b[..., 2:]) - 8, f16(b[..., 0:2])
    elif qtype == T.Q4_1:
        v, d, m = nibbles(b[..., 4:]), f16(b[..., 0:2]), f16(b[..., 2:4])
    elif qtype == T.Q5_0:
        v, d = nibbles(b[..., 6:]) + 16 * bits(b[..., 2:6]) - 16, f16(b[..., 0:2])
    elif qtype == T.Q5_1:
        v, d, m = nibbles(b[..., 8:]) + 16 * bits(b[..., 4:8]), f16(b[..., 0:2]), f16(b[..., 2:4])
    elif qtype in (T.Q4_K, T.Q5_K):
        sc, mn = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        dd, dmin = f16(b[..., 0:2]), f16(b[..., 2:4])
        d = (dd[..., None] * sc.reshape(n, -1, 8).astype(np.float32)).reshape(n, -1)
        m = -(dmin[..., None] * mn.reshape(n, -1, 8).astype(np.float32)).reshape(n, -1)
        qs = b[..., 16:] if qtype == T.Q4_K else b[..., 48:]
        lo = (qs.reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
        v = lo.reshape(n, -1, 256).astype(np.int64)
        if qtype == T.Q5_K:
            qh = b[..., 16:48]
            hi = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
            v = v + 16 * hi.reshape(n, -1, 256).astype(np.int64)
    else:  # Q6_K
        ql, qh = b[..., :128], b[..., 128:192]
        lo = (ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
        hi = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        v = (lo.reshape(n, -1, 256) | (hi.reshape(n, -1, 256) << 4)).astype(np.int64) - 32
        dd = f16(b[..., 208:210])
        d16 = (dd[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(n, -1)
        return v.reshape(n, k), d16, None
    v = v.reshape(n, k)
    d = d.reshape(n, -1)
    per = k // d.shape[1]  # values per scale: 32
    return v, np.repeat(d, per // 16, axis=1), None if m is None else m.reshape(n, -1)


def act_quant(x: np.ndarray, qmax: int = 32767):
    """act_quant.h (int16; qmax 127: int8): per row and 32 values, dx = max|x| / qmax,
    xq = rint(x / dx), sx = float(sum xq) * dx."""
    rows, k = x.shape
    xb = x.reshape(rows, k // 32, 32)
    dx = (np.abs(xb).max(-1) / np.float32(qmax)).astype(np.float32)
    safe = np.where(dx == 0, np.float32(1), dx)
    xq = np.clip(np.rint(xb / safe[..., None]), -qmax, qmax).astype(np.int64)
    sx = (xq.sum(-1).astype(np.float32) * dx).astype(np.float32)
    return xq, dx, sx


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fma: the exact product and sum in float64, rounded once to float32."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def kernel_model(qtype: int, raw: np.ndarray, k: int, x: np.ndarray) -> np.ndarray:
    """The documented arithmetic (gguf_gemm.h): exact integer dots per 32-block (Q6_K: per
    16 values), then acc = fma(float(dot), dx * D, acc) [; fma(sx, M, acc)] in block order."""
    rows, n = x.shape[0], raw.shape[0]
    if qtype in (T.F16, T.BF16):  # panel_gemm.h: one fp32 FMA chain over k
        w = gguf.quants.dequantize(raw, qtype).reshape(n, k)
        acc = np.zeros((rows, n), np.float32)
        for kk in range(k):
            acc = fma32(x[:, kk:kk + 1], w[None, :, kk], acc)
        return acc
    v, d16, m = weight_model(qtype, raw, k)
    xq, dx, sx = act_quant(x)
    vb = v.reshape(n, k // 32, 2, 16)
    dots = np.einsum("rjhk,njhk->rnjh", xq.reshape(rows, k // 32, 2, 16), vb)  # exact int64
    acc = np.zeros((rows, n), np.float32)
    d16 = d16.reshape(n, k // 32, 2)
    for j in range(k // 32):
        halves = [0, 1] if qtype == T.Q6_K else [None]
        for h in halves:
            dot = dots[..., j, :].sum(-1) if h is None else dots[..., j, h]
            scale = (dx[:, j:j + 1] * d16[None, :, j, 0 if h is None else h]).astype(np.float32)
            acc = fma32(dot.astype(np.float32), scale, acc)
        if m is not None:
            acc = fma32(sx[:, j:j + 1], m[None, :, j], acc)
    return acc


def bits32(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_gguf_rows_bitwise(qtype: int) -> None:
    from roseinfer.kernels.gguf import gguf_rows

    k = 512 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 96
    raw = random_raw(qtype, 12, k, seed=int(qtype))
    want = gguf.quants.dequantize(raw, qtype).reshape(12, k)
    ids = torch.tensor([3, 0, 11, 3, 7])
    got = gguf_rows(torch.from_numpy(raw), int(qtype), ids)
    assert got.shape == (5, k) and got.dtype == torch.float32
    assert torch.equal(bits32(got), bits32(torch.from_numpy(want[ids.numpy()])))
    if qtype in QUANT:  # the model's weights are the dequantized values
        v, d16, m = weight_model(qtype, raw, k)
        w = (np.repeat(d16, 16, axis=1) * v.astype(np.float32)).astype(np.float32)
        if m is not None:
            w = (w + np.repeat(m, 32, axis=1)).astype(np.float32)
        assert np.array_equal(w.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_gguf_linear_is_its_arithmetic(qtype: int) -> None:
    """Bitwise the numpy model, the portable kernel, and each row alone, for steps from
    1 row to 4 (every quantized format: the few-row loops of gguf_rows.h) to 13 (whole
    panels decoded; with AVX-512 the 4- and 8-bit one-32-block formats' row loop in tiles
    of up to 8 rows, many_rows_zmm)."""
    from roseinfer.kernels.gguf import make_gguf_linear

    k = 512 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 96
    n = 72  # four full panels (a one-row step of F16 / BF16 takes four at once) and a partial one
    raw = random_raw(qtype, n, k, seed=100 + int(qtype))
    gen = torch.Generator().manual_seed(int(qtype))
    bias = torch.randn(n, generator=gen)
    lin = make_gguf_linear([(int(qtype), torch.from_numpy(raw))], bias)
    assert lin.in_features() == k and lin.out_features() == n
    x = torch.randn(13, k, generator=gen) * 3
    x[0, 32:64] = 0.0  # a zero block: dx = 0
    got = lin.forward(x)
    want = kernel_model(qtype, raw, k, x.numpy()) + bias.numpy()
    assert torch.equal(bits32(got), bits32(torch.from_numpy(want.astype(np.float32))))
    for rows in (1, 2, 5, 13):
        assert torch.equal(lin.forward_portable(x[:rows]), got[:rows])
    for rows in (2, 3, 4, 5, 6):  # one register tile (5 bits: up to 4 rows), then decoded blocks
        assert torch.equal(lin.forward(x[:rows]), got[:rows])
    for r in range(13):
        assert torch.equal(lin.forward(x[r:r + 1].clone()), got[r:r + 1])
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k))
    torch.testing.assert_close(got, x @ w.T + bias, rtol=1e-3, atol=1e-3 * float(w.abs().max()) * k ** 0.5)


def test_mixed_parts_batch_invariant() -> None:
    """Q4_K + Q6_K + Q8_0 parts stacked as output columns (a Q4_K_M file's fused q/k/v):
    each part's columns are its own kernel's, and every row of batches of 1..64 equals
    that row alone, on the AVX2 and the portable kernels."""
    from roseinfer.kernels.gguf import make_gguf_linear

    k = 256
    parts = [(T.Q4_K, 48), (T.Q6_K, 16), (T.Q8_0, 20)]
    raws = [random_raw(t, n, k, seed=7 + i) for i, (t, n) in enumerate(parts)]
    lin = make_gguf_linear([(int(t), torch.from_numpy(r)) for (t, _), r in zip(parts, raws, strict=True)], None)
    assert lin.out_features() == 84
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    full = lin.forward(x)
    alone = torch.cat([lin.forward(x[r:r + 1].clone()) for r in range(64)])
    assert torch.equal(full, alone)
    col = 0
    for (t, n), r in zip(parts, raws, strict=True):
        one = make_gguf_linear([(int(t), torch.from_numpy(r))], None)
        assert torch.equal(one.forward(x), full[:, col:col + n])
        col += n
    for m in (1, 2, 3, 4, 5, 6, 7, 16, 33, 64):
        got = lin.forward(x[:m])
        assert torch.equal(got, full[:m])
        assert torch.equal(lin.forward_portable(x[:m]), got)


def test_q4_1_parts_equal_the_int8_format_kernel() -> None:
    """Q4_1 parts (int16 activations: the GGUF panels; act8: the int8 format's Q4_1
    kernel, int8 activations) give what make_q4_linear gives on the same values, with and
    without the int8 copy."""
    from roseinfer.kernels import make_q4_linear
    from roseinfer.kernels.gguf import make_gguf_linear

    n, k = 40, 128
    raw = random_raw(T.Q4_1, n, k, seed=3)
    v, d16, m = weight_model(T.Q4_1, raw, k)
    q = torch.from_numpy(v.astype(np.int8))
    d, mins = torch.from_numpy(d16[:, ::2].copy()), torch.from_numpy(m)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    for act8 in (False, True):
        ref = make_q4_linear(q, d, mins, None, act8=act8).forward(x)
        for extra in (False, True):
            lin = make_gguf_linear([(int(T.Q4_1), torch.from_numpy(raw))], None, act8, extra)
            assert torch.equal(lin.forward(x), ref)
            assert torch.equal(lin.forward_portable(x), ref)


def act8_quant(x: np.ndarray):
    """act_quant.h's quantize_rows_act8: per row and 16 values dx = max|x| / 127, xq =
    rint(x / dx); per 32-block sx = fma(float(s1), dx1, float(s0) * dx0)."""
    rows, k = x.shape
    xb = x.reshape(rows, k // 16, 16)
    dx = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    safe = np.where(dx == 0, np.float32(1), dx)
    xq = np.clip(np.rint(xb / safe[..., None]), -127, 127).astype(np.int64)
    s = xq.sum(-1).astype(np.float32)
    s0 = (s[:, 0::2] * dx[:, 0::2]).astype(np.float32)
    sx = fma32(s[:, 1::2], dx[:, 1::2], s0)
    return xq.reshape(rows, k // 32, 32), dx, sx


def act8_model(raw: np.ndarray, k: int, x: np.ndarray) -> np.ndarray:
    """Q4_0 x int8 activations (q4_act8.h, offset 8): per 32-block the exact dots of its
    two 16-value halves of xq with q - 8, then t = float(dot0) * dx0, t = fma(float(dot1),
    dx1, t), acc = fma(t, d, acc) in block order."""
    v, d16, _ = weight_model(T.Q4_0, raw, k)
    xq, dx, _ = act8_quant(x)
    rows, n = x.shape[0], raw.shape[0]
    dots = np.einsum("rjhk,njhk->rnjh", xq.reshape(rows, k // 32, 2, 16), v.reshape(n, k // 32, 2, 16))
    assert np.abs(dots).max() < 2 ** 24  # exact in fp32
    acc = np.zeros((rows, n), np.float32)
    for j in range(k // 32):
        t = (dots[..., j, 0].astype(np.float32) * dx[:, 2 * j:2 * j + 1]).astype(np.float32)
        t = fma32(dots[..., j, 1].astype(np.float32), dx[:, 2 * j + 1:2 * j + 2], t)
        acc = fma32(t, d16[None, :, 2 * j], acc)
    return acc


@pytest.mark.parametrize("extra", [False, True], ids=["nibbles", "int8-copy"])
def test_q4_0_act8_is_its_arithmetic(extra: bool) -> None:
    """A Q4_0 part of an act8 layer: bitwise the numpy model of int8 activations, the
    portable kernel, and each row alone in batches of 1..64; beside a Q4_1 part (a
    gate/up of mixed types) each part keeps its own path; without act8 the int16 one."""
    from roseinfer.kernels.gguf import make_gguf_linear

    n, k = 40, 96
    raw = random_raw(T.Q4_0, n, k, seed=11)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(64, k, generator=gen) * 3
    x[0, 32:64] = 0.0  # a zero block: dx = 0
    x[1, :32] = 0.0
    x[1, 5] = -2.0  # a block of one value: xq = -127 and zeros
    lin = make_gguf_linear([(int(T.Q4_0), torch.from_numpy(raw))], bias, True, extra)
    got = lin.forward(x)
    want = act8_model(raw, k, x.numpy()) + bias.numpy()
    assert torch.equal(bits32(got), bits32(torch.from_numpy(want.astype(np.float32))))
    for m in (1, 2, 3, 4, 5, 6, 9, 16, 33):
        assert torch.equal(lin.forward(x[:m]), got[:m])
        assert torch.equal(lin.forward_portable(x[:m]), got[:m])
    alone = torch.cat([lin.forward(x[r:r + 1].clone()) for r in range(64)])
    assert torch.equal(alone, got)
    int16 = make_gguf_linear([(int(T.Q4_0), torch.from_numpy(raw))], bias)
    want16 = kernel_model(T.Q4_0, raw, k, x[:8].numpy()) + bias.numpy()
    assert torch.equal(bits32(int16.forward(x[:8])), bits32(torch.from_numpy(want16.astype(np.float32))))
    raw1 = random_raw(T.Q4_1, 24, k, seed=12)
    mixed = make_gguf_linear([(int(T.Q4_0), torch.from_numpy(raw)), (int(T.Q4_1), torch.from_numpy(raw1))],
                             None, True, extra)
    q4_1 = make_gguf_linear([(int(T.Q4_1), torch.from_numpy(raw1))], None, True, extra)
    q4_0 = make_gguf_linear([(int(T.Q4_0), torch.from_numpy(raw))], None, True, extra)
    both = mixed.forward(x)
    assert torch.equal(both[:, :n], q4_0.forward(x))
    assert torch.equal(both[:, n:], q4_1.forward(x))
    assert torch.equal(mixed.forward_portable(x[:7]), both[:7])


def test_bad_parts_are_value_errors() -> None:
    from roseinfer.kernels.gguf import gguf_kernel_types, gguf_rows, make_gguf_linear

    assert {int(t) for t in ALL} == set(gguf_kernel_types())
    q4k = torch.from_numpy(random_raw(T.Q4_K, 16, 256, seed=0))
    with pytest.raises(ValueError, match="144 bytes"):  # K = 200: not whole super-blocks
        make_gguf_linear([(int(T.Q4_K), torch.zeros(16, 200 // 256 * 144 + 100, dtype=torch.uint8))], None)
    with pytest.raises(ValueError, match="34 bytes"):
        make_gguf_linear([(int(T.Q8_0), torch.zeros(4, 35, dtype=torch.uint8))], None)
    with pytest.raises(ValueError, match="same in_features"):
        make_gguf_linear([(int(T.Q4_K), q4k), (int(T.Q8_0), torch.zeros(4, 34 * 4, dtype=torch.uint8))], None)
    with pytest.raises(ValueError, match="no CPU kernel"):
        make_gguf_linear([(int(T.Q2_K), torch.zeros(4, 84, dtype=torch.uint8))], None)
    with pytest.raises(ValueError, match="uint8"):
        make_gguf_linear([(int(T.Q4_K), q4k.float())], None)
    with pytest.raises(ValueError, match="bias"):
        make_gguf_linear([(int(T.Q4_K), q4k)], torch.zeros(3))
    with pytest.raises(ValueError, match="out of range"):
        gguf_rows(q4k, int(T.Q4_K), torch.tensor([16]))


def test_gguf_layers_run_in_the_llama_stack() -> None:
    """A model whose projections are GGUF kernels (fused Q4_K/Q6_K q/k/v, Q8_0 o, Q4_K
    gate/up, Q6_K down) runs them in the C++ LlamaStack, which needs no format knowledge:
    the same hidden states as its layer-by-layer path over the same kernels."""
    import transformers

    from roseinfer.kernels.gguf import make_gguf_linear
    from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata
    from roseinfer.model.config import ModelConfig
    from roseinfer.model.quantize import Fp16Linear, linear_paths, set_module
    from roseinfer.model.registry import create_model

    hf = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = create_model(ModelConfig.from_hf_dict(hf.to_dict()), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    layout = {"qkv_proj": [(T.Q4_K, 256), (T.Q4_K, 128), (T.Q6_K, 128)], "o_proj": [(T.Q8_0, 256)],
              "gate_up_proj": [(T.Q4_K, 256), (T.Q4_K, 256)], "down_proj": [(T.Q6_K, 256)]}
    for i, path in enumerate(p for p in linear_paths(model) if p != "lm_head"):
        parts = [(int(t), torch.from_numpy(random_raw(t, n, 256, seed=50 + 7 * i + j)))
                 for j, (t, n) in enumerate(layout[path.rsplit(".", 1)[-1]])]
        kernel = make_gguf_linear(parts, None)
        set_module(model, path, Fp16Linear.from_kernel(kernel, kernel.out_features(), 256, None))
    model._stack, model._stack_state = None, "unbuilt"
    cfg, bs = model.config, 4
    caches = [torch.zeros(2, 64 * bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    specs = [SeqSpec(0, 1, [7]), SeqSpec(0, 3, [3, 9])]
    meta = build_attention_metadata(specs, bs, torch.device("cpu"))
    ids = torch.tensor([4, 50, 96, 11])
    with torch.inference_mode():
        fast = model(ids, meta.positions, [c.clone() for c in caches], meta)
        assert model._stack is not None
        model._stack, model._stack_state = None, "disabled"
        slow = model(ids, meta.positions, caches, meta)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("qtype,act8,extra", [
    *[(q, False, False) for q in QUANT],
    (T.Q4_1, True, False), (T.Q4_1, True, True), (T.Q4_0, True, False), (T.Q4_0, True, True),
], ids=lambda v: getattr(v, "name", str(v)))
def test_steps_of_many_rows_equal_the_portable_kernel(qtype: int, act8: bool, extra: bool) -> None:
    """Steps of 16 rows and more (on a CPU with AMX: whole 16-row tiles of each chunk as
    tile products, the other rows on the vector loops): bitwise the portable kernel and
    each row alone, over two chunks of rows (K = 8192) and a tail; K = 1536 (GGUF panels
    on the tiles from 16 rows, csrc/amx.h)."""
    from roseinfer.kernels.gguf import make_gguf_linear

    for k in (1536, 8192):
        n, rows = 24, 83
        raw = random_raw(qtype, n, k, seed=17)
        gen = torch.Generator().manual_seed(9)
        bias = torch.randn(n, generator=gen)
        x = torch.randn(rows, k, generator=gen) * 3
        x[0, :32] = 0.0  # a zero block: dx = 0
        x[5, 64:96] = 0.0
        x[5, 70] = -4.0  # a block of one value
        lin = make_gguf_linear([(int(qtype), torch.from_numpy(raw))], bias, act8, extra)
        got = lin.forward(x)
        assert torch.equal(lin.forward_portable(x), got)
        for m in (16, 17, 31, 32, 48, 64, 80):
            assert torch.equal(lin.forward(x[:m]), got[:m])
            assert torch.equal(lin.forward(x[rows - m:]), got[rows - m:])
        alone = torch.cat([lin.forward(x[r:r + 1].clone()) for r in range(rows)])
        assert torch.equal(alone, got)


@pytest.mark.parametrize("qtype,act8", [(T.Q4_1, False), (T.Q4_1, True), (T.Q8_0, False),
                                        (T.Q4_K, False), (T.F16, False), (None, False)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_panels_shared_as_threads_finish_give_the_same_bits(qtype: int | None,
                                                           act8: bool) -> None:
    """Steps of 5+ rows share a GEMM's panels in chunks the threads take as they finish
    (csrc/parallel_chunks.h): whatever the thread count and whichever thread took a
    chunk, every value is the one-thread kernel's (None: the int8 format's kernel)."""
    from roseinfer.kernels import make_int8_linear, quantize_int8_blocks
    from roseinfer.kernels.gguf import make_gguf_linear

    n, k = 1000, 512  # 63 panels, the last of 8 columns
    gen = torch.Generator().manual_seed(31)
    if qtype is None:
        lin = make_int8_linear(*quantize_int8_blocks(torch.randn(n, k, generator=gen)), None)
    else:
        raw = random_raw(qtype, n, k, seed=29)
        lin = make_gguf_linear([(int(qtype), torch.from_numpy(raw))], None, act8)
    x = torch.randn(37, k, generator=gen) * 2
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = lin.forward(x)
        for threads in (2, 3, 4):
            torch.set_num_threads(threads)
            for m in (5, 16, 37):
                for _ in range(3):  # chunks fall to the threads differently each time
                    assert torch.equal(lin.forward(x[:m]), want[:m]), (threads, m)
    finally:
        torch.set_num_threads(before)
    if qtype is not None:
        assert torch.equal(lin.forward_portable(x), want)


def _proc_kb(path: str, key: str) -> int:
    """The kB figure of ``key`` in a /proc file of this process (0 if absent)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _anon_huge_kb() -> int:
    return _proc_kb("/proc/self/smaps_rollup", "AnonHugePages")


def _thp_advisable() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


@pytest.mark.parametrize("qtype,act8", [(T.Q4_0, True), (T.Q4_K, False), (T.Q8_0, False),
                                        (T.F16, False)], ids=lambda v: getattr(v, "name", str(v)))
def test_large_packed_weights_are_their_arithmetic(qtype: int, act8: bool) -> None:
    """Packed weights of 2 MiB and more take a chunk of their own (csrc/weight_memory.h,
    huge pages where the OS offers them): the same arithmetic as small ones."""
    from roseinfer.kernels.gguf import make_gguf_linear

    n, k = 1024, 4096
    raw = random_raw(qtype, n, k, seed=23)
    x = (torch.randn(2, k, generator=torch.Generator().manual_seed(4)) * 2).numpy()
    lin = make_gguf_linear([(int(qtype), torch.from_numpy(raw))], None, act8)
    got = lin.forward(torch.from_numpy(x))
    if act8:  # int8 activations: the portable kernel is their documented arithmetic
        assert torch.equal(got, lin.forward_portable(torch.from_numpy(x)))
    else:
        assert np.array_equal(got.numpy(), kernel_model(qtype, raw, k, x))


@pytest.mark.skipif(not _thp_advisable(), reason="transparent huge pages off")
def test_large_packed_weights_sit_on_huge_pages() -> None:
    """A decode step streams its weights from DRAM: on 2 MiB pages (MADV_HUGEPAGE) it
    reads them ~20% faster than on 4 KiB ones (docs/performance.md)."""
    from roseinfer.kernels.gguf import make_gguf_linear

    before = _anon_huge_kb()
    layers = [make_gguf_linear([(int(T.Q8_0), torch.from_numpy(random_raw(T.Q8_0, 2048, 4096, s)))],
                               None) for s in range(3)]  # 8.5 MiB packed each
    assert _anon_huge_kb() - before >= 2048, "no packed weight on a huge page"
    del layers


def _rss_anon_kb() -> int:
    return _proc_kb("/proc/self/status", "RssAnon")


@pytest.mark.skipif(not _thp_advisable(), reason="transparent huge pages off")
def test_small_packed_weights_share_huge_pages_and_are_freed() -> None:
    """Packed weights under 2 MiB (all of the default model's) are placed one after
    another in huge-page chunks (csrc/weight_memory.h): on huge pages, each with its own
    arithmetic, taking about their bytes, and given back when freed."""
    from roseinfer.kernels.gguf import make_gguf_linear

    raws = [random_raw(T.Q8_0, 576, 576, s) for s in range(120)]  # ~0.35 MiB packed each
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5))
    huge0, rss0 = _anon_huge_kb(), _rss_anon_kb()
    layers = [make_gguf_linear([(int(T.Q8_0), torch.from_numpy(r))], None) for r in raws]
    packed_kb = sum(r.nbytes for r in raws) // 1024
    assert _anon_huge_kb() - huge0 >= packed_kb // 2, "small packed weights not on huge pages"
    assert _rss_anon_kb() - rss0 < packed_kb * 1.25 + 8192, "small packed weights took extra memory"
    for i in (0, 57, 119):  # neighbours in a chunk do not overlap
        assert np.array_equal(layers[i].forward(x).numpy(), kernel_model(T.Q8_0, raws[i], 576, x.numpy()))
    grown = _rss_anon_kb()
    del layers
    assert grown - _rss_anon_kb() >= packed_kb * 0.9, "freed packed weights kept their memory"
