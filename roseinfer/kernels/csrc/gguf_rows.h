// The GGUF GEMM's loops for steps of 1-4 rows (few_rows, which gguf_gemm.cpp's driver
// calls; with AVX-512 the one-32-block formats' loop also runs larger steps in tiles of
// up to 8 rows, many_rows_zmm): with AVX-512 on 512-bit registers for the 4- and 8-bit
// formats and Q4_K, else on 256-bit ones.  The accumulators in registers, scales
// converted where they are read, and the same integer dots and fp32 steps, in the same
// order, as the multi-row tiles (so the same bits: a row alone equals the row in a
// batch).  Also the accumulators' start value that the tiles use too.
#pragma once

#include <type_traits>

#include "gguf_decode.h"
#include "gguf_gemm.h"
#include "gguf_tiles.h"
#include "q8_tiles.h"

namespace roseinfer {

#ifdef ROSEINFER_AVX2

// Accumulators' start: -off * the exact sum of the activations of rows [0, MR) over the
// 16-value groups [g, g + n) of xs (stride KH): the dot with q then is the dot with q - off.
template <int MR>
inline void start_at(__m256i (&a)[MR][2], const int32_t* xs, int64_t KH, int64_t g, int n,
                     int32_t off) {
  for (int m = 0; m < MR; ++m) {
    int32_t t = 0;
    if (off)
      for (int i = 0; i < n; ++i) t += xs[m * KH + g + i];
    a[m][0] = a[m][1] = _mm256_set1_epi32(-off * t);
  }
}

// body(panel, acc0, acc1) for panels [p0, p1) of g (panel_bytes apart), MR rows' 16
// columns' fp32 sums (acc0 / acc1[m]: columns 0-7 / 8-15) starting at zero, then stored
// (+ bias) into the rows of y.
template <int MR, class Body>
inline void rows_each_panel(const GgufPanels& g, int64_t panel_bytes, int64_t p0, int64_t p1,
                            const float* bias, float* y, int64_t ldy, Body&& body) {
  const uint8_t* base = g.bytes;
  alignas(32) float out[MR * 16];
  for (int64_t p = p0; p < p1; ++p) {
    __m256 acc0[MR], acc1[MR];
    for (int m = 0; m < MR; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
    body(base + p * panel_bytes, acc0, acc1);
    for (int m = 0; m < MR; ++m) {
      _mm256_store_ps(out + 16 * m, acc0[m]);
      _mm256_store_ps(out + 16 * m + 8, acc1[m]);
    }
    store_tile(out, MR, p * 16, std::min<int64_t>(16, g.N - p * 16), bias, y, ldy);
  }
}

// Rows' pointers into the activations (xq, dx, sx, xs: row strides K, K / 32, K / 16).
struct RowsArgs {
  const int16_t* xq;
  const float* dx;
  const float* sx;
  const int32_t* xs;
};

// The one-32-block loops' prefetch: the block kBlocksAhead on from blk (the next
// panel's, near a panel's end: panels are contiguous).  24 rather than 32 (Zen 5, 2
// threads, one row of Q4_0 2048x8192 from DRAM, alternated): 51.4 against 49.1 GB/s
// while the host's memory read ~52 GB/s, 80.3 against 77.1 while it read ~83; 16 was
// better at ~52 (52.2; the random 1B's qkv / o / down 4% / 5% / 2% faster a layer) but
// worse at ~83 (74.9, and 2 rows 62.9 against 74.1).
constexpr int64_t kBlocksAhead = 24;
template <class F>
inline void prefetch_block_ahead(const uint8_t* blk) {
  for (int64_t i = 0; i < F::kPanel; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + kBlocksAhead * F::kPanel + i),
                 _MM_HINT_T0);
}

// The K-quant loops' prefetch: 32-block jj's share of the super-block
// kSuperBlocksAhead on from psb (panels are contiguous).  3 rather than 4: one row from
// DRAM (Zen 5, 2 threads, alternated) Q6_K 2048x49152 48.7 -> 50.6 GB/s, Q4_K 2048x8192
// 47.5 -> 49.8; the random 1B Q4_K_M's step 15.40 -> 15.14 ms (all while the host's
// memory read ~50 GB/s: not measured in its ~83 GB/s state, which may want more).
constexpr int64_t kSuperBlocksAhead = 3;
template <class F>
inline void prefetch_sb_share(const uint8_t* psb, int jj) {
  constexpr int64_t kShare = F::kPanel / 8;
  const uint8_t* pf = psb + kSuperBlocksAhead * F::kPanel + jj * kShare;
  for (int64_t i = 0; i < kShare; i += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + i), _MM_HINT_T0);
}

// Formats of one 32-block per panel block (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1).
template <class F>
constexpr bool kOneBlock = F::E == 32 && F::HALVES == 1;

// MR rows (1-4) of a one-32-block format: panels [p0, p1) with the accumulators in
// registers and the fp16 scales (and minimums) converted where they are read (no decode
// into a DBlock, no accumulator round trip through memory per block); the same integer
// dots (q - offset: the sums start at -offset * the activations' sum) and the same fp32
// steps in the same order as panels_avx2's tiles (acc = fma(float(dot), dx * d, acc),
// then with a minimum acc = fma(sx, m, acc): scale_add / scale_min_add), so the same
// bits.  Each block prefetches the block kBlocksAhead on (prefetch_block_ahead).
template <class F, int MR>
void rows_panels(const GgufPanels& g, const RowsArgs& r, int64_t p0, int64_t p1,
                 const float* bias, float* y, int64_t ldy) {
  static_assert(kOneBlock<F>, "rows_panels: one 32-block per panel block");
  constexpr Head kHead = F::BITS == 8 ? Head::I8 : Head::NIB;
  const int64_t K = g.K, KB = K / 32;
  rows_each_panel<MR>(g, KB * F::kPanel, p0, p1, bias, y, ldy, [&](const uint8_t* panel, __m256 (&acc0)[MR], __m256 (&acc1)[MR]) {
    for (int64_t j = 0; j < KB; ++j) {
      const uint8_t* blk = panel + j * F::kPanel;
      prefetch_block_ahead<F>(blk);
      const int16_t* xr[MR];
      for (int m = 0; m < MR; ++m) xr[m] = r.xq + m * K + j * 32;
      __m256i a[MR][2];
      start_at<MR>(a, r.xs, K / 16, 2 * j, 2, F::OFFSET);
      if constexpr (F::BITS == 5) steps_q5<MR>(xr, blk, blk + F::Ints::kNib, a);
      else steps_int<MR, 16, kHead>(xr, blk, a);
      const __m128i* h = reinterpret_cast<const __m128i*>(blk + F::kScaleOff);
      const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(h)), d1 = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
      for (int m = 0; m < MR; ++m) {
        const __m256 s = _mm256_set1_ps(r.dx[m * KB + j]);
        acc0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][0]), _mm256_mul_ps(s, d0), acc0[m]);
        acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][1]), _mm256_mul_ps(s, d1), acc1[m]);
        if constexpr (F::kMin) {
          const __m256 t = _mm256_set1_ps(r.sx[m * KB + j]);
          acc0[m] = _mm256_fmadd_ps(t, _mm256_cvtph_ps(_mm_loadu_si128(h + 2)), acc0[m]);
          acc1[m] = _mm256_fmadd_ps(t, _mm256_cvtph_ps(_mm_loadu_si128(h + 3)), acc1[m]);
        }
      }
    }
  });
}

#ifdef ROSEINFER_AVX512
// Steps of 1 to 4 rows on 512-bit registers, straight from the panels (no decoded
// groups: the multi-row tiles' DBlock pass and accumulator round trips through memory
// cost more than the dots at so few rows, and their group-ahead prefetch left DRAM idle
// at the group edges): per panel the 16 columns' fp32 sums of each row in a register,
// per 32-block the rows' exact dots (steps_zmm) and block_step, each block prefetching
// the one kBlocksAhead on.  The same integer dots and fp32 steps in the same order as
// the tiles (tile_blocks_zmm, panels_avx2's), so the same bits.

// body(panel, acc) for panels [p0, p1) of g (panel_bytes apart), MR rows' 16 columns'
// fp32 sums (acc[m]) starting at zero, then stored (+ bias) into the rows of y.
template <int MR, class Body>
inline void rows_each_panel_zmm(const GgufPanels& g, int64_t panel_bytes, int64_t p0,
                                int64_t p1, const float* bias, float* y, int64_t ldy,
                                Body&& body) {
  const uint8_t* base = g.bytes;
  alignas(64) float out[MR * 16];
  for (int64_t p = p0; p < p1; ++p) {
    __m512 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    body(base + p * panel_bytes, acc);
    for (int m = 0; m < MR; ++m) _mm512_store_ps(out + 16 * m, acc[m]);
    store_tile(out, MR, p * 16, std::min<int64_t>(16, g.N - p * 16), bias, y, ldy);
  }
}

// One-32-block formats other than Q5_0 / Q5_1.
template <class F, int MR>
void rows_panels_zmm(const GgufPanels& g, const RowsArgs& r, int64_t p0, int64_t p1,
                     const float* bias, float* y, int64_t ldy) {
  constexpr Head kHead = F::BITS == 8 ? Head::I8 : Head::NIB;
  const int64_t K = g.K, KB = K / 32, KH = K / 16;
  rows_each_panel_zmm<MR>(g, KB * F::kPanel, p0, p1, bias, y, ldy, [&](const uint8_t* panel, __m512 (&acc)[MR]) {
    for (int64_t j = 0; j < KB; ++j) {
      const uint8_t* blk = panel + j * F::kPanel;
      prefetch_block_ahead<F>(blk);
      const int16_t* xr[MR];
      __m512i z[MR];
      for (int m = 0; m < MR; ++m) {
        xr[m] = r.xq + m * K + j * 32;
        z[m] = _mm512_setzero_si512();
        if constexpr (F::OFFSET != 0)
          z[m] = _mm512_set1_epi32(-F::OFFSET * (r.xs[m * KH + 2 * j] + r.xs[m * KH + 2 * j + 1]));
      }
      steps_zmm<MR, 16, kHead>(xr, blk, z);
      const __m256i* h = reinterpret_cast<const __m256i*>(blk + F::kScaleOff);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(h));
      const __m512 mn = F::kMin ? _mm512_cvtph_ps(_mm256_loadu_si256(h + 1)) : d;
      for (int m = 0; m < MR; ++m)
        acc[m] = block_step<F::kMin>(acc[m], z[m], r.dx[m * KB + j], F::kMin ? r.sx[m * KB + j] : 0.f, d, mn);
    }
  });
}

// Q4_K: per super-block the 8 32-blocks' D = d sc and M = -(dmin mn) on 16 columns at
// once (decode_avx2's products), then per 32-block the rows' dots and block_step.
template <class F, int MR>
void rows_kquant_zmm(const GgufPanels& g, const RowsArgs& r, int64_t p0, int64_t p1,
                     const float* bias, float* y, int64_t ldy) {
  static_assert(F::kType == kQ4_K, "rows_kquant_zmm: Q4_K");
  const int64_t K = g.K, KB = K / 32, NSB = K / 256;
  const __m512 neg = _mm512_set1_ps(-0.f);
  rows_each_panel_zmm<MR>(g, NSB * F::kPanel, p0, p1, bias, y, ldy, [&](const uint8_t* panel, __m512 (&acc)[MR]) {
    for (int64_t sb = 0; sb < NSB; ++sb) {
      const uint8_t* psb = panel + sb * F::kPanel;
      const uint8_t* sp = psb + F::kScaleOff;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + 32)));
      __m512 D[8], Mn[8];
      for (int jj = 0; jj < 8; ++jj) {
        __m128i sc, mn;
        kquant_sc_mn(sp, jj, sc, mn);
        D[jj] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
        Mn[jj] = _mm512_xor_ps(neg, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn))));
      }
      for (int jj = 0; jj < 8; ++jj) {
        const int64_t j = sb * 8 + jj;
        prefetch_sb_share<F>(psb, jj);
        const int16_t* xr[MR];
        __m512i z[MR];
        for (int m = 0; m < MR; ++m) xr[m] = r.xq + m * K + j * 32, z[m] = _mm512_setzero_si512();
        steps_zmm<MR, 16, Head::NIB>(xr, psb + jj * 256, z);
        for (int m = 0; m < MR; ++m)
          acc[m] = block_step<true>(acc[m], z[m], r.dx[m * KB + j], r.sx[m * KB + j], D[jj], Mn[jj]);
      }
    }
  });
}

#endif  // ROSEINFER_AVX512

// MR rows (1-4) of Q4_K / Q5_K: panels [p0, p1) with the accumulators in registers; per
// 256-value super-block d and dmin are converted once and the 8 32-blocks' D = d sc and
// M = -(dmin mn) computed together (into L1), then each 32-block adds
// fma(float(dot), dx * D, acc) and then fma(sx, M, .) per row: the same integer dots and
// fp32 steps in the same order as panels_avx2's tiles (scale_min_add), so the same bits.
// Each 32-block prefetches its share of the super-block kSuperBlocksAhead on (panels
// are contiguous).
template <class F, int MR>
void rows_kquant(const GgufPanels& g, const RowsArgs& r, int64_t p0, int64_t p1,
                 const float* bias, float* y, int64_t ldy) {
  static_assert(F::kType == kQ4_K || F::kType == kQ5_K, "rows_kquant: Q4_K / Q5_K");
  const int64_t K = g.K, KB = K / 32, NSB = K / 256;
  alignas(32) float d[16], dmin[16], D[8][16], M[8][16];
  rows_each_panel<MR>(g, NSB * F::kPanel, p0, p1, bias, y, ldy, [&](const uint8_t* panel, __m256 (&acc0)[MR], __m256 (&acc1)[MR]) {
    for (int64_t sb = 0; sb < NSB; ++sb) {
      const uint8_t* psb = panel + sb * F::kPanel;
      const uint8_t* sp = psb + F::kScaleOff;
      load_f16x16(sp, d);
      load_f16x16(sp + 32, dmin);
      for (int jj = 0; jj < 8; ++jj) {
        __m128i sc, mn;
        kquant_sc_mn(sp, jj, sc, mn);
        scale16<false>(d, sc, D[jj]);
        scale16<false>(dmin, mn, M[jj], true);
      }
      for (int jj = 0; jj < 8; ++jj) {
        const int64_t j = sb * 8 + jj;
        prefetch_sb_share<F>(psb, jj);
        const int16_t* xr[MR];
        for (int m = 0; m < MR; ++m) xr[m] = r.xq + m * K + j * 32;
        __m256i a[MR][2];
        start_at<MR>(a, nullptr, K / 16, 2 * j, 2, 0);
        if constexpr (F::BITS == 5) steps_q5<MR>(xr, psb + jj * 256, psb + F::Ints::kNib + jj * 64, a);
        else steps_int<MR, 16, Head::NIB>(xr, psb + jj * 256, a);
        for (int m = 0; m < MR; ++m) {
          const __m256 s = _mm256_set1_ps(r.dx[m * KB + j]), t = _mm256_set1_ps(r.sx[m * KB + j]);
          const __m256 r0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][0]), _mm256_mul_ps(s, _mm256_load_ps(D[jj])), acc0[m]);
          const __m256 r1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][1]), _mm256_mul_ps(s, _mm256_load_ps(D[jj] + 8)), acc1[m]);
          acc0[m] = _mm256_fmadd_ps(t, _mm256_load_ps(M[jj]), r0);
          acc1[m] = _mm256_fmadd_ps(t, _mm256_load_ps(M[jj] + 8), r1);
        }
      }
    }
  });
}

// MR rows (1-4) of Q6_K: panels [p0, p1) with the accumulators in registers; per
// 256-value super-block d is converted once and the 16 halves' scales D = d sc computed
// together (into L1), then each 32-block sums its two 16-value halves per row (q - 32:
// the sums start at -32 * the half's activation sum) and adds fma(float(dot0), dx * D0,
// acc), then fma(float(dot1), dx * D1, .): the same integer dots and fp32 steps in the
// same order as panels_avx2's tiles (q6k_scale), so the same bits.  Each 32-block
// prefetches its share of the super-block kSuperBlocksAhead on (panels are contiguous).
template <int MR>
void rows_q6k(const GgufPanels& g, const RowsArgs& r, int64_t p0, int64_t p1,
              const float* bias, float* y, int64_t ldy) {
  using F = FQ6_K;
  const int64_t K = g.K, KB = K / 32, NSB = K / 256, KH = K / 16;
  alignas(32) float d[16], D[16][16];
  rows_each_panel<MR>(g, NSB * F::kPanel, p0, p1, bias, y, ldy, [&](const uint8_t* panel, __m256 (&acc0)[MR], __m256 (&acc1)[MR]) {
    for (int64_t sb = 0; sb < NSB; ++sb) {
      const uint8_t* psb = panel + sb * F::kPanel;
      const uint8_t* sp = psb + F::kScaleOff;
      load_f16x16(sp + 256, d);
      for (int i = 0; i < 16; ++i)
        scale16<true>(d, _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16 * i)), D[i]);
      for (int jj = 0; jj < 8; ++jj) {
        const int64_t j = sb * 8 + jj;
        prefetch_sb_share<F>(psb, jj);
        __m256i a[2][MR][2];
        for (int h = 0; h < 2; ++h) {
          const int16_t* xr[MR];
          for (int m = 0; m < MR; ++m) xr[m] = r.xq + m * K + j * 32 + 16 * h;
          start_at<MR>(a[h], r.xs, KH, 2 * j + h, 1, 32);
          q6k_half<MR>(xr, psb + jj * 384 + 192 * h, a[h]);
        }
        const float* D0 = D[2 * jj];
        const float* D1 = D[2 * jj + 1];
        for (int m = 0; m < MR; ++m) {
          const __m256 s = _mm256_set1_ps(r.dx[m * KB + j]);
          const __m256 r0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[0][m][0]), _mm256_mul_ps(s, _mm256_load_ps(D0)), acc0[m]);
          const __m256 r1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[0][m][1]), _mm256_mul_ps(s, _mm256_load_ps(D0 + 8)), acc1[m]);
          acc0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[1][m][0]), _mm256_mul_ps(s, _mm256_load_ps(D1)), r0);
          acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[1][m][1]), _mm256_mul_ps(s, _mm256_load_ps(D1 + 8)), r1);
        }
      }
    }
  });
}

// f(std::integral_constant<int, MR>{}) for MR = M, 1 to 4.
template <class Fn>
inline void with_rows(int64_t M, Fn&& f) {
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// Panels [p0, p1) of a step of M <= kFewRows rows by its format's row loop (every
// GgufPanels format has one): with AVX-512 the 512-bit loops for the 4- and 8-bit
// formats and Q4_K; the 256-bit ones for the others and without AVX-512 (5-bit values in
// registers: at most 4 rows).
constexpr int64_t kFewRows = 4;

template <class F>
void few_rows(const GgufPanels& g, const RowsArgs& r, int64_t M, int64_t p0, int64_t p1,
              const float* bias, float* y, int64_t ldy) {
  with_rows(M, [&](auto rows) {
    constexpr int MR = decltype(rows)::value;
#ifdef ROSEINFER_AVX512
    if constexpr (kOneBlock<F> && F::BITS != 5) return rows_panels_zmm<F, MR>(g, r, p0, p1, bias, y, ldy);
    if constexpr (F::kType == kQ4_K) return rows_kquant_zmm<F, MR>(g, r, p0, p1, bias, y, ldy);
#endif
    if constexpr (kOneBlock<F>) {
      rows_panels<F, MR>(g, r, p0, p1, bias, y, ldy);
    } else if constexpr (F::kType == kQ4_K || F::kType == kQ5_K) {
      rows_kquant<F, MR>(g, r, p0, p1, bias, y, ldy);
    } else {
      static_assert(F::kType == kQ6_K, "few_rows: a format without a row loop");
      rows_q6k<MR>(g, r, p0, p1, bias, y, ldy);
    }
  });
}

#ifdef ROSEINFER_AVX512
// f(std::integral_constant<int, MR>{}) for MR = mr, 1 to 8.
template <class Fn>
inline void with_rows8(int64_t mr, Fn&& f) {
  if (mr <= kFewRows) return with_rows(mr, f);
  switch (mr) {
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// Steps of more than kFewRows rows of a one-32-block format (not 5-bit) without AMX tiles:
// rows_panels_zmm's loop for tiles of up to 8 rows, panel by panel (its accumulators in
// registers from the first block to the store; panels_avx2's tiles keep theirs in memory
// and decode each group first), rows in chunks whose activations stay in L2 as there.
// The same bits (rows_panels_zmm's are the tiles'); on Zen 4 the Q8_0 LM head at 16 rows
// ~15% faster, the Q4_1 shapes a few % (docs/performance.md, "Zen 4: 5+ rows straight
// from the panels").
template <class F>
void many_rows_zmm(const GgufPanels& g, const RowsArgs& r, int64_t M, int64_t p0, int64_t p1,
                   const float* bias, float* y, int64_t ldy) {
  static_assert(kOneBlock<F> && F::BITS != 5, "many_rows_zmm: rows_panels_zmm's formats");
  const int64_t K = g.K, KB = K / 32, KH = K / 16;
  const int64_t mc = std::max<int64_t>(8, (int64_t(1) << 17) / K);
  for (int64_t c0 = 0; c0 < M; c0 += mc)
    for (int64_t p = p0; p < p1; ++p)
      for_row_tiles(c0, std::min(M, c0 + mc), 8, [&](int64_t m, int64_t mr) {
        const RowsArgs t{r.xq + m * K, r.dx + m * KB, r.sx + m * KB,
                         r.xs ? r.xs + m * KH : nullptr};
        with_rows8(mr, [&](auto rows) {
          rows_panels_zmm<F, decltype(rows)::value>(g, t, p, p + 1, bias, y + m * ldy, ldy);
        });
      });
}
#endif  // ROSEINFER_AVX512

#endif  // ROSEINFER_AVX2

}  // namespace roseinfer
