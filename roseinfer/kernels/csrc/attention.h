// Paged attention over the KV cache, one kernel for every query row: a row (a decode
// token or one token of a prefill chunk) attends to the first `len` positions of its
// sequence straight from the paged cache, block by block (no gather of each context).
// A row's arithmetic depends only on its query, its context and `len`: never on the
// other rows, their number or kind, so prefill and decode give bitwise equal results
// (the batch-invariance rule of docs/CONTRACTS.md).
#pragma once

#include "common.h"

namespace roseinfer {

// q [D, H, Dh]; out [D, H, Dh]; kc / vc: the K and V halves of one layer's cache, whose
// elements are float or at::Half (instantiated for both), or int8 (specialized below).  Row d reads block-table row
// seq_of[d] and attends to positions 0..lens[d]-1.
template <typename KV>
void attend_rows(const float* q, const KV* kc, const KV* vc, const int32_t* bt,
                      int64_t bt_stride, const int32_t* seq_of, const int32_t* lens, int64_t D,
                      int64_t H, int64_t Hkv, int64_t Dh, int64_t bs, float scale, float* out);

// The int8 cache (attention_q8.cpp): kc / vc point at [slots, Hkv, Dh + 4] int8 rows;
// portable: the scalar implementation (the same bits as the AVX2 one; tests).
void attend_rows_q8(const float* q, const int8_t* kc, const int8_t* vc, const int32_t* bt,
                    int64_t bt_stride, const int32_t* seq_of, const int32_t* lens, int64_t D,
                    int64_t H, int64_t Hkv, int64_t Dh, int64_t bs, float scale, float* out,
                    bool portable);
template <>
void attend_rows<int8_t>(const float* q, const int8_t* kc, const int8_t* vc, const int32_t* bt,
                         int64_t bt_stride, const int32_t* seq_of, const int32_t* lens,
                         int64_t D, int64_t H, int64_t Hkv, int64_t Dh, int64_t bs, float scale,
                         float* out);

void check_decode_args(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                       const at::Tensor& context_lens);
// token_seq: int32 [T] block-table row of each query row (checked against block_tables).
void check_token_seq(const at::Tensor& token_seq, const at::Tensor& block_tables, int64_t T);

// torch.ops.roseinfer.paged_attention: q [T, H, Dh] rows of any mix of sequences; row t
// uses block_tables[token_seq[t]] and attends to token_lens[t] positions.
at::Tensor paged_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                           at::Tensor token_seq, at::Tensor token_lens, int64_t block_size,
                           double scale);
// The same; portable: an int8 cache's scalar implementation.
at::Tensor paged_attention_impl(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                at::Tensor token_seq, at::Tensor token_lens, int64_t block_size,
                                double scale, bool portable);
// torch.ops.roseinfer.paged_attention_portable: an int8 cache, the scalar implementation.
at::Tensor paged_attention_portable(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                    at::Tensor token_seq, at::Tensor token_lens,
                                    int64_t block_size, double scale);

}  // namespace roseinfer
