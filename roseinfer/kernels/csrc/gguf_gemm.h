// GGUF weights used as stored (the quantized formats of gguf_formats.h): y[M, N] =
// x[M, K] W^T + b with activations quantized per row and 32-block to int16 exactly as
// the int8 format (act_quant.h: dx = max|x| / 32767, xq = rint(x / dx), sx =
// float(sum xq) * dx), and per output element, in block order j = 0 .. K/32-1:
//   acc = fma(float(dot_j), dx[m, j] * D0[n, j], acc)            (every format but Q6_K)
//   acc = fma(float(dot_j0), dx[m, j] * D0[n, j], acc);          (Q6_K: per 16 values)
//   acc = fma(float(dot_j1), dx[m, j] * D1[n, j], acc)
//   acc = fma(sx[m, j], M[n, j], acc)                            (Q5_1, Q4_K, Q5_K)
//   y[m, n] = acc + b[n]
// dot: the exact int32 dot of the block's (half-block's) xq with the integers v of the
// weight (v = q - offset: |dot| <= 32 * 32767 * 128 < 2^31), D / M the block's fp32
// scale / minimum term (gguf_formats.h: d, d * sc, m or -(dmin * mn), all exact).
// Integer sums are exact and the fp32 steps run in one order for every row, so a row's
// result never depends on M, its position, the tiling, the threads or the ISA path
// (docs/CONTRACTS.md, batch invariance).  Q4_1 and Q4_0 parts of act8 layers take the
// int8 format's kernel (q8_gemm.h / q4_act8.h: int8 activations), F16 / BF16 the
// fp32-math panel GEMM (panel_gemm.h).
// Execution: output panels of 16 columns split over the threads, rows in chunks whose
// activations stay in L2; per panel, groups of 32-blocks (8 when decoded to int16, else
// 32) are decoded (gguf_decode.h: the scales D / M as fp32; 5- and 6-bit values, when
// the chunk has more than one row tile, into int16 in the GEMM's order, in L1; else the
// values are read from the panel itself), then every row tile of up to 5 rows (5 bits in registers: 4) runs one
// inline-asm loop over them (gguf_tiles.h: two steps per iteration, 4- and 5-bit values
// widened and split in registers; Q6_K's unsigned q widened from its 16-bit words per
// 16-value half; an offset read as unsigned q starts the integer sums at -offset * the
// activations' exact sum, precomputed per row and 16 values: the exact dot with
// q - offset); the first tile prefetches the next group's bytes.  With AVX-512 and no
// AMX tiles, Q8_0 / Q4_0 / Q4_1 steps of any size skip the decode: the few-row loop runs
// tiles of up to 8 rows straight from each panel (gguf_rows.h, many_rows_zmm).  Which
// loop reads a block changes only where its integers come from, never their values or
// the fp32 operations, so a row's result never depends on M.
#pragma once

#include <memory>
#include <vector>

#include "gguf_formats.h"
#include "panel_gemm.h"
#include "q8_gemm.h"

namespace roseinfer {

// One quantized format's packed panels (gguf_formats.h) over N rows given as pointers
// to their stored bytes (K values each).
struct GgufPanels {
  int64_t type = 0, N = 0, K = 0;
  at::Tensor packed;  // uint8
  const uint8_t* bytes = nullptr;  // packed's data, taken once (the panel loops read it per call)

  GgufPanels(int64_t type, const std::vector<const uint8_t*>& rows, int64_t K);
  // xq / dx / sx: the quantized activations (act_quant.h); y rows of stride ldy, bias
  // of this part's columns or null.
  void run(const int16_t* xq, const float* dx, const float* sx, int64_t M, const float* bias,
           float* y, int64_t ldy, bool portable) const;
};

// A layer's weights: parts of possibly different types whose rows are stacked as output
// columns (fused q/k/v, gate/up), each run by its format's kernel.
struct GgufGemm {
  struct Segment {
    int64_t type = 0, n0 = 0, n = 0;
    std::shared_ptr<GgufPanels> quant;  // Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
    std::shared_ptr<Q8Gemm> q4_1;       // Q4_1 / Q4_0 of an act8 layer (q4_act8.h)
    std::shared_ptr<PanelGemm> panels;  // F16, BF16
  };
  std::vector<Segment> segments;
  int64_t N = 0, K = 0;

  // raws[i]: uint8 [rows_i, row_bytes] as stored, of type types[i]; act8: Q4_1 and
  // Q4_0 parts take int8 activations (q4_act8.h); extra_copy: those parts keep an int8
  // copy for steps of more than 4 rows.
  GgufGemm(const std::vector<int64_t>& types, const std::vector<at::Tensor>& raws, bool act8,
           bool extra_copy);
  void run(const float* x, int64_t M, const float* bias, float* y, bool portable) const;
};

// Rows ids of a stored [V, row_bytes] tensor of the given type, dequantized as the gguf
// package does: fp32 [T, K].
at::Tensor gguf_rows(const at::Tensor& raw, int64_t type, const at::Tensor& ids);

// (values per row) of a [rows, row_bytes] tensor of this type; raises for a bad size.
int64_t gguf_row_values(int64_t type, int64_t row_bytes);

}  // namespace roseinfer
