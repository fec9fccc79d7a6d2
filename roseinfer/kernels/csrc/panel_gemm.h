// Batch-invariant GEMM over packed weight panels: y[M, N] = x[M, K] W^T + b, for
//   * int8 weights W = fp16(q * s) (one fp32 scale s per 32 weights of a row; the product
//     rounded to fp16, which costs nothing next to the int8 step): the "int8" format;
//   * fp16 weights (fp16 panels only): the "fp16" format.
//
// Each output element is ONE sequential fp32 FMA chain over k = 0..K-1,
// acc = fma(x[m, k], w[n, k], acc) from acc = 0, then + b[n]: the same sequence of
// operations for every M, row position, tile shape and thread count (docs/CONTRACTS.md,
// batch invariance).  Two copies of the same values serve two speeds:
//   * int8 panels [N/32][K][32] + scales [N/32][K/32][32] for small M (<= small_rows, int8
//     format only):
//     half the bytes of fp16 per decode step (memory-bound);
//   * fp16 panels [N/16][K][16] for larger M: one F16C convert per 8 weights, reused by
//     6 rows of x (compute-bound; the register tile of fbgemm's fp16 GEMM).
// Both decode to the same fp32 weights, so switching between them by M changes nothing.
#pragma once

#include "common.h"

namespace roseinfer {

struct PanelGemm {
  int64_t N = 0, K = 0, Np = 0;  // Np: N rounded up to a multiple of 32
  at::Tensor q8;                 // int8 [Np/32, K, 32] (undefined: fp16 format)
  at::Tensor s8;                 // fp32 [Np/32, K/32, 32]
  at::Tensor f16;                // fp16 [Np/16, K, 16]
  int64_t small_rows = 4;        // M <= small_rows reads the int8 panels (0: never)

  // q int8 [N, K], scales fp32 [N, K/32]; K % 32 == 0.
  PanelGemm(const at::Tensor& q, const at::Tensor& scales);
  // w [N, K] (any float dtype; rounded to fp16): fp16 panels only.
  explicit PanelGemm(const at::Tensor& w);
  // x [M, K] row-major fp32, y [M, N] row-major fp32, bias [N] or null.
  void run(const float* x, int64_t M, const float* bias, float* y) const;
};

}  // namespace roseinfer
