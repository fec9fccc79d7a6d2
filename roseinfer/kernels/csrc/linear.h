// Linear layer kernel: y[M,N] = x[M,K] W^T + b.
//   fp16: weights packed for fbgemm's fp16 GEMM (fp32 math), the output columns split
//         over the intra-op threads (torch's own op runs on one).
//   fp32: the weight tensor as given; M <= 4 rows through an AVX2/FMA GEMV threaded over
//         the output rows (fp32 accumulation), larger M through at::mm (MKL).
//   bf16 copy (optional, set_bf16_weight): inputs of >= bf16_min_rows rows run as a bf16
//         GEMM with fp32 accumulation (oneDNN; AVX512-BF16 / AMX do twice the fp32 rate).
//   int8 copy (optional, set_int8_weight): inputs of <= int8_max_rows rows run an AVX2
//         GEMV over int8 weights with one fp32 scale per 32 weights of a row (Q8_0-like),
//         fp32 activations and accumulation: half the bytes of fp16 per decode step.
#pragma once

#include <fbgemm/FbgemmFP16.h>
#include <torch/custom_class.h>

#include <memory>
#include <optional>

#include "common.h"

namespace roseinfer {

struct Linear : torch::CustomClassHolder {
  std::unique_ptr<fbgemm::PackedGemmMatrixFP16> packed;
  at::Tensor weight;  // fp32 [N, K] when not packed
  at::Tensor bias;    // undefined or fp32 [N]
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool use_gemv = true;  // fp32, M <= 4: the AVX2 GEMV instead of MKL (A/B switch)
  at::Tensor weight_bf16;     // optional bf16 [N, K] for large inputs
  int64_t bf16_min_rows = 0;  // 0 = never
  at::Tensor qweight;         // optional int8 [N, K] for small inputs
  at::Tensor qscales;         // fp32 [N, K / 32]
  int64_t int8_max_rows = 0;  // 0 = never

  Linear(at::Tensor w, std::optional<at::Tensor> b, bool fp16);
  void set_bf16_weight(at::Tensor w, int64_t min_rows);
  void set_int8_weight(at::Tensor q, at::Tensor scales, int64_t max_rows);
  void run(const at::Tensor& x, at::Tensor& y) const;  // x [M,K] contiguous, y [M,N]
  at::Tensor forward(at::Tensor x);
};

}  // namespace roseinfer
