// The float caches' attention (attention.cpp) for four rows of one sequence at once: the
// rows of a prefill chunk (or of a speculative verification) read the same K and V rows,
// so each K and V vector is loaded and widened once for the four rows instead of once a
// row.  Every (row, head) value keeps attend_heads' arithmetic exactly: the same 8-lane
// FMA chains and reduce4 tree per score, the same softmax_row, the same FMA chain over
// the positions per output lane (past a row's end its lanes are masked off); rows only
// share loads (the scores' keys transposed once per thread: KeysT).  So a row's output
// never depends on whether it ran in a tile (tested: tests/perf/test_attention_tiles.py
// and scripts/isa_variants).  AVX-512.
#pragma once

#include <algorithm>
#include <type_traits>
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

// A thread's K rows of one (sequence, KV head), transposed for the tiles' scores: blocks
// of 16 positions, each DH vectors of the 16 positions' values at one dim (fp32), so a
// score's eight lane chains are eight registers of 16 positions and its reduce4 tree is
// vertical adds.  A chunk's tiles come in row order, each reaching 4 positions further:
// extend() transposes only the positions not yet done (a partial last block again, its
// positions past the length zero).  Values are copied, never rounded: the same bits.
struct KeysT {
  const void* cache = nullptr;  // the K half, table and KV head the blocks hold
  const int32_t* table = nullptr;
  int64_t kh = -1, done = 0;
  std::vector<__m512> t;  // [block][DH]: 16 positions a vector (64-byte aligned)

  template <int DH, typename KV>
  const float* extend(const KV* kc, const int32_t* tbl, int64_t row, int64_t bs, int64_t h,
                      int64_t L) {
    if (cache != kc || table != tbl || kh != h) cache = kc, table = tbl, kh = h, done = 0;
    if (L > done) {
      const int64_t b1 = (L + 15) / 16;
      t.resize(b1 * DH);
      const KV* const zero = reinterpret_cast<const KV*>(kZeroRow);
      for (int64_t b = done / 16; b < b1; ++b) {
        const KV* k[16];
        SlotCursor c(tbl, bs, b * 16);
        for (int i = 0; i < 16; ++i, c.next())
          k[i] = b * 16 + i < L ? kc + c.slot() * row + h * DH : zero;
        float* dst = reinterpret_cast<float*>(t.data() + b * DH);
        for (int d0 = 0; d0 < DH; d0 += 16) {
          __m512 x[16];
          for (int i = 0; i < 16; ++i) x[i] = load16(k[i] + d0);
          transpose16(x);
          for (int i = 0; i < 16; ++i) _mm512_store_ps(dst + (d0 + i) * 16, x[i]);
        }
      }
      done = L;
    }
    return reinterpret_cast<const float*>(t.data());
  }

 private:
  // x[i][j] -> x[j][i].
  static inline void transpose16(__m512 (&x)[16]) {
    __m512 a[16];
    for (int i = 0; i < 16; i += 2) {
      a[i] = _mm512_unpacklo_ps(x[i], x[i + 1]);
      a[i + 1] = _mm512_unpackhi_ps(x[i], x[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
      for (int j = 0; j < 2; ++j) {
        x[i + 2 * j] = _mm512_shuffle_ps(a[i + j], a[i + j + 2], _MM_SHUFFLE(1, 0, 1, 0));
        x[i + 2 * j + 1] = _mm512_shuffle_ps(a[i + j], a[i + j + 2], _MM_SHUFFLE(3, 2, 3, 2));
      }
    for (int i = 0; i < 16; i += 8)
      for (int j = 0; j < 4; ++j) {
        a[i + j] = _mm512_shuffle_f32x4(x[i + j], x[i + j + 4], _MM_SHUFFLE(2, 0, 2, 0));
        a[i + j + 4] = _mm512_shuffle_f32x4(x[i + j], x[i + j + 4], _MM_SHUFFLE(3, 1, 3, 1));
      }
    for (int j = 0; j < 8; ++j) {
      x[j] = _mm512_shuffle_f32x4(a[j], a[j + 8], _MM_SHUFFLE(2, 0, 2, 0));
      x[j + 8] = _mm512_shuffle_f32x4(a[j], a[j + 8], _MM_SHUFFLE(3, 1, 3, 1));
    }
  }
};

// GB heads' scores at 16 positions from a KeysT block kt ([DH][16]): lane j's chain
// over v of k[8v + j] * q[8v + j] is register a[g][j] (16 positions), then reduce4's
// tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) and the scale: attend_heads'
// arithmetic for every score.  n (<= 16) stored at out[g * ld ..].
template <int DH, int GB>
static inline void scores16_t(const float* q, const float* kt, float scale, int64_t n,
                              float* out, int64_t ld) {
  __m512 a[GB][8];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 8; ++j) a[g][j] = _mm512_setzero_ps();
  for (int v = 0; v < DH / 8; ++v)
    for (int j = 0; j < 8; ++j) {
      __m512 k = _mm512_load_ps(kt + (8 * v + j) * 16);
      if (GB > 1) __asm__("" : "+v"(k));  // one load for the GB heads' FMAs
      for (int g = 0; g < GB; ++g)
        a[g][j] = _mm512_fmadd_ps(k, _mm512_set1_ps(q[g * DH + 8 * v + j]), a[g][j]);
    }
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < GB; ++g) {
    const __m512 lo =
        _mm512_add_ps(_mm512_add_ps(a[g][0], a[g][1]), _mm512_add_ps(a[g][2], a[g][3]));
    const __m512 hi =
        _mm512_add_ps(_mm512_add_ps(a[g][4], a[g][5]), _mm512_add_ps(a[g][6], a[g][7]));
    _mm512_mask_storeu_ps(out + g * ld, keep,
                          _mm512_mul_ps(_mm512_add_ps(lo, hi), _mm512_set1_ps(scale)));
  }
}

// Query heads [0, GB) of KV head kh for kTileRows rows of one sequence: row r's heads at
// q + r * qstride (stride DH), its length L[r], its output at od + r * ostride.  scores:
// kTileRows * GB rows of max(L) floats.  Each row is scored to its own length in blocks
// of 16 positions from keys (a shorter row's scores past its end are never used); P.V
// walks to the longest row, each row's FMAs masked off past its end.
template <int DH, int GB, typename KV>
static void attend_heads_tile(const float* q, int64_t qstride, const KV* kc, const KV* vc,
                              const int32_t* table, const int64_t (&L)[kTileRows], int64_t row,
                              int64_t bs, int64_t kh, float scale, float* scores, float* od,
                              int64_t ostride, KeysT& keys) {
  static_assert(DH % 32 == 0, "P.V takes 32 output dims a pass");
  constexpr int R = kTileRows;
  constexpr int64_t kRowBytes = DH * sizeof(KV);
  const int64_t Lmax = *std::max_element(L, L + R);
  auto sc = [&](int r, int g) { return scores + (r * GB + g) * Lmax; };
  const float* kt = keys.extend<DH>(kc, table, row, bs, kh, Lmax);
  for (int64_t t0 = 0; t0 < Lmax; t0 += 16)
    for (int r = 0; r < R; ++r)
      if (t0 < L[r])
        scores16_t<DH, GB>(q + r * qstride, kt + t0 * DH, scale,
                           std::min<int64_t>(16, L[r] - t0), sc(r, 0) + t0, Lmax);
  RowsAhead<KV> va(table, bs, vc + kh * DH, row, Lmax, kRowBytes);
  for (int r = 0; r < R; ++r)
    softmax_rows<GB>(sc(r, 0), Lmax, L[r]);
  const int64_t Lmin = *std::min_element(L, L + R);
  for (int ch = 0; ch < DH / 16; ch += 2) {  // 32 output dims a pass
    __m512 acc[R][GB][2];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GB; ++g) acc[r][g][0] = acc[r][g][1] = _mm512_setzero_ps();
    // The V row of position t: the walk steps a pointer `row` on, through the block table
    // at each block's first position.
    const KV* const vbase = vc + kh * DH + 16 * ch;
    const KV* vr = vbase;
    int64_t off = bs;  // position t's offset in its block; bs: look the block up
    // One walk to the longest row: past a row's end its chains are masked off (left as
    // they are, not added to), so each row's chain is its own positions' FMAs in order.
    // Below the shortest row no lane is masked (a loop without the masks' set-up).
    auto walk = [&](int64_t t0, int64_t t1, auto masked) {
      for (int64_t t = t0; t < t1; ++t, ++off, vr += row) {
        if (off == bs) off = 0, vr = vbase + (int64_t)table[t / bs] * bs * row;
        if (ch == 0) va.step(t);
        const __m512 v0 = load16(vr), v1 = load16(vr + 16);
        for (int r = 0; r < R; ++r) {
          const __mmask16 live = !decltype(masked)::value || t < L[r] ? 0xFFFF : 0;
          for (int g = 0; g < GB; ++g) {
            const __m512 p = _mm512_set1_ps(sc(r, g)[t]);
            acc[r][g][0] = _mm512_mask3_fmadd_ps(p, v0, acc[r][g][0], live);
            acc[r][g][1] = _mm512_mask3_fmadd_ps(p, v1, acc[r][g][1], live);
          }
        }
      }
    };
    walk(0, Lmin, std::false_type{});
    walk(Lmin, Lmax, std::true_type{});
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GB; ++g) {
        _mm512_storeu_ps(od + r * ostride + g * DH + 16 * ch, acc[r][g][0]);
        _mm512_storeu_ps(od + r * ostride + g * DH + 16 * ch + 16, acc[r][g][1]);
      }
  }
}

// attend_item for kTileRows rows: the G query heads in passes of up to 3.
template <int DH, typename KV>
static void attend_item_tile(const float* qd, int64_t qstride, const KV* kc, const KV* vc,
                             const int32_t* table, const int64_t (&L)[kTileRows], int64_t G,
                             int64_t row, int64_t bs, int64_t kh, float scale, float* scores,
                             float* od, int64_t ostride, KeysT& keys) {
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t gb = std::min<int64_t>(3, G - g0);
    const float* q = qd + g0 * DH;
    float* o = od + g0 * DH;
    (gb == 3   ? attend_heads_tile<DH, 3, KV>
     : gb == 2 ? attend_heads_tile<DH, 2, KV>
               : attend_heads_tile<DH, 1, KV>)(q, qstride, kc, vc, table, L, row, bs, kh, scale,
                                               scores, o, ostride, keys);
    g0 += gb;
  }
}
#endif  // ROSEINFER_AVX512

}  // namespace roseinfer
