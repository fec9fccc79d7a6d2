// The float / fp16 decode attention's score kernels and register-width helpers
// (attention.cpp): K rows widened to fp32, per (query head, row) an FMA chain over the
// head dim's 8-value vectors, reduced by reduce4's tree (attention_parts.h), so that
// every width computes the same bits.
#pragma once

#include "attention_parts.h"
#include "attention_tile.h"

namespace roseinfer {

#ifdef ROSEINFER_AVX2
// 8 cache elements as fp32 (an fp16 cache is widened with F16C).
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Register-width helpers for the P.V pass (256- or 512-bit lanes, the same per-lane ops).
template <typename V> static inline V vzero();
template <> inline __m256 vzero<__m256>() { return _mm256_setzero_ps(); }
template <typename V> static inline V vbroadcast(const float* p);
template <> inline __m256 vbroadcast<__m256>(const float* p) { return _mm256_broadcast_ss(p); }
template <typename V, typename KV> static inline V vload(const KV* p);
template <> inline __m256 vload<__m256, float>(const float* p) { return load8(p); }
template <> inline __m256 vload<__m256, at::Half>(const at::Half* p) { return load8(p); }
static inline __m256 vfmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
static inline void vstore(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#ifdef ROSEINFER_AVX512
template <> inline __m512 vzero<__m512>() { return _mm512_setzero_ps(); }
template <> inline __m512 vbroadcast<__m512>(const float* p) { return _mm512_set1_ps(*p); }
template <> inline __m512 vload<__m512, float>(const float* p) { return load16(p); }
template <> inline __m512 vload<__m512, at::Half>(const at::Half* p) { return load16(p); }
static inline __m512 vfmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vstore(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#endif

// The P.V pass's registers: kPvW output dims each, kPvChunk<DH> of them a pass.
#ifdef ROSEINFER_AVX512
using PvVec = __m512;
constexpr int kPvW = 16;
#else
using PvVec = __m256;
constexpr int kPvW = 8;
#endif
template <int DH>
constexpr int kPvChunk = DH / kPvW < 4 ? DH / kPvW : 4;

// One position's P.V step: acc[g][u] += p_g * v[kPvW u ..] for the GB heads' probabilities
// p_g = scores[g * L + t] and the V row vr (one FMA chain per output lane, in position
// order: the walk's form never changes a value).
template <int GB, int CH, typename KV>
static inline void pv_step(const float* scores, int64_t L, int64_t t, const KV* vr,
                           PvVec (&acc)[GB][CH]) {
  PvVec p[GB];
  for (int g = 0; g < GB; ++g) p[g] = vbroadcast<PvVec>(scores + g * L + t);
  for (int u = 0; u < CH; ++u) {
    const PvVec vv = vload<PvVec>(vr + kPvW * u);
    for (int g = 0; g < GB; ++g) acc[g][u] = vfmadd(p[g], vv, acc[g][u]);
  }
}

// Scores of query heads q[0..GB) (stride DH) against the K rows k[0..4): per (head, row)
// an FMA chain over the DH/8 vectors, then reduce4; n of them stored at out[g * ld + j].
// Each K vector is widened once for the GB heads.
template <int DH, int GB, typename KV>
static inline void scores4(const float* q, const KV* const (&k)[4], int64_t n, float scale,
                           float* out, int64_t ld) {
  __m256 a[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
  for (int v = 0; v < DH / 8; ++v)
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = load8(k[j] + 8 * v);
      for (int g = 0; g < GB; ++g)
        a[g][j] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q + g * DH + 8 * v), a[g][j]);
    }
  for (int g = 0; g < GB; ++g) {
    const __m128 s = _mm_mul_ps(reduce4(a[g]), _mm_set1_ps(scale));
    if (n == 4) {
      _mm_storeu_ps(out + g * ld, s);
    } else {
      alignas(16) float tmp[4];
      _mm_store_ps(tmp, s);
      for (int64_t j = 0; j < n; ++j) out[g * ld + j] = tmp[j];
    }
  }
}

#ifdef ROSEINFER_AVX512
// 512-bit forms: the scores below (two K rows a register) and the P.V pass's 16 output
// dims a register (attend_heads), every lane's FMA chain the 256-bit one's.
// reduce4's pairwise step on 512 bits: per 128-bit lane [x0 + x1, x2 + x3, y0 + y1, y2 + y3].
static inline __m512 hadd_zmm(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

// scores4 for the K rows k[0..8) at once: rows 2i and 2i + 1 in the halves of a[g][i],
// every lane the same FMA chain over the DH/8 vectors, and each score reduced by
// reduce4's tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) with 512-bit
// shuffles (eight scores of a head in four steps instead of two reduce4s), so the same
// bits.  n of them stored at out[g * ld + j].
template <int DH, int GB, typename KV>
static inline void scores8_zmm(const float* q, const KV* const (&k)[8], int64_t n, float scale,
                               float* out, int64_t ld) {
  __m512 a[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < 4; ++i) a[g][i] = _mm512_setzero_ps();
  for (int v = 0; v < DH / 8; ++v) {
    __m512 kk[4];
    for (int i = 0; i < 4; ++i) kk[i] = load8x2(k[2 * i] + 8 * v, k[2 * i + 1] + 8 * v);
    for (int g = 0; g < GB; ++g) {
      const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + g * DH + 8 * v));
      for (int i = 0; i < 4; ++i) a[g][i] = _mm512_fmadd_ps(kk[i], qv, a[g][i]);
    }
  }
  // After the two pairwise steps, 128-bit lane 0 / 1 holds the low / high half sums of
  // rows 0, 2, 4, 6 and lane 2 / 3 those of rows 1, 3, 5, 7.
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < GB; ++g) {
    const __m512 h = hadd_zmm(hadd_zmm(a[g][0], a[g][1]), hadd_zmm(a[g][2], a[g][3]));
    const __m512 s = _mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(2, 3, 0, 1)));
    _mm512_mask_storeu_ps(out + g * ld, keep,
                          _mm512_permutexvar_ps(order, _mm512_mul_ps(s, _mm512_set1_ps(scale))));
  }
}
#endif  // ROSEINFER_AVX512

#ifdef ROSEINFER_AVX512
// scores4 on 512-bit registers, rows j and j + 1 in the halves of one register (the
// one-row walk's form, attend_heads_walk).
template <int DH, int GB, typename KV>
static inline void scores4_zmm(const float* q, const KV* const (&k)[4], int64_t n, float scale,
                               float* out, int64_t ld) {
  __m512 a[GB][2];
  for (int g = 0; g < GB; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
  for (int v = 0; v < DH / 8; ++v) {
    const __m512 k01 = load8x2(k[0] + 8 * v, k[1] + 8 * v);
    const __m512 k23 = load8x2(k[2] + 8 * v, k[3] + 8 * v);
    for (int g = 0; g < GB; ++g) {
      const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + g * DH + 8 * v));
      a[g][0] = _mm512_fmadd_ps(k01, qv, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(k23, qv, a[g][1]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m256 r[4] = {_mm512_castps512_ps256(a[g][0]), _mm512_extractf32x8_ps(a[g][0], 1),
                         _mm512_castps512_ps256(a[g][1]), _mm512_extractf32x8_ps(a[g][1], 1)};
    const __m128 s = _mm_mul_ps(reduce4(r), _mm_set1_ps(scale));
    alignas(16) float tmp[4];
    _mm_store_ps(tmp, s);
    for (int64_t j = 0; j < n; ++j) out[g * ld + j] = tmp[j];
  }
}
#endif

#endif  // ROSEINFER_AVX2

}  // namespace roseinfer
