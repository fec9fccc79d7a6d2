// Q4_1 weights against 8-bit activations (act8 layers: ``quantize.ACT8_LAYERS``; also a
// GGUF's Q4_0 parts there): y[M, N] = x[M, K] W^T + b with activations quantized per row
// and 16 values to int8, dx = max|x| / 127, xq = rint(x / dx) clamped to [-127, 127]
// (dx = 0: zeros; act_quant.h, quantize_rows_act8), and per output element and 32-block j
// (weight scale d, minimum m):
//   t = float(dot0) * dx0;  t = fma(float(dot1), dx1, t);  acc = fma(t, d[n, j], acc);
//   acc = fma(sx[m, j], m[n, j], acc)                 (Q4_1)
// with dot0 / dot1 the exact int32 dots of the block's two 16-value halves of xq[m] and q
// (q in [0, 15]; Q4_0: q - 8), dx0 / dx1 their scales and sx = fma(float(s1), dx1,
// float(s0) * dx0) (s0 / s1 the halves' exact xq sums).  One scale per 16 activations,
// not 32: with 32 the default model lost its everyday chat answers (docs/performance.md,
// "8-bit activations in 16-value blocks").  Integer sums are exact, so a row's result
// never depends on M, its position, the tiling or the ISA path.
// AVX2: vpmaddubsw multiplies 32 unsigned weights by 32 signed activations and adds
// pairs into int16 (|pair| <= 2 * 15 * 127); a half's 4 steps add up in int16 (<= 15240,
// exact) before one vpmaddwd widens them; VNNI / AVX-512: vpdpbusd into int32.  Half the
// instructions per multiply-add of the int16 kernels.  Steps of up to 4 rows read
// nibbles (0.625 bytes a weight), larger ones whole bytes (no unpacking); the integers
// are the same.  (Sapphire Rapids' AMX tiles computed the 32-value blocks of the
// previous form; they are not run for this one until reworked on such a machine.)
#pragma once

#include "q8_gemm.h"

namespace roseinfer {

// Packed weights, per panel p (16 columns) and 32-block j:
// bytes: at (p * K/32 + j) * 640: 8 steps of 64 bytes (step s: columns 0-7 then 8-15,
//   per column c its four weights q[16p+c, 32j+4s .. 32j+4s+3]), then the 16 fp32 d and
//   the 16 fp32 m;
// nibbles: at (p * K/32 + j) * 320: 8 steps of 32 bytes (byte b: low nibble = byte b of
//   the bytes layout's step, high nibble = its byte 32 + b), then d and m as fp16.
// q int8 [N, K] in [0, 15]; d, m fp32 [N, K/32] (exact fp16 values).  mins false (Q4_0):
// no m, each block 64 (bytes) / 32 (nibbles) bytes shorter.
at::Tensor pack_q4_act8(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                        bool nibbles, bool mins = true);

// x [M, K] fp32 -> y [M, N] fp32 (+ bias [N] or null) from the two packings above.
// portable: the scalar kernel (the same results on any machine); bytes null: nibbles
// for every step; offset: 0 (Q4_1: d and m) or 8 (Q4_0: v = q - 8, packed without m).
void gemm_q4_act8(const uint8_t* bytes, const uint8_t* nibbles, int64_t N, int64_t K,
                  const float* x, int64_t M, const float* bias, float* y, bool portable,
                  int offset = 0);

}  // namespace roseinfer
