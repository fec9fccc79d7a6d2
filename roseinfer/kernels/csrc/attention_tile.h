// The float caches' attention (attention.cpp) for four rows of one sequence at once: the
// rows of a prefill chunk (or of a speculative verification) read the same K and V rows,
// so each K and V vector is loaded and widened once for the four rows instead of once a
// row.  Every (row, head) value keeps attend_heads' arithmetic exactly: the same 8-lane
// FMA chains and reduce4 tree per score, the same softmax_row, the same FMA chain over
// the positions per output lane; rows only share loads.  So a row's output never depends
// on whether it ran in a tile (tested: tests/kernels and scripts/isa_variants).  AVX-512.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_parts.h"

namespace roseinfer {

#ifdef ROSEINFER_AVX512
// Two rows' 8 values as one register (rows a and b in the low and high halves).
static inline __m512 load8x2(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
static inline __m512 load8x2(const at::Half* a, const at::Half* b) {
  const __m128i* pa = reinterpret_cast<const __m128i*>(a);
  const __m128i* pb = reinterpret_cast<const __m128i*>(b);
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(pa)),
                                                 _mm_loadu_si128(pb), 1));
}
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

constexpr int kTileRows = 4;

// Whether items i .. i + kTileRows - 1 (of a thread's range ending at e) are one KV head's
// consecutive rows of one sequence: item_order puts a prefill chunk's rows so.
inline bool tile_rows_at(const std::vector<int64_t>& order, int64_t i, int64_t e,
                         const int32_t* seq_of, int64_t Hkv) {
  if (i + kTileRows > e) return false;
  const int64_t d = order[i] / Hkv, kh = order[i] % Hkv;
  for (int64_t r = 1; r < kTileRows; ++r)
    if (order[i + r] != (d + r) * Hkv + kh || seq_of[d + r] != seq_of[d]) return false;
  return true;
}

// Query heads [0, GB) of KV head kh for kTileRows rows of one sequence: row r's heads at
// q + r * qstride (stride DH), its length L[r], its output at od + r * ostride.  scores:
// kTileRows * GB rows of max(L) floats.  Keys up to the longest row are scored for every
// row (a shorter row's extra scores are never read); P.V runs the shared positions
// (below the shortest row) for all rows, then each row's chains go on alone to its end.
template <int DH, int GB, typename KV>
static void attend_heads_tile(const float* q, int64_t qstride, const KV* kc, const KV* vc,
                              const int32_t* table, const int64_t (&L)[kTileRows], int64_t row,
                              int64_t bs, int64_t kh, float scale, float* scores, float* od,
                              int64_t ostride) {
  static_assert(DH % 32 == 0, "P.V takes 32 output dims a pass");
  constexpr int R = kTileRows;
  constexpr int64_t kRowBytes = DH * sizeof(KV);
  const int64_t Lmax = *std::max_element(L, L + R), Lmin = *std::min_element(L, L + R);
  auto sc = [&](int r, int g) { return scores + (r * GB + g) * Lmax; };
  KeyWalk4<KV> keys(table, bs, kc + kh * DH, row, Lmax, kRowBytes);
  for (int64_t t0 = 0; t0 < Lmax; t0 += 4) {  // scores4_zmm for every row
    const int64_t n = std::min<int64_t>(4, Lmax - t0);
    const KV* k[4];
    keys.next(t0, n, k);
    __m512 a[R][GB][2];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GB; ++g) a[r][g][0] = a[r][g][1] = _mm512_setzero_ps();
    for (int v = 0; v < DH / 8; ++v) {
      const __m512 k01 = load8x2(k[0] + 8 * v, k[1] + 8 * v);
      const __m512 k23 = load8x2(k[2] + 8 * v, k[3] + 8 * v);
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < GB; ++g) {
          const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + r * qstride + g * DH + 8 * v));
          a[r][g][0] = _mm512_fmadd_ps(k01, qv, a[r][g][0]);
          a[r][g][1] = _mm512_fmadd_ps(k23, qv, a[r][g][1]);
        }
    }
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GB; ++g) {
        const __m256 h[4] = {_mm512_castps512_ps256(a[r][g][0]), _mm512_extractf32x8_ps(a[r][g][0], 1),
                             _mm512_castps512_ps256(a[r][g][1]), _mm512_extractf32x8_ps(a[r][g][1], 1)};
        const __m128 s = _mm_mul_ps(reduce4(h), _mm_set1_ps(scale));
        if (n == 4) {
          _mm_storeu_ps(sc(r, g) + t0, s);
        } else {
          alignas(16) float tmp[4];
          _mm_store_ps(tmp, s);
          for (int64_t j = 0; j < n; ++j) sc(r, g)[t0 + j] = tmp[j];
        }
      }
  }
  RowsAhead<KV> va(table, bs, vc + kh * DH, row, Lmax, kRowBytes);
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < GB; ++g) softmax_row(sc(r, g), L[r]);
  for (int ch = 0; ch < DH / 16; ch += 2) {  // 32 output dims a pass
    __m512 acc[R][GB][2];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GB; ++g) acc[r][g][0] = acc[r][g][1] = _mm512_setzero_ps();
    SlotCursor v(table, bs, 0);
    for (int64_t t = 0; t < Lmin; ++t, v.next()) {
      if (ch == 0) va.step(t);
      const KV* vr = vc + v.slot() * row + kh * DH + 16 * ch;
      const __m512 v0 = load16(vr), v1 = load16(vr + 16);
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < GB; ++g) {
          const __m512 p = _mm512_set1_ps(sc(r, g)[t]);
          acc[r][g][0] = _mm512_fmadd_ps(p, v0, acc[r][g][0]);
          acc[r][g][1] = _mm512_fmadd_ps(p, v1, acc[r][g][1]);
        }
    }
    for (int r = 0; r < R; ++r) {  // each row's own last positions, its chains going on
      SlotCursor w = v;
      for (int64_t t = Lmin; t < L[r]; ++t, w.next()) {
        const KV* vr = vc + w.slot() * row + kh * DH + 16 * ch;
        const __m512 v0 = load16(vr), v1 = load16(vr + 16);
        for (int g = 0; g < GB; ++g) {
          const __m512 p = _mm512_set1_ps(sc(r, g)[t]);
          acc[r][g][0] = _mm512_fmadd_ps(p, v0, acc[r][g][0]);
          acc[r][g][1] = _mm512_fmadd_ps(p, v1, acc[r][g][1]);
        }
      }
      for (int g = 0; g < GB; ++g) {
        _mm512_storeu_ps(od + r * ostride + g * DH + 16 * ch, acc[r][g][0]);
        _mm512_storeu_ps(od + r * ostride + g * DH + 16 * ch + 16, acc[r][g][1]);
      }
    }
  }
}

// attend_item for kTileRows rows: the G query heads in passes of up to 3.
template <int DH, typename KV>
static void attend_item_tile(const float* qd, int64_t qstride, const KV* kc, const KV* vc,
                             const int32_t* table, const int64_t (&L)[kTileRows], int64_t G,
                             int64_t row, int64_t bs, int64_t kh, float scale, float* scores,
                             float* od, int64_t ostride) {
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t gb = std::min<int64_t>(3, G - g0);
    const float* q = qd + g0 * DH;
    float* o = od + g0 * DH;
    if (gb == 3) attend_heads_tile<DH, 3>(q, qstride, kc, vc, table, L, row, bs, kh, scale, scores, o, ostride);
    else if (gb == 2) attend_heads_tile<DH, 2>(q, qstride, kc, vc, table, L, row, bs, kh, scale, scores, o, ostride);
    else attend_heads_tile<DH, 1>(q, qstride, kc, vc, table, L, row, bs, kh, scale, scores, o, ostride);
    g0 += gb;
  }
}
#endif  // ROSEINFER_AVX512

}  // namespace roseinfer
