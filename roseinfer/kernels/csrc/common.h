// Shared includes and AVX2/FMA helpers for the roseinfer CPU kernels.
// Layouts follow docs/CONTRACTS.md: kv_cache [2, slots, Hkv, Dh] float32; slot of
// position p = block_table[p / block_size] * block_size + p % block_size.
// Activations are float32 on CPU (the KV cache may be float16, or int8 with a scale per
// row: kv_q8.h); the Python side falls back to PyTorch otherwise.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ROSEINFER_AVX2 1
#include <immintrin.h>
#endif

namespace roseinfer {

// Calls f(K, V) with typed pointers to the K and V halves of one layer's cache
// [2, slots, Hkv, Dh] (float or at::Half elements), or [2, slots, Hkv, Dh + 4] int8 rows
// with their scales (kv_q8.h); callers check the dtype first.
template <typename F>
inline void with_kv_halves(const at::Tensor& kv_cache, F&& f) {
  const int64_t half = kv_cache.numel() / 2;
  if (kv_cache.scalar_type() == at::kChar) {
    int8_t* k = kv_cache.data_ptr<int8_t>();
    f(k, k + half);
  } else if (kv_cache.scalar_type() == at::kHalf) {
    at::Half* k = kv_cache.data_ptr<at::Half>();
    f(k, k + half);
  } else {
    float* k = kv_cache.data_ptr<float>();
    f(k, k + half);
  }
}

// The head dim of a cache [2, slots, Hkv, row]: the row, less the scale of an int8 cache.
inline int64_t cache_head_dim(const at::Tensor& kv_cache) {
  return kv_cache.size(3) - (kv_cache.scalar_type() == at::kChar ? 4 : 0);
}

#ifdef ROSEINFER_AVX2
static inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// exp(x) for 8 floats: range reduction x = n ln2 + r, degree-5 polynomial for e^r
// (Cephes expf), relative error ~2e-7 over the softmax range (x <= 0).
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                    _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif  // ROSEINFER_AVX2

}  // namespace roseinfer
