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
#include <cstring>
#include <vector>

#include <unistd.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ROSEINFER_AVX2 1
#include <immintrin.h>
#endif

// VNNI on 256-bit registers (AVX-VNNI, or AVX-512 VNNI with VL): vpdpwssd / vpdpbusd add
// the pair / quad products into int32 lanes without saturation, so they give the same
// exact integer sums as vpmaddwd + vpaddd (or vpmaddubsw + vpmaddwd) in half the
// instructions.  RI_VNNI is the asm mnemonic prefix: {vex} picks AVX-VNNI's encoding.
// ROSEINFER_NO_VNNI (a build flag) keeps the AVX2 loops on a VNNI machine (tests).
#if defined(ROSEINFER_AVX2) && !defined(ROSEINFER_NO_VNNI)
#if defined(__AVXVNNI__)
#define ROSEINFER_VNNI 1
#define RI_VNNI "%{vex%} "  // (%{ %}: literal braces in an asm template)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ROSEINFER_VNNI 1
#define RI_VNNI ""
#endif
#endif

// AVX-512 (F/BW/VL) with VNNI: the integer loops of the GEMMs run on 512-bit registers,
// one register per step's 16 columns and one accumulator per row (the same exact integer
// sums).  ROSEINFER_NO_AVX512 (a build flag) keeps the 256-bit loops (tests).
#if defined(ROSEINFER_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__) && !defined(ROSEINFER_NO_AVX512)
#define ROSEINFER_AVX512 1
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

// This core's L2 bytes (the OS's figure; 1 MiB where it gives none).
inline int64_t l2_cache_bytes() {
  const long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return n > 0 ? n : int64_t{1} << 20;
}

#ifdef ROSEINFER_AVX2
// Prefetch (into L1) the cache lines of bytes [p, p + bytes).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64)
    _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
}

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

#ifdef ROSEINFER_VNNI
// acc + per int32 lane the exact sum of the four products of unsigned bytes u and signed
// bytes s (vpdpbusd, no saturation).
static inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_dpbusd_epi32(acc, u, s);
#endif
}
#endif  // ROSEINFER_VNNI

#ifdef ROSEINFER_AVX512
// The two 256-bit halves of a 512-bit register and back (the 256-bit loops' accumulator
// pairs: columns 0-7 and 8-15).
static inline __m512i join256(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
static inline void split512(__m512i v, __m256i& lo, __m256i& hi) {
  lo = _mm512_castsi512_si256(v);
  hi = _mm512_extracti64x4_epi64(v, 1);
}
// Four bytes at p (a k-pair of int16 activations, or four int8 ones) in every int32 lane.
static inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
#endif  // ROSEINFER_AVX512

}  // namespace roseinfer
