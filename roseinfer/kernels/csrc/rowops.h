// Row kernels shared by the decode stack and the PyTorch path (as torch ops): RMSNorm,
// residual + RMSNorm, SiLU(gate) * up, Neox rotary with K/V writes into the paged cache.
// Rows are split over the intra-op threads; x, weights and outputs are float32.
#pragma once

#include "common.h"

namespace roseinfer {

// y = w * (x * rsqrt(mean(x^2) + eps)) for `rows` rows of n (single thread).
void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps);
// h += t, then y = rms_norm(h) * w (threaded over rows).
void add_rms_norm(float* h, const float* t, const float* w, float* y, int64_t rows, int64_t n,
                  float eps);
// a[b, i] = silu(gu[b, i]) * gu[b, inter + i] (threaded over rows).
void silu_mul(const float* gu, float* a, int64_t B, int64_t inter);
// Per row b of qkv [B, (H + 2 Hkv) * Dh]: rotary on q and k at pos[b] (in place), K and V
// into cache slot slots[b] (cast to KV), q copied to q_out [B, H * Dh] unless null.
template <typename KV>
void rope_and_store(float* qkv, int64_t B, int64_t H, int64_t Hkv, int64_t Dh,
                    const int64_t* pos, const int64_t* slots, const float* cos_sin,
                    float* q_out, KV* kc, KV* vc);
// An int8 cache (kv_q8.h): each KV head of a row quantized with its own scale.
template <>
void rope_and_store<int8_t>(float* qkv, int64_t B, int64_t H, int64_t Hkv, int64_t Dh,
                            const int64_t* pos, const int64_t* slots, const float* cos_sin,
                            float* q_out, int8_t* kc, int8_t* vc);

// torch.ops.roseinfer.rms_norm / silu_mul / rope_and_cache_
at::Tensor rms_norm_op(at::Tensor x, at::Tensor w, double eps);
at::Tensor silu_mul_op(at::Tensor gate_up);
void rope_and_cache_op(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin,
                       at::Tensor kv_cache, at::Tensor slot_mapping, int64_t num_heads,
                       int64_t num_kv_heads);

}  // namespace roseinfer
