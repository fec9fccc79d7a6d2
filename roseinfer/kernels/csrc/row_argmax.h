// Row argmax of float32 logits (greedy sampling): one vectorised pass for the maximum,
// one to find its first index. Exactly torch.argmax / max(dim=-1): the first maximum
// (-0.0 == 0.0), and in a row holding a NaN its first NaN.
#pragma once

#include "common.h"

namespace roseinfer {

// (max value, index) of x[0, n), n >= 1 (single thread; the same answer with and
// without AVX2).
std::pair<float, int64_t> row_argmax(const float* x, int64_t n);

// torch.ops.roseinfer.row_argmax(logits [B, V] float32) -> (values [B] float32, ids [B]
// int64); rows split over the threads.
std::tuple<at::Tensor, at::Tensor> row_argmax_op(at::Tensor logits);

}  // namespace roseinfer
