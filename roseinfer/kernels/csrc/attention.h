// Paged decode attention: one query token per sequence attends to its whole context
// straight from the paged KV cache, block by block (no gather of each context).
#pragma once

#include "common.h"

namespace roseinfer {

// q [D, H, Dh]; out [D, H, Dh]; kc / vc: the K and V halves of one layer's cache, whose
// elements are float or at::Half (instantiated for both).
template <typename KV>
void decode_attention(const float* q, const KV* kc, const KV* vc, const int32_t* bt,
                      int64_t bt_stride, const int32_t* lens, int64_t D, int64_t H, int64_t Hkv,
                      int64_t Dh, int64_t bs, float scale, float* out);

void check_decode_args(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                       const at::Tensor& context_lens);

// torch.ops.roseinfer.paged_decode_attention
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, int64_t block_size, double scale);

}  // namespace roseinfer
