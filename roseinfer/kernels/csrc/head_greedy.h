// Greedy tokens from a GGUF Q8_0 LM head (the default model's tied embedding) without
// computing every logit exactly.  The result is bitwise that of row_argmax over the
// head's own logits (GgufPanels::run: int16 activations, one arithmetic for every M):
// the same ids and values, ties to the first id, a non-finite row's first NaN.
//
// Steps of 5 rows and more (fewer: every logit exactly, then the argmax), per row:
// (1) every logit approximately, with int8 activations per 32 values (vpdpbusd: half
// the int16 loop's dot instructions), kept as each panel's maximum; (2) per 16-column
// panel p a bound B_p on |exact - approximate| over its columns:
//   exact - approx = sum_k w_k (x16_k - x8_k),  |.| <= sum_j delta_j * reach[p, j]
// with delta_j the largest |x16 - x8| of 32-block j of the row (both roundings known) and
// reach[p, j] the largest d * sum|q| of block j over the panel's columns, plus a margin
// for both kernels' float rounding; (3) the panel with the largest approximate logit
// computed exactly, its largest value E; (4) exactly, every panel whose approximate
// maximum + B_p reaches E: no other can hold a logit >= E, so the exact argmax (and its
// first tie) is among them.  On the default model's chat answers 1-16 panels of 3,072 a
// row (docs/performance.md, "Zen 4: greedy tokens from int8 logits").
#pragma once

#include <memory>
#include <tuple>
#include <vector>

#include "gguf_gemm.h"

#if defined(ROSEINFER_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define ROSEINFER_GREEDY_HEAD 1
#endif

namespace roseinfer {

struct GreedyHead {
  std::shared_ptr<GgufPanels> panels;  // Q8_0
  std::vector<float> reach;            // [NP, K/32], rounded up
  std::vector<float> reach_max;        // [K/32]: over every panel

  explicit GreedyHead(std::shared_ptr<GgufPanels> p);
  // Whether this build has the int8 pass (AVX-512 VNNI and VBMI); without it, none.
  static bool available();
  // x [M, K] fp32 -> (values [M] fp32, ids [M] int64).
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& x) const;
};

}  // namespace roseinfer
