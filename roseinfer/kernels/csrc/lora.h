// Segmented LoRA deltas: for each adapter segment (rows [start, end) of one adapter) of a
// step, y[rows] += (x[rows] A^T) B^T on top of a base linear's output, fp32.
//
// An adapter's fused linear (q/k/v or gate/up stacked like the base weights) is A [R, K]
// (the adapted members' A rows stacked) and one part per adapted member: its rank rows
// [r0, r1) of A feed its output columns [n0, n1) through Bt [r1 - r0, n1 - n0] (B
// transposed, PEFT's scaling folded in).  No zero blocks: a member's rank columns never
// touch another member's outputs.
//
// Arithmetic of one row (the same for every segment size, thread count and position of
// the row in the batch: batch invariance, docs/CONTRACTS.md):
//   t[r] = dot(x, A[r]) with 4 x 8 fp32 lanes (k mod 32; a K % 32 tail of 8-blocks into
//          lanes 0..7), the lanes summed as (l0+l1)+(l2+l3) then hsum8's tree, then any
//          K % 8 remainder fused in order: fma(x[k], A[r,k], t);
//   y[n] += acc, acc = fma(t[r], Bt[r, n], acc) over r = r0..r1-1 in order from +0.
// The AVX2 path and the portable path (std::fma, the same order) are bitwise equal; which
// one runs is chosen at run time (LoraStep's `portable`, for the tests).
#pragma once

#include <torch/custom_class.h>

#include <array>

#include "common.h"

namespace roseinfer {

struct LoraPart {
  int64_t r0, r1, n0, n1;
  const float* bt;  // [r1 - r0, n1 - n0]
};

struct LoraLinear {
  const float* a = nullptr;  // [R, K]
  int64_t R = 0, K = 0, N = 0;
  std::vector<LoraPart> parts;
};

// A resident adapter: views into one float32 buffer, per layer and fused linear
// (0 qkv, 1 o, 2 gate_up, 3 down; R == 0: not adapted).
struct LoraAdapter : torch::CustomClassHolder {
  at::Tensor buffer;
  std::vector<std::array<LoraLinear, 4>> layers;

  // plan int64 [P, 11], one row per part: layer, linear, a_offset, R, K, N, r0, r1, n0,
  // n1, bt_offset (offsets in floats into buffer); every range is checked.
  LoraAdapter(at::Tensor buffer, at::Tensor plan, int64_t num_layers);
};

// The adapters of one step's rows, applied after each base linear.
struct LoraStep : torch::CustomClassHolder {
  std::vector<int64_t> starts, ends;
  std::vector<c10::intrusive_ptr<LoraAdapter>> adapters;
  bool portable;

  explicit LoraStep(bool portable_) : portable(portable_) {}
  void add(int64_t start, int64_t end, c10::intrusive_ptr<LoraAdapter> adapter);
  // y [B, N] += every segment's delta of linear `which` of `layer`; x [B, K] contiguous.
  void apply(int64_t layer, int64_t which, const at::Tensor& x, at::Tensor& y) const;
  void apply_op(int64_t layer, int64_t which, at::Tensor x, at::Tensor y) { apply(layer, which, x, y); }
};

// Fills an adapter's buffer in the layout `plan` describes (LoraAdapter's rows, one per
// part): part i's A [r, K] (a_src[i]) copied to A rows [r0, r1), its B [n, r] (b_src[i])
// transposed and times scalings[i] into Bt.  Sources: any float dtype, e.g. views of a
// mapped safetensors file; one call per adapter (no per-module Python).
void lora_fill(at::Tensor buffer, at::TensorList a_src, at::TensorList b_src,
               at::ArrayRef<double> scalings, at::Tensor plan);

}  // namespace roseinfer
