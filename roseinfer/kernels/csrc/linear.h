// Linear layer kernel: y[M,N] = x[M,K] W^T + b.
//   fp16: fp16 weight panels (PanelGemm, fp32 math), the output columns split over the
//         intra-op threads; one arithmetic for every M (batch-invariant; fbgemm's fp16
//         GEMM is not: its one-row kernel sums in another order).
//   fp32: the weight tensor as given, every M through one AVX2/FMA kernel threaded over
//         the output columns (one arithmetic per element: batch-invariant); at::mm (MKL)
//         only without AVX2, for K % 8 != 0, or with ROSEINFER_FP32_GEMV=0.
//   bf16 copy (optional, set_bf16_weight): inputs of >= bf16_min_rows rows run as a bf16
//         GEMM with fp32 accumulation (oneDNN; AVX512-BF16 / AMX do twice the fp32 rate).
//   int8 (set_int8_weight): int8 weights with one fp32 scale per 32 weights of a row
//         (Q8_0), activations quantized per row and 32-block to int16, exact int32 block
//         dots, for EVERY input size through Q8Gemm (q8_gemm.h: one arithmetic per output
//         element whatever M, batch invariance); the fp32 / fp16 / bf16 copies are dropped.
//   Q4_1 (set_q4_weight): a GGUF's Q4_1 weights as they are (w = d * q + m per 32), the
//         same kernel on nibbles (q8_gemm.h).
//   GGUF (set_gguf_weight): a GGUF file's stored tensors as they are, parts of any
//         supported type stacked as output columns (gguf_gemm.h), every input size.
#pragma once

#include <torch/custom_class.h>

#include <memory>
#include <mutex>
#include <optional>
#include <tuple>

#include "common.h"
#include "gguf_gemm.h"
#include "head_greedy.h"
#include "panel_gemm.h"
#include "q8_gemm.h"

namespace roseinfer {

struct Linear : torch::CustomClassHolder {
  at::Tensor weight;  // fp32 [N, K] (fp32 format only)
  at::Tensor bias;    // undefined or fp32 [N]
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool use_gemv = true;  // fp32: the AVX2 kernel instead of MKL (A/B switch)
  at::Tensor weight_bf16;     // optional bf16 [N, K] for large inputs
  int64_t bf16_min_rows = 0;  // 0 = never
  std::shared_ptr<PanelGemm> panels;  // fp16 weights: every input (but bf16's) runs it
  std::shared_ptr<Q8Gemm> q8;         // int8 weights: every input runs it
  std::shared_ptr<GgufGemm> gguf;     // GGUF weights as stored: every input runs it
  mutable std::shared_ptr<GreedyHead> greedy_head;  // built on the first greedy()
  mutable std::once_flag greedy_once;

  Linear(at::Tensor w, std::optional<at::Tensor> b, bool fp16);
  void set_bf16_weight(at::Tensor w, int64_t min_rows);
  void set_int8_weight(at::Tensor q, at::Tensor scales);
  // Q4_1, exact; act8: against int8 activations (q4_act8.h)
  void set_q4_weight(at::Tensor q, at::Tensor scales, at::Tensor mins, bool act8);
  // raws[i]: uint8 [rows_i, row_bytes_i] of GGML type types[i] (read, never written);
  // sets in_features (values per row) and out_features (all rows).
  void set_gguf_weight(std::vector<int64_t> types, std::vector<at::Tensor> raws, bool act8,
                       bool extra_copy);
  void run(const at::Tensor& x, at::Tensor& y) const;  // x [M,K] contiguous, y [M,N]
  at::Tensor forward(at::Tensor x);
  at::Tensor forward_portable(at::Tensor x);  // int8 / GGUF / fp32: the portable kernel (tests)
  // An LM head of one GGUF Q8_0 part without bias, in a build with GreedyHead's int8
  // pass: greedy() gives (values, ids) of each row's argmax of forward(x), bitwise
  // (head_greedy.h), without computing every logit exactly.
  bool has_greedy() const;
  std::tuple<at::Tensor, at::Tensor> greedy(at::Tensor x) const;
};

}  // namespace roseinfer
