// Row-local activation quantization shared by the int8-weight GEMMs: each 32-block of a
// row gets dx = max|x| / qmax and xq = rint(x / dx) clamped to [-qmax, qmax] (dx = 0:
// zeros), qmax = 32767 for int16 values (q8_gemm.h, gguf_gemm.h; 127 for int8 would be
// llama.cpp's Q8_0 activations, which fail the quality gate); sx = float(exact sum of
// the block's xq) * dx, the factor of the Q4_1 minimum term; optionally that exact sum
// itself (si: Q4_0's offset term).  The act8 format (q4_act8.h) takes int8 activations
// with one scale per 16 values instead: quantize_rows_act8.
// The AVX2 and scalar versions give the same values (max is exact, x / dx correctly
// rounded, round to nearest even in both).
#pragma once

#include <limits>

#include "q8_gemm.h"

namespace roseinfer {

// N values of x -> q with d = max|x| / qmax (T's largest value); returns q's exact sum.
template <typename T, int N>
inline int32_t quantize_scalar(const float* x, T* q, float* d) {
  constexpr float qmax = std::numeric_limits<T>::max();
  float amax = 0.f;
  for (int i = 0; i < N; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float dx = amax / qmax;
  *d = dx;
  int32_t total = 0;
  for (int i = 0; i < N; ++i) {
    const float v = dx == 0.f ? 0.f : std::nearbyint(x[i] / dx);
    q[i] = static_cast<T>(std::min(qmax, std::max(-qmax, v)));
    total += q[i];
  }
  return total;
}

template <typename T>
inline void quantize_block_scalar(const float* x, T* q, float* d, float* sum, int32_t* isum) {
  const int32_t total = quantize_scalar<T, 32>(x, q, d);
  *sum = static_cast<float>(total) * *d;
  if (isum) *isum = total;
}

#ifdef ROSEINFER_AVX2
// The 32 values r[0..3] (int32 lanes, in order) stored as int16: the packs work per
// 128-bit lane, so a permutation restores the element order.
inline void store_block(const __m256i (&r)[4], int16_t* q) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xD8));
}

// quantize_scalar on NV vectors of 8 values at x: r the rounded, clamped values (int32).
template <int NV>
inline int32_t quantize_vectors(const float* x, float qmax, float* d, __m256i (&r)[NV]) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[NV], m = _mm256_setzero_ps();  // max is exact: any order gives the same
  for (int i = 0; i < NV; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs_mask));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float dx = _mm_cvtss_f32(h) / qmax;
  *d = dx;
  const __m256 dv = _mm256_set1_ps(dx == 0.f ? 1.f : dx);  // dx = 0: x = 0, so q = 0
  const __m256 lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
  __m256i t = _mm256_setzero_si256();
  for (int i = 0; i < NV; ++i) {
    const __m256 q = _mm256_round_ps(_mm256_div_ps(v[i], dv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, q)));
    t = _mm256_add_epi32(t, r[i]);
  }
  __m128i h4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0x4E));
  h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0xB1));
  return _mm_cvtsi128_si32(h4);
}

template <typename T>
inline void quantize_block_avx2(const float* x, T* q, float* d, float* sum, int32_t* isum) {
  __m256i r[4];
  const int32_t total = quantize_vectors<4>(x, std::numeric_limits<T>::max(), d, r);
  *sum = static_cast<float>(total) * *d;
  if (isum) *isum = total;
  store_block(r, q);
}
#endif

// 32-blocks a thread quantizes at least: a batched decode step's rows (16 x K = 576: 288
// blocks) over the threads, a one-row step's alone.  With 4,096 (serial below 128K
// values) the other thread waited in every GEMM of a batch-16 step (perf: ~4% of its
// samples in the serial quantizer; the step 19.3 against 22.2 ms, medians of 14
// interleaved rounds).  Which thread quantizes a block never changes a value.
constexpr int64_t kQuantGrain = 128;

// Rows [0, M) of x -> xq (rows of stride K), dx and sx [M, K/32] (and si [M, K/32], the
// exact integer sums, unless null).
template <typename T>
void quantize_rows(const float* x, int64_t M, int64_t K, T* q, float* dx, float* sx,
                   bool portable, int32_t* si = nullptr) {
  const int64_t KB = K / kQ8Block;
  at::parallel_for(0, M * KB, kQuantGrain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
#ifdef ROSEINFER_AVX2
      if (!portable) {
        quantize_block_avx2(x + b * kQ8Block, q + b * kQ8Block, dx + b, sx + b,
                            si ? si + b : nullptr);
        continue;
      }
#endif
      quantize_block_scalar(x + b * kQ8Block, q + b * kQ8Block, dx + b, sx + b,
                            si ? si + b : nullptr);
    }
  });
}

// The act8 format's activations (q4_act8.h): each 16 values of a row get their own dx =
// max|x| / 127 and xq = rint(x / dx) clamped to [-127, 127] (dx = 0: zeros):
// quantize_scalar<int8_t, 16> or quantize16_avx2 (the same values), which return the
// exact sum of the 16 xq.
#ifdef ROSEINFER_AVX2
inline int32_t quantize16_avx2(const float* x, int8_t* q, float* d) {
  __m256i r[2];
  const int32_t total = quantize_vectors<2>(x, 127.f, d, r);
  // int32 -> int16 (the pack works per 128-bit lane: the permutation restores the order)
  // -> int8.
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q),
                   _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
  return total;
}
#endif

// Rows [0, M) of x -> int8 xq (rows of stride K), dx [M, K/16] (one per 16 values), sx
// [M, K/32] = fma(float(s1), dx1, float(s0) * dx0) per 32-block (s0 / s1: its halves'
// exact sums; the factor of the Q4_1 minimum term) and, unless null, si [M, K/16] (the
// halves' exact sums: Q4_0's offset term).
inline void quantize_rows_act8(const float* x, int64_t M, int64_t K, int8_t* q, float* dx,
                               float* sx, bool portable, int32_t* si = nullptr) {
  const int64_t KB = K / kQ8Block;
  const auto quantize16 = [portable](const float* xv, int8_t* qv, float* d) {
#ifdef ROSEINFER_AVX2
    if (!portable) return quantize16_avx2(xv, qv, d);
#endif
    return quantize_scalar<int8_t, 16>(xv, qv, d);
  };
  at::parallel_for(0, M * KB, kQuantGrain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int32_t s[2];
      for (int64_t h = 0, i = 2 * b; h < 2; ++h, ++i) {
        s[h] = quantize16(x + 16 * i, q + 16 * i, dx + i);
        if (si) si[i] = s[h];
      }
      sx[b] = std::fma(static_cast<float>(s[1]), dx[2 * b + 1], static_cast<float>(s[0]) * dx[2 * b]);
    }
  });
}

}  // namespace roseinfer
