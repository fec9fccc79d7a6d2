// Batch-invariant GEMM over fp16 weight panels (the "fp16" format): y[M, N] =
// x[M, K] W^T + b with panels [N/16][K][16]; per output element one fp32 FMA chain over
// k = 0..K-1 (from 0), y = acc + b.  That sequence is the same for every M, row
// position, tile shape and thread count (docs/CONTRACTS.md, batch invariance): tiles
// only share the widened weights between rows (up to 6 rows x 16 columns; one or two
// rows take 4 / 2 panels at once for more independent chains).
// A bf16 weight (a GGUF's BF16 tensor) keeps bf16 panels, widened exactly to fp32.
// (The int8 format has its own kernel: q8_gemm.h.)
#pragma once

#include "common.h"

namespace roseinfer {

struct PanelGemm {
  int64_t N = 0, K = 0, Np = 0;  // Np: N rounded up to a multiple of 16
  at::Tensor f16;                // fp16 (bf16 when bf16) [Np/16, K, 16]
  bool bf16 = false;

  // w [N, K] (bf16: kept as bf16; any other float dtype: rounded to fp16).
  explicit PanelGemm(const at::Tensor& w);
  // x [M, K] row-major fp32, y [M, N] row-major fp32, bias [N] or null; portable: the
  // plain C++ chains (the same results).
  void run(const float* x, int64_t M, const float* bias, float* y, bool portable = false) const;
};

}  // namespace roseinfer
