// The quantized GGUF formats' GEMM (see gguf_gemm.h): per-format block decoders
// (portable and AVX2, the same values), one inline-asm tile loop over decoded blocks,
// the portable kernel (same results) and the driver.
#include "gguf_gemm.h"

#include <memory>

#include "gguf_amx.h"
#include "gguf_decode.h"
#include "gguf_rows.h"
#include "gguf_tiles.h"
#include "parallel_chunks.h"
#include "q8_tiles.h"
#include "weight_memory.h"

namespace roseinfer {

namespace {

constexpr int kMaxSmallRows = 5;  // rows per register tile

// This thread's decoded-block buffer of at least n blocks (reused: no allocation, no
// page faults per call).
DBlock* decode_buffer(int64_t n) {
  thread_local std::vector<DBlock> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// Portable kernel: one row and column at a time, the same integer dots and fp32 steps.
template <class F>
void panels_scalar(const GgufPanels& g, const int16_t* xq, const float* dx, const float* sx,
                   int64_t M, int64_t p0, int64_t p1, const float* bias, float* y,
                   int64_t ldy) {
  const int64_t K = g.K, KB = K / 32, NSB = K / F::E, BPS = F::E / 32;
  DBlock* blk = decode_buffer(BPS);
  std::vector<float> acc(M * 16);
  for (int64_t p = p0; p < p1; ++p) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t sb = 0; sb < NSB; ++sb) {
      const uint8_t* psb = g.bytes + (p * NSB + sb) * F::kPanel;
      for (int jj = 0; jj < BPS; ++jj) decode_scalar<F>(psb, jj, blk[jj]);
      for (int64_t m = 0; m < M; ++m)
        for (int jj = 0; jj < BPS; ++jj) {
          const int64_t j = sb * BPS + jj;
          const int16_t* xr = xq + m * K + j * 32;
          const DBlock& o = blk[jj];
          for (int c = 0; c < 16; ++c) {
            int32_t dot[2] = {0, 0};
            for (int k = 0; k < 32; ++k)
              dot[F::HALVES == 2 ? k / 16 : 0] += int32_t(xr[k]) * static_cast<int8_t>(o.qp[(k / 2) * 32 + 2 * c + k % 2]);
            float& a = acc[m * 16 + c];
            a = std::fma(static_cast<float>(dot[0]), dx[m * KB + j] * o.d0[c], a);
            if (F::HALVES == 2) a = std::fma(static_cast<float>(dot[1]), dx[m * KB + j] * o.d1[c], a);
            if (F::kMin) a = std::fma(sx[m * KB + j], o.m[c], a);
          }
        }
    }
    const int64_t n0 = p * 16;
    store_tile(acc.data(), M, n0, std::min<int64_t>(16, g.N - n0), bias, y, ldy);
  }
}

#ifdef ROSEINFER_AVX2
// acc[m] += dot * (dx * d) for 16 columns.
template <int MR>
inline void scale_add(float* acc, const __m256i (&a)[MR][2], const float* dx, int64_t KB,
                      int64_t j, const float* d) {
  const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
  for (int m = 0; m < MR; ++m) {
    const __m256 s = _mm256_set1_ps(dx[m * KB + j]);
    float* ar = acc + m * 16;
    _mm256_store_ps(ar, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][0]), _mm256_mul_ps(s, d0), _mm256_load_ps(ar)));
    _mm256_store_ps(ar + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][1]), _mm256_mul_ps(s, d1), _mm256_load_ps(ar + 8)));
  }
}

// acc[m] += dot * (dx * d), then += sx * mn (one pass over the accumulators).
template <int MR>
inline void scale_min_add(float* acc, const __m256i (&a)[MR][2], const float* dx,
                          const float* sx, int64_t KB, int64_t j, const float* d,
                          const float* mn) {
  const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
  const __m256 m0 = _mm256_loadu_ps(mn), m1 = _mm256_loadu_ps(mn + 8);
  for (int m = 0; m < MR; ++m) {
    const __m256 s = _mm256_set1_ps(dx[m * KB + j]), t = _mm256_set1_ps(sx[m * KB + j]);
    float* ar = acc + m * 16;
    const __m256 r0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][0]), _mm256_mul_ps(s, d0), _mm256_load_ps(ar));
    const __m256 r1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][1]), _mm256_mul_ps(s, d1), _mm256_load_ps(ar + 8));
    _mm256_store_ps(ar, _mm256_fmadd_ps(t, m0, r0));
    _mm256_store_ps(ar + 8, _mm256_fmadd_ps(t, m1, r1));
  }
}

// One row tile's share of a decoded group: rows [0, MR) of xq (stride K), dx, sx (stride
// K/32) and xs (stride K/16) x decoded blocks [j0, j0 + nb) into acc [MR][16].  wide:
// the blocks' integers are int16 (decode_avx2).  pf: bytes to prefetch, pf_step per
// block (the first tile of a group streams the next group's bytes in).
struct TileArgs {
  const int16_t* xq;
  const float *dx, *sx;
  const int32_t* xs;  // exact sums of each 16 activations (the offsets' start)
  int64_t K;
  const DBlock* blk;
  int64_t j0, nb;
  float* acc;
  bool wide;
  const uint8_t* pf;
  int64_t pf_step;
};

inline void prefetch_share(const uint8_t* pf, int64_t step, int64_t b) {
  if (pf) prefetch_bytes(pf + b * step, step);
}

// Q6_K, both 16-value halves in one pass over the accumulators: acc[m] += float(h0[m])
// * (dx * D0), then += float(h1[m]) * (dx * D1), 16 columns.
template <int MR>
inline void q6k_scale(float* acc, const __m256i (&h0)[MR][2], const __m256i (&h1)[MR][2],
                      const float* dx, int64_t KB, int64_t j, const float* d0, const float* d1) {
  const __m256 d00 = _mm256_loadu_ps(d0), d01 = _mm256_loadu_ps(d0 + 8);
  const __m256 d10 = _mm256_loadu_ps(d1), d11 = _mm256_loadu_ps(d1 + 8);
  for (int m = 0; m < MR; ++m) {
    const __m256 sc = _mm256_set1_ps(dx[m * KB + j]);
    float* ar = acc + m * 16;
    __m256 r0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0[m][0]), _mm256_mul_ps(sc, d00), _mm256_load_ps(ar));
    __m256 r1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0[m][1]), _mm256_mul_ps(sc, d01), _mm256_load_ps(ar + 8));
    r0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1[m][0]), _mm256_mul_ps(sc, d10), r0);
    r1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1[m][1]), _mm256_mul_ps(sc, d11), r1);
    _mm256_store_ps(ar, r0);
    _mm256_store_ps(ar + 8, r1);
  }
}

// Q6_K: per 16-value half, the dots with q - 32 (wide: decoded as such; else the dots
// with the unsigned q from -32 * the half's activation sum: the same integers), then
// scaled.
template <int MR>
void tile_q6k(const TileArgs& t) {
  // Locals, not t's fields: the asm's memory clobber would reload those every block.
  const int16_t* const xq = t.xq;
  const float* const dx = t.dx;
  const int32_t* const xs = t.xs;
  const int64_t K = t.K, KB = K / 32, KH = K / 16, j0 = t.j0, nb = t.nb;
  const DBlock* const blk = t.blk;
  float* const acc = t.acc;
  const bool wide = t.wide;
  const uint8_t* const pf = t.pf;
  const int64_t pf_step = t.pf_step;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_share(pf, pf_step, b);
    const int64_t j = j0 + b;
    const DBlock& o = blk[b];
    if (wide) {
      // Each half scaled as soon as it is summed (the same two fp32 steps in the same
      // order): one half's accumulators live at a time, no spills around the asm.
      for (int h = 0; h < 2; ++h) {
        const int16_t* xr[MR];
        for (int m = 0; m < MR; ++m) xr[m] = xq + m * K + j * 32 + 16 * h;
        __m256i a[MR][2];
        start_at<MR>(a, xs, KH, 2 * j + h, 1, 0);
        steps_int<MR, 8, Head::I16>(xr, o.qp + 512 * h, a);
        scale_add<MR>(acc, a, dx, KB, j, h ? o.d1 : o.d0);
      }
      continue;
    }
    __m256i a[2][MR][2];
    for (int h = 0; h < 2; ++h) {
      const int16_t* xr[MR];
      for (int m = 0; m < MR; ++m) xr[m] = xq + m * K + j * 32 + 16 * h;
      start_at<MR>(a[h], xs, KH, 2 * j + h, 1, 32);
      q6k_half<MR>(xr, o.qp + 192 * h, a[h]);
    }
    q6k_scale<MR>(acc, a[0], a[1], dx, KB, j, o.d0, o.d1);
  }
}

#ifdef ROSEINFER_AVX512
// tile_blocks on 512-bit registers for decoded (wide) blocks and the 4- and 8-bit
// formats: one accumulator register per row from start to scaling, and scale_add /
// scale_min_add's fp32 steps (Q6_K: tile_q6k's wide steps, per half) on the 16 columns at
// once (the same operations per column, in the same order: the same bits).
template <class F, int MR>
void tile_blocks_zmm(const TileArgs& t) {
  const int16_t* const xq = t.xq;  // locals: see tile_q6k
  const float *const dx = t.dx, *const sx = t.sx;
  const int32_t* const xs = t.xs;
  const int64_t K = t.K, KB = K / 32, KH = K / 16, j0 = t.j0, nb = t.nb;
  const DBlock* const blk = t.blk;
  float* const acc = t.acc;
  const bool wide = t.wide;
  const int32_t off = wide ? 0 : F::OFFSET;
  constexpr Head kHead = F::BITS == 8 ? Head::I8 : Head::NIB;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_share(t.pf, t.pf_step, b);
    const int64_t j = j0 + b;
    const DBlock& o = blk[b];
    const int16_t* xr[MR];
    __m512i z[MR];
    for (int m = 0; m < MR; ++m) {
      xr[m] = xq + m * K + j * 32;
      z[m] = _mm512_set1_epi32(off ? -off * (xs[m * KH + 2 * j] + xs[m * KH + 2 * j + 1]) : 0);
    }
    if constexpr (F::HALVES == 2) {  // Q6_K, decoded: each 16-value half scaled alone
      for (int h = 0; h < 2; ++h) {
        const int16_t* xh[MR];
        for (int m = 0; m < MR; ++m) xh[m] = xr[m] + 16 * h, z[m] = _mm512_setzero_si512();
        steps_zmm<MR, 8, Head::I16>(xh, o.qp + 512 * h, z);
        const __m512 d = _mm512_loadu_ps(h ? o.d1 : o.d0);
        for (int m = 0; m < MR; ++m)
          _mm512_storeu_ps(acc + m * 16, block_step<false>(_mm512_loadu_ps(acc + m * 16), z[m],
                                                           dx[m * KB + j], 0.f, d, d));
      }
      continue;
    }
    if (wide) steps_zmm<MR, 16, Head::I16>(xr, o.qp, z);
    else if constexpr (F::BITS != 5) steps_zmm<MR, 16, kHead>(xr, o.qp, z);
    const __m512 d = _mm512_loadu_ps(o.d0);
    const __m512 mn = F::kMin ? _mm512_loadu_ps(o.m) : d;
    for (int m = 0; m < MR; ++m)
      _mm512_storeu_ps(acc + m * 16, block_step<F::kMin>(_mm512_loadu_ps(acc + m * 16), z[m],
                                                         dx[m * KB + j], F::kMin ? sx[m * KB + j] : 0.f, d, mn));
  }
}
#endif  // ROSEINFER_AVX512

template <class F, int MR>
void tile_blocks(const TileArgs& t) {
#ifdef ROSEINFER_AVX512
  if (t.wide || (F::BITS != 5 && F::BITS != 6)) return tile_blocks_zmm<F, MR>(t);
#endif
  if constexpr (F::BITS == 6) {
    tile_q6k<MR>(t);
  } else {
    const int64_t KB = t.K / 32;
    static_assert(F::HALVES == 1, "two scales per 32-block: Q6_K only");
    // wide: decoded int16 blocks (q - offset); else every format reads its packed
    // weights (5 bits: at most 4 rows, panels_avx2), q - offset from the start.
    constexpr Head kHead = F::BITS == 8 ? Head::I8 : Head::NIB;
    const int16_t* const xq = t.xq;  // locals: see tile_q6k
    const float *const dx = t.dx, *const sx = t.sx;
    const int32_t* const xs = t.xs;
    const int64_t K = t.K, j0 = t.j0, nb = t.nb;
    const DBlock* const blk = t.blk;
    float* const acc = t.acc;
    const bool wide = t.wide;
    const uint8_t* const pf = t.pf;
    const int64_t pf_step = t.pf_step;
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_share(pf, pf_step, b);
      const int64_t j = j0 + b;
      const DBlock& o = blk[b];
      const int16_t* xr[MR];
      for (int m = 0; m < MR; ++m) xr[m] = xq + m * K + j * 32;
      __m256i a[MR][2];
      start_at<MR>(a, xs, K / 16, 2 * j, 2, wide ? 0 : F::OFFSET);
      if (wide) {
        steps_int<MR, 16, Head::I16>(xr, o.qp, a);
      } else if constexpr (F::BITS == 5) {
        if constexpr (MR <= 4) steps_q5<MR>(xr, o.qp, o.hp, a);
      } else {
        steps_int<MR, 16, kHead>(xr, o.qp, a);
      }
      if constexpr (F::kMin) scale_min_add<MR>(acc, a, dx, sx, KB, j, o.d0, o.m);
      else scale_add<MR>(acc, a, dx, KB, j, o.d0);
    }
  }
}

template <class F>
void tile_rows(int64_t mr, const TileArgs& t) {
#ifdef ROSEINFER_AVX512
  if (mr > kMaxSmallRows) {  // tiles of up to 8 rows (tile_max): the 512-bit loops
    if (mr == 6) tile_blocks_zmm<F, 6>(t);
    else if (mr == 7) tile_blocks_zmm<F, 7>(t);
    else tile_blocks_zmm<F, 8>(t);
    return;
  }
#endif
  switch (mr) {
    case 1: tile_blocks<F, 1>(t); break;
    case 2: tile_blocks<F, 2>(t); break;
    case 3: tile_blocks<F, 3>(t); break;
    case 4: tile_blocks<F, 4>(t); break;
    default: tile_blocks<F, 5>(t); break;
  }
}

// Rows per register tile: 5 (the 256-bit loops' accumulators fill the 16 registers; 5
// bits in registers: 4); with AVX-512, 8 for the loops on 512-bit registers (4- and
// 8-bit values, decoded 5- and 6-bit blocks).
template <class F>
constexpr int64_t tile_max(bool wide) {
#ifdef ROSEINFER_AVX512
  if (F::BITS == 4 || F::BITS == 8 || wide) return 8;
#endif
  return wide || F::BITS != 5 ? kMaxSmallRows : kMaxSmallRows - 1;
}

// Panels [p0, p1), rows in chunks whose activations stay in L2: per panel, groups of
// 32-blocks are decoded (8 to int16 in L1, else 32: scales and pointers), then every
// row tile of the chunk adds their share into its accumulators (acc [chunk rows][16]).
// planes (AMX: the activations' byte planes in tile order, split_tiles of gguf_amx.h, or
// null): whole 16-row tiles of each chunk run on the tiles, the other rows as below.
template <class F>
void panels_avx2(const GgufPanels& g, const int16_t* xq, const float* dx, const float* sx,
                 const int32_t* xs, int64_t M, int64_t p0, int64_t p1, const float* bias,
                 float* y, int64_t ldy, const uint8_t* planes) {
  const int64_t K = g.K, KB = K / 32, BPS = F::E / 32;
  // 32-blocks per decoded group (multiples of 8: K % 256 == 0 for K-quants): 8 when
  // decoded to int16 (L1), else 32 (longer runs of each tile's activation rows).
  constexpr int64_t kWideGroup = 8, kGroupMax = 32;
  DBlock* blk = decode_buffer(kGroupMax);
  // AMX: chunks of whole tiles (a panel is decoded once per chunk), their bytes in L2.
  const int64_t mc = planes ? std::max<int64_t>(64, (int64_t(1) << 19) / K / kAmxRows * kAmxRows)
                            : std::max<int64_t>(8, (int64_t(1) << 17) / K);
  thread_local std::vector<float> acc_buf;
  if (static_cast<int64_t>(acc_buf.size()) < mc * 16 + 16) acc_buf.resize(mc * 16 + 16);
  float* acc = acc_buf.data() + (16 - reinterpret_cast<uintptr_t>(acc_buf.data()) % 64 / 4) % 16;
  const uint8_t* base = g.bytes;
  const int64_t panel_bytes = K / F::E * F::kPanel;
  // 5 bits in registers: tiles of up to 4 rows (two registers hold the running bit-4
  // words).
  constexpr int64_t kSmall = F::BITS == 5 ? kMaxSmallRows - 1 : kMaxSmallRows;
  for (int64_t c0 = 0; c0 < M; c0 += mc) {
    const int64_t c1 = std::min(M, c0 + mc);
    const int64_t tiles = planes ? (c1 - c0) / kAmxRows : 0;
    const int64_t v0 = c0 + tiles * kAmxRows;  // the vector loops' rows: [v0, c1)
    // More than one row tile of a 5- or 6-bit format: decode the integers to int16 once
    // for all of them (the same integers as widening them in registers per tile).
    const bool wide = (F::BITS == 5 || F::BITS == 6) && c1 - v0 > kSmall;
    const int64_t kGroup = wide ? kWideGroup : kGroupMax;
    const int64_t kGroupBytes = kGroup / (F::E / 32) * F::kPanel;
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = base + p * panel_bytes;
      const int64_t n0 = p * 16, nc = std::min<int64_t>(16, g.N - n0);
#ifdef ROSEINFER_AMX
      if (tiles) {
        if constexpr (F::HALVES == 1)
          panel_amx<F>(panel, tiles, planes + c0 / kAmxRows * KB * kPlaneBlock, dx + c0 * KB,
                       sx + c0 * KB, K, n0, nc, bias, y + c0 * ldy, ldy);
      }
#endif
      if (v0 == c1) continue;
      std::fill(acc, acc + (c1 - v0) * 16, 0.f);
      for (int64_t j0 = 0; j0 < KB; j0 += kGroup) {
        const int64_t nb = std::min(kGroup, KB - j0);
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t j = j0 + b;
          decode_avx2<F>(panel + (j / BPS) * F::kPanel, static_cast<int>(j % BPS), blk[b], wide);
        }
        // The next group's bytes (the next panel's after the last group), spread over
        // the first tile's blocks.
        const uint8_t* next = panel + (j0 / BPS) * F::kPanel + kGroupBytes;
        for_row_tiles(v0, c1, tile_max<F>(wide), [&](int64_t m, int64_t mr) {
          const TileArgs t{xq + m * K, dx + m * KB, sx + m * KB, xs ? xs + m * (K / 16) : nullptr,
                           K, blk, j0, nb, acc + (m - v0) * 16, wide, m == v0 ? next : nullptr,
                           (kGroupBytes / nb + 63) / 64 * 64};
          tile_rows<F>(mr, t);
        });
      }
      store_tile(acc, c1 - v0, n0, nc, bias, y + v0 * ldy, ldy);
    }
  }
}
#endif  // ROSEINFER_AVX2

template <class F>
void run_format(const GgufPanels& g, const int16_t* xq, const float* dx, const float* sx,
                int64_t M, const float* bias, float* y, int64_t ldy, bool portable) {
  const int64_t NP = (g.N + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / (M * g.K * 16));
  // AVX2, formats with an offset: each 16 activations' exact sum (the accumulators
  // start at -offset * the block's: the dots with q - offset from those with q).
  std::vector<int32_t> xs;
  if (F::OFFSET != 0 && !portable) {
    xs.resize(M * (g.K / 16));
    for (int64_t i = 0; i < M * (g.K / 16); ++i) {
      int32_t t = 0;
      for (int k = 0; k < 16; ++k) t += xq[i * 16 + k];
      xs[i] = t;
    }
  }
  // AMX (steps of kAmxMinRows rows or more): the activations' byte planes in tile order.
  std::vector<uint8_t> planes;
#ifdef ROSEINFER_AMX
  const bool amx = !portable && F::HALVES == 1 && M >= kAmxMinRows && amx_permitted();
  if (amx) {
    planes.resize(M / kAmxRows * (g.K / 32) * kPlaneBlock);
    split_tiles(xq, M, g.K, planes.data());
  }
#endif
  auto body = [&](int64_t p0, int64_t p1) {
#ifdef ROSEINFER_AVX2
    const int32_t* xsp = xs.empty() ? nullptr : xs.data();
    if (!portable && M <= kFewRows)
      return few_rows<F>(g, RowsArgs{xq, dx, sx, xsp}, M, p0, p1, bias, y, ldy);
#ifdef ROSEINFER_AVX512
    if constexpr (kOneBlock<F> && F::BITS != 5)
      if (!portable && planes.empty())
        return many_rows_zmm<F>(g, RowsArgs{xq, dx, sx, xsp}, M, p0, p1, bias, y, ldy);
#endif
#ifdef ROSEINFER_AMX
    std::unique_ptr<TileScope> tiles_on;
    if (amx) tiles_on = std::make_unique<TileScope>(gguf_tile_config());
#endif
    if (!portable)
      return panels_avx2<F>(g, xq, dx, sx, xsp, M, p0, p1, bias, y, ldy,
                            planes.empty() ? nullptr : planes.data());
#endif
    panels_scalar<F>(g, xq, dx, sx, M, p0, p1, bias, y, ldy);
  };
  parallel_panels(NP, grain, M, kFewRows, body);
}

}  // namespace

GgufPanels::GgufPanels(int64_t type_, const std::vector<const uint8_t*>& rows, int64_t K_)
    : type(type_), N(static_cast<int64_t>(rows.size())), K(K_) {
  const bool ok = with_format(type, [&](auto f) {
    using F = decltype(f);
    TORCH_CHECK(K % F::E == 0, "GgufPanels: K = ", K, " is not a multiple of ", F::E);
    const int64_t NSB = K / F::E, NP = (N + 15) / 16;
    packed = weight_zeros({NP * NSB * F::kPanel}, at::kByte);
    uint8_t* out = packed.data_ptr<uint8_t>();
    at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int c = 0; c < 16 && p * 16 + c < N; ++c) {
          const uint8_t* row = rows[p * 16 + c];
          for (int64_t sb = 0; sb < NSB; ++sb) {
            const uint8_t* s = row + sb * F::kStored;
            uint8_t* psb = out + (p * NSB + sb) * F::kPanel;
            for (int e = 0; e < F::E; ++e) F::Ints::put(psb, c, e, F::stored_q(s, e));
            F::pack_scales(s, psb + F::kScaleOff, c);
          }
        }
    });
  });
  TORCH_CHECK(ok, "GgufPanels: unsupported type ", type);
  bytes = packed.data_ptr<uint8_t>();
}

void GgufPanels::run(const int16_t* xq, const float* dx, const float* sx, int64_t M,
                     const float* bias, float* y, int64_t ldy, bool portable) const {
  if (M <= 0 || N == 0) return;
  with_format(type, [&](auto f) {
    run_format<decltype(f)>(*this, xq, dx, sx, M, bias, y, ldy, portable);
  });
}

}  // namespace roseinfer
