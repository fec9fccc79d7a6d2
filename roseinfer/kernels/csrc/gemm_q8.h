// Batch-invariant GEMM over int8 weights: y[M, N] = x[M, K] W^T + b, W = q * s with int8
// q and one scale s per 32 weights of a row, every s having a 4-bit significand so that
// every q * s is exact in fp16 (and in fp32).
//
// Each output element is ONE sequential fp32 FMA chain over k = 0..K-1,
// acc = fma(x[m, k], w[n, k], acc) from acc = 0, then + b[n]: the same sequence of
// operations for every M, row position, tile shape and thread count (docs/CONTRACTS.md,
// batch invariance).  Two copies of the same values serve two speeds:
//   * int8 panels [N/32][K][32] + scales [N/32][K/32][32] for small M (<= small_rows):
//     half the bytes of fp16 per decode step (memory-bound);
//   * fp16 panels [N/16][K][16] for larger M: one F16C convert per 8 weights, reused by
//     6 rows of x (compute-bound; the register tile of fbgemm's fp16 GEMM).
// Both decode to the same fp32 weights, so switching between them by M changes nothing.
#pragma once

#include "common.h"

namespace roseinfer {

struct Q8Gemm {
  int64_t N = 0, K = 0, Np = 0;  // Np: N rounded up to a multiple of 32
  at::Tensor q8;                 // int8 [Np/32, K, 32]
  at::Tensor s8;                 // fp32 [Np/32, K/32, 32]
  at::Tensor f16;                // fp16 [Np/16, K, 16]
  int64_t small_rows = 4;        // M <= small_rows reads the int8 panels

  // q int8 [N, K], scales fp32 [N, K/32] (4-bit significands, see quantize.py); K % 32 == 0.
  Q8Gemm(const at::Tensor& q, const at::Tensor& scales);
  // x [M, K] row-major fp32, y [M, N] row-major fp32, bias [N] or null.
  void run(const float* x, int64_t M, const float* bias, float* y) const;
};

}  // namespace roseinfer
