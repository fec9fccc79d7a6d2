// Batch-invariant GEMM over packed weight panels: y[M, N] = x[M, K] W^T + b, for
//   * int8 weights (the "int8" format): q int8 with one fp32 scale s per 32 weights of a
//     row (Q8_0), panels [N/32][K][32] + scales [N/32][K/32][32], read by decode steps of
//     <= small_rows rows (1.06 bytes per weight), plus the same q as fp16 in 16-column
//     panels [N/16][K][16] for larger M (one F16C convert per 8 weights; 3 bytes per weight in all);
//     per output element and 32-block j: t = one fp32 FMA chain of x[m, k] * q[n, k] over
//     the block's k in order (from 0), then acc = fma(t, s[n, j], acc), y = acc + b;
//   * fp16 weights (the "fp16" format): panels [N/16][K][16]; per output element one fp32
//     FMA chain over k = 0..K-1 (from 0), y = acc + b.
// Those sequences are the same for every M, row position, tile shape and thread count
// (docs/CONTRACTS.md, batch invariance): tiles only share the widened weights between
// rows (4-6 rows x 16 columns; one row x 32 columns for decode).
#pragma once

#include "common.h"

namespace roseinfer {

struct PanelGemm {
  int64_t N = 0, K = 0, Np = 0;  // Np: N rounded up to a multiple of 32
  at::Tensor q8;                 // int8 [Np/32, K, 32] (undefined: fp16 format)
  at::Tensor q16;                // the same q as fp16 [Np/16, K, 16]
  at::Tensor s8;                 // fp32 [Np/32, K/32, 32]
  int64_t small_rows = 1;        // M <= small_rows reads q8, larger M q16 (same values)
  at::Tensor f16;                // fp16 [Np/16, K, 16] (undefined: int8 format)

  // q int8 [N, K], scales fp32 [N, K/32]; K % 32 == 0.
  PanelGemm(const at::Tensor& q, const at::Tensor& scales);
  // w [N, K] (any float dtype; rounded to fp16).
  explicit PanelGemm(const at::Tensor& w);
  // x [M, K] row-major fp32, y [M, N] row-major fp32, bias [N] or null.
  void run(const float* x, int64_t M, const float* bias, float* y) const;
};

}  // namespace roseinfer
