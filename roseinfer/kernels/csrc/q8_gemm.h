// Batch-invariant int8-weight GEMM ("int8" format): y[M, N] = x[M, K] W^T + b with
// int8 weights q (|q| <= 127, one fp32 scale dw per 32 weights of a row, Q8_0) and
// activations quantized per row and 32-block to int16: dx = max|x| / 32767,
// xq = rint(x / dx) clamped to [-32767, 32767] (dx = 0: zeros).  Per output element:
//   acc = 0;  for j = 0 .. K/32-1:  acc = fma(float(dot_j), dx[m, j] * dw[n, j], acc)
//   y[m, n] = acc + b[n]
// with dot_j the exact int32 dot product of the j-th 32-blocks of xq[m] and q[n]
// (|dot_j| <= 32 * 32767 * 127 < 2^31).  Integer sums are exact, so their order is free:
// the result depends only on (x[m, :], q[n, :], dw[n, :]), never on M, the row's
// position, the tiling, the threads or the ISA path (docs/CONTRACTS.md, batch
// invariance).  int16 activations keep the quality of fp32 ones (relative step 3e-5);
// int8 ones cost top-1 agreement, so only some layers take them (q4_act8.h,
// model/quantize.py act8_layer).
// Weights are packed once into 16-column panels, split over the intra-op threads; row
// tiles of up to 5 rows share each widened weight load.
// Q4_1 weights (the GGUF's own, exact): q in [0, 15] with a scale d and a minimum m per
// 32 weights (fp16 values), w = d * q + m.  Then per output element and block:
//   acc = fma(float(dot_j), dx[m, j] * d[n, j], acc);
//   acc = fma(sx[m, j], m[n, j], acc)
// with sx = float(exact sum of the block's quantized activations) * dx[m, j], computed
// once per row and block when the activations are quantized.  The weights are stored as
// nibbles (0.625 bytes per weight) and widened in registers for steps of up to 4 rows
// (memory-bound), and as int8 for larger ones (no unpacking); the integers are the same.
#pragma once

#include "common.h"

namespace roseinfer {

constexpr int64_t kQ8Block = 32;  // weights (activations) per scale
constexpr int64_t kQ8Panel = 16;  // output columns per packed panel

// Packed weights: per panel p (16 columns) and 32-block j, at byte (p * K/32 + j) * 576:
// 16 steps of 32 bytes (step s: for columns c = 0..15 the two weights q[16p+c, 32j+2s]
// and q[16p+c, 32j+2s+1]), then the 16 fp32 scales dw[16p+c, j].  Padding columns zero.
// Q4_1 layout, at byte (p * K/32 + j) * 320: 16 steps of 16 bytes (byte b: low nibble =
// byte b of the int8 layout's step, high nibble = its byte 16 + b), then the 16 scales d
// and the 16 minimums m as fp16.
// With Q4_1 weights, `packed` holds the int8 layout plus the 16 minimums (fp32) after
// the scales of each block, for steps of more than 4 rows; `packed4` the nibbles.
struct Q8Gemm {
  at::Tensor packed;   // uint8
  at::Tensor packed4;  // uint8, Q4_1 nibbles (q4 only)
  int64_t N = 0, K = 0;
  bool q4 = false;    // Q4_1 weights
  bool act8 = false;  // Q4_1 against int8 activations (q4_act8.h: its own packings)
  int offset = 0;     // act8 only: 8 for Q4_0 weights (v = q - 8, no mins packed)

  // q int8 [N, K] (K % 32 == 0, no -128), scales fp32 [N, K/32]; with mins (fp32
  // [N, K/32]): Q4_1, q in [0, 15], scales and mins exact in fp16; act8 (Q4_1 only):
  // activations quantized to int8 instead of int16.
  // int8_copy (Q4_1): also keep the int8 copy for steps of more than 4 rows; without
  // it every step reads the nibbles (the same integers).  offset (act8 only): 8 for
  // Q4_0 weights q in [0, 15] meaning q - 8 (mins then zeros, unused; q4_act8.h).
  Q8Gemm(const at::Tensor& q, const at::Tensor& scales,
         const c10::optional<at::Tensor>& mins = c10::nullopt, bool act8 = false,
         bool int8_copy = true, int offset = 0);
  // x [M, K] row-major fp32, y [M, N] row-major fp32, bias [N] or null.
  void run(const float* x, int64_t M, const float* bias, float* y) const;
  // The portable kernel (same results; for tests on any machine).
  void run_reference(const float* x, int64_t M, const float* bias, float* y) const;
};

// The activation quantization run() applies (for tests): xq [M, K], dx [M, K/32].
void q8_quantize_act(const float* x, int64_t M, int64_t K, int16_t* xq, float* dx);

}  // namespace roseinfer
