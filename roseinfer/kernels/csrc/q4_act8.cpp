// Q4_1 / Q4_0 weights x int8 activations (see q4_act8.h): packing, the AVX2 kernel (vpmaddubsw
// into int16, one vpmaddwd per 16-value half), the 512-bit one (vpdpbusd), the portable
// kernel (same results) and the driver; the activations are quantized by act_quant.h.
#include "q4_act8.h"

#include <cstring>
#include <memory>

#include "act_quant.h"
#include "parallel_chunks.h"
#include "q4_act8_layout.h"
#include "q8_tiles.h"
#include "weight_memory.h"

namespace roseinfer {

namespace {

using namespace act8;  // the layout's constants
constexpr int64_t kNibMaxRows = 4;  // up to this many rows read the nibbles
#ifdef ROSEINFER_AVX512
constexpr int64_t kTileRows = 8;  // rows per register tile (32 registers)
#else
constexpr int64_t kTileRows = 5;
#endif

// Byte of weight (column c, k) in a block of the bytes layout.
inline int64_t byte_of(int c, int k) {
  return (k / 4) * kStepBytes + (c / 8) * 32 + (c % 8) * 4 + k % 4;
}
inline int weight_at(const uint8_t* blk, bool nib, int c, int k) {
  const int64_t b = byte_of(c, k);
  if (!nib) return blk[b];
  const int64_t within = b % kStepBytes;
  const uint8_t v = blk[(k / 4) * kNibStep + within % 32];
  return within < 32 ? (v & 15) : (v >> 4);
}
inline float scale_at(const uint8_t* blk, bool nib, int which, int c) {  // 0: d, 1: m
  if (nib) return half_at(blk + kNibScale + 32 * which + 2 * c);
  float v;
  std::memcpy(&v, blk + kBytesScale + 64 * which + 4 * c, 4);
  return v;
}

// Portable kernel: one output element at a time, the same fp operations.
void panels_scalar(const int8_t* xq, const float* dx, const float* sx, int64_t M, int64_t K,
                   const uint8_t* wp, bool nib, int offset, int64_t p0, int64_t p1,
                   const float* bias, float* y, int64_t N) {
  const int64_t KB = K / kQ8Block, KH = 2 * KB, bb = block_bytes(nib, offset == 0);
  float acc[kQ8Panel];
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t m = 0; m < M; ++m) {
      for (int c = 0; c < kQ8Panel; ++c) acc[c] = 0.f;
      for (int64_t j = 0; j < KB; ++j) {
        const uint8_t* blk = wp + (p * KB + j) * bb;
        const int8_t* xr = xq + m * K + j * kQ8Block;
        const float d0 = dx[m * KH + 2 * j], d1 = dx[m * KH + 2 * j + 1];
        for (int c = 0; c < kQ8Panel; ++c) {
          int32_t dot[2] = {0, 0};
          for (int k = 0; k < kQ8Block; ++k)
            dot[k / 16] += int32_t(xr[k]) * (weight_at(blk, nib, c, k) - offset);
          float t = static_cast<float>(dot[0]) * d0;
          t = std::fma(static_cast<float>(dot[1]), d1, t);
          acc[c] = std::fma(t, scale_at(blk, nib, 0, c), acc[c]);
          if (offset == 0) acc[c] = std::fma(sx[m * KB + j], scale_at(blk, nib, 1, c), acc[c]);
        }
      }
      const int64_t n0 = p * kQ8Panel;
      store_tile(acc, 1, n0, std::min<int64_t>(kQ8Panel, N - n0), bias, y + m * N, N);
    }
  }
}

#ifdef ROSEINFER_AVX2
// The integer part of one 32-block for MR rows x 16 columns, in inline asm (GCC spills
// an intrinsics version): 8 steps of four k; per step the 16 columns' weights (two
// vectors of 8 columns x 4 unsigned bytes) meet each row's four int8 activations,
// broadcast, in vpmaddubsw (int16 pairs) and add up in int16 accumulators.
#define A8_HEAD_BYTES \
  "1:\n\tprefetcht0 2048(%[w])\n\tvmovdqu (%[w]), %%ymm12\n\tvmovdqu 32(%[w]), %%ymm13\n\t"
#define A8_HEAD_NIB                                                                       \
  "1:\n\tprefetcht0 1024(%[w])\n\tvmovdqu (%[w]), %%ymm12\n\tvpsrlw $4, %%ymm12, %%ymm13\n\t" \
  "vpand %[mask], %%ymm12, %%ymm12\n\tvpand %[mask], %%ymm13, %%ymm13\n\t"
// Tails: a half is four steps (16 activation bytes).
#define A8_TAIL_BYTES "add $64, %[w]\n\tadd $4, %[s]\n\tcmp $16, %[s]\n\tjne 1b\n\t"
#define A8_TAIL_NIB "add $32, %[w]\n\tadd $4, %[s]\n\tcmp $16, %[s]\n\tjne 1b\n\t"
#ifdef ROSEINFER_VNNI
// VNNI: vpdpbusd adds each column's four products straight into int32 accumulators
// (the block's exact dots: no int16 stage, no widening afterwards).
#define A8_ROW(m)                                         \
  "vpbroadcastd (%[x" #m "],%[s]), %%ymm14\n\t"           \
  RI_VNNI "vpdpbusd %%ymm14, %%ymm12, %[a" #m "0]\n\t"    \
  RI_VNNI "vpdpbusd %%ymm14, %%ymm13, %[a" #m "1]\n\t"
#else
#define A8_ROW(m)                                  \
  "vpbroadcastd (%[x" #m "],%[s]), %%ymm14\n\t"    \
  "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"       \
  "vpaddw %%ymm15, %[a" #m "0], %[a" #m "0]\n\t"   \
  "vpmaddubsw %%ymm14, %%ymm13, %%ymm14\n\t"       \
  "vpaddw %%ymm14, %[a" #m "1], %[a" #m "1]\n\t"
#endif

#ifdef ROSEINFER_AVX512
// How far ahead the nibble loop fetches (bytes; 12 32-blocks of a panel): from DRAM, one
// row's gate/up read 3-4% faster than at 1,024 (Zen 5, 2 threads; the 1B's 2048x16384
// Q4_0 48.4 -> 50.2 GB/s, the default model's 576x3072 Q4_1 37.4 -> 38.9, medians of 8
// alternated rounds, the host's memory at ~50 GB/s; in the default model's steps 23.9 ->
// 22.7 us a layer).
constexpr int64_t kNibAhead = 3072;

// One 32-block on 512-bit registers: a step's 16 columns x 4 unsigned weights in one
// register, one int32 accumulator per row and 16-value half (z[h]: steps 4h .. 4h + 3),
// vpdpbusd (the halves' exact dots).  Nibbles: two steps (64 bytes) at once, their low
// (bytes 0-31 of a step) and high (32-63) nibbles regrouped per step.
template <int MR, bool NIB>
inline void block_int_zmm(const int8_t* const* xr, const uint8_t* wp, __m512i (&z)[2][MR]) {
  const __m512i nib = _mm512_set1_epi8(15);
#pragma GCC unroll 4
  for (int s = 0; s < 8; s += 2) {
    __m512i w0, w1;
    if constexpr (NIB) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + kNibStep * s + kNibAhead), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(wp + kNibStep * s);
      const __m512i lo = _mm512_and_si512(v, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      w0 = _mm512_shuffle_i64x2(lo, hi, 0x44);
      w1 = _mm512_shuffle_i64x2(lo, hi, 0xEE);
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(wp + kStepBytes * s + 2048), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp + kStepBytes * s + 2112), _MM_HINT_T0);
      w0 = _mm512_loadu_si512(wp + kStepBytes * s);
      w1 = _mm512_loadu_si512(wp + kStepBytes * s + kStepBytes);
    }
    __m512i(&zh)[MR] = z[s / 4];
    for (int m = 0; m < MR; ++m) {
      zh[m] = _mm512_dpbusd_epi32(zh[m], w0, bcast4(xr[m] + 4 * s));
      zh[m] = _mm512_dpbusd_epi32(zh[m], w1, bcast4(xr[m] + 4 * s + 4));
    }
  }
}

// tile (below) on 512-bit registers: per row two integer accumulators (one per 16-value
// half) and one fp32 one (16 columns), the same fp32 operations per column in the same
// order (the same bits).
template <int MR, bool NIB, bool OFF>
void tile_zmm(const int8_t* xq, const float* dx, const float* sx, const int32_t* xs, int64_t K,
              const uint8_t* w, int64_t n0, const float* bias, float* y, int64_t N) {
  const int64_t KB = K / kQ8Block, KH = 2 * KB;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < KB; ++j) {
    __m512i z[2][MR];
    const int8_t* xr[MR];
    for (int m = 0; m < MR; ++m) {
      // Q4_0: the dots with q - 8 start at -8 * the halves' exact activation sums.
      for (int h = 0; h < 2; ++h) z[h][m] = _mm512_set1_epi32(OFF ? -8 * xs[m * KH + 2 * j + h] : 0);
      xr[m] = xq + m * K + j * kQ8Block;
    }
    const uint8_t* blk = w + j * block_bytes(NIB, !OFF);
    block_int_zmm<MR, NIB>(xr, blk, z);
    __m512 dw, mw;
    block_scales<NIB, OFF>(blk, dw, mw);
    for (int m = 0; m < MR; ++m)
      acc[m] = block_step<OFF>(acc[m], z[0][m], z[1][m], dx[m * KH + 2 * j], dx[m * KH + 2 * j + 1],
                               sx[m * KB + j], dw, mw);
  }
  alignas(64) float out[MR * kQ8Panel];
  for (int m = 0; m < MR; ++m) _mm512_store_ps(out + m * kQ8Panel, acc[m]);
  store_tile(out, MR, n0, std::min<int64_t>(kQ8Panel, N - n0), bias, y, N);
}
#endif  // ROSEINFER_AVX512

// One 16-value half of a block into a: its four steps from wp, the rows' 16 activations
// from xr.
template <int MR, bool NIB>
inline void block_half(const int8_t* const* xr, const uint8_t* wp, __m256i (&a)[MR][2]) {
  int64_t s = 0;
  const __m256i mask = _mm256_set1_epi8(15);
  if constexpr (NIB) {
    ROWTILE_ASM(A8_HEAD_NIB, A8_HEAD_NIB, A8_ROW, A8_TAIL_NIB)
  } else {
    ROWTILE_ASM(A8_HEAD_BYTES, A8_HEAD_BYTES, A8_ROW, A8_TAIL_BYTES)
  }
}
#undef A8_HEAD_BYTES
#undef A8_HEAD_NIB
#undef A8_TAIL_BYTES
#undef A8_TAIL_NIB
#undef A8_ROW

// Rows [0, MR) x one panel (w: its first block) into y (+ bias): per row and 16-value
// half the int16 pair sums widened to its exact dots (VNNI: int32 already; OFF, Q4_0:
// from -8 * the half's activation sum), then block_step's fp32 steps on 8 columns at a
// time (t through memory between the halves: the registers hold one half's sums).
template <int MR, bool NIB, bool OFF>
void tile(const int8_t* xq, const float* dx, const float* sx, const int32_t* xs, int64_t K,
          const uint8_t* w, int64_t n0, const float* bias, float* y, int64_t N) {
  const int64_t KB = K / kQ8Block, KH = 2 * KB;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  alignas(64) float acc[MR * kQ8Panel] = {};
  alignas(64) float t[MR * kQ8Panel];
  for (int64_t j = 0; j < KB; ++j) {
    const uint8_t* blk = w + j * block_bytes(NIB, !OFF);
    for (int h = 0; h < 2; ++h) {
      const int8_t* xr[MR];
      __m256i a[MR][2];
      for (int m = 0; m < MR; ++m) {
        xr[m] = xq + m * K + j * kQ8Block + 16 * h;
        a[m][0] = a[m][1] = _mm256_setzero_si256();
      }
      block_half<MR, NIB>(xr, blk + 4 * h * (NIB ? kNibStep : kStepBytes), a);
      for (int m = 0; m < MR; ++m) {
#ifdef ROSEINFER_VNNI
        __m256i i0 = a[m][0], i1 = a[m][1];  // int32 already
#else
        __m256i i0 = _mm256_madd_epi16(a[m][0], ones), i1 = _mm256_madd_epi16(a[m][1], ones);
#endif
        if constexpr (OFF) {
          const __m256i st = _mm256_set1_epi32(-8 * xs[m * KH + 2 * j + h]);
          i0 = _mm256_add_epi32(i0, st), i1 = _mm256_add_epi32(i1, st);
        }
        const __m256 d = _mm256_set1_ps(dx[m * KH + 2 * j + h]);
        float* tr = t + m * kQ8Panel;
        if (h == 0) {
          _mm256_store_ps(tr, _mm256_mul_ps(_mm256_cvtepi32_ps(i0), d));
          _mm256_store_ps(tr + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(i1), d));
        } else {
          _mm256_store_ps(tr, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), d, _mm256_load_ps(tr)));
          _mm256_store_ps(tr + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), d, _mm256_load_ps(tr + 8)));
        }
      }
    }
    __m256 dw0, dw1, mw0 = _mm256_setzero_ps(), mw1 = _mm256_setzero_ps();
    if constexpr (NIB) {
      const __m128i* hp = reinterpret_cast<const __m128i*>(blk + kNibScale);
      dw0 = _mm256_cvtph_ps(_mm_loadu_si128(hp));
      dw1 = _mm256_cvtph_ps(_mm_loadu_si128(hp + 1));
      if constexpr (!OFF) {
        mw0 = _mm256_cvtph_ps(_mm_loadu_si128(hp + 2));
        mw1 = _mm256_cvtph_ps(_mm_loadu_si128(hp + 3));
      }
    } else {
      const float* fp = reinterpret_cast<const float*>(blk + kBytesScale);
      dw0 = _mm256_loadu_ps(fp), dw1 = _mm256_loadu_ps(fp + 8);
      if constexpr (!OFF) mw0 = _mm256_loadu_ps(fp + 16), mw1 = _mm256_loadu_ps(fp + 24);
    }
    for (int m = 0; m < MR; ++m) {
      float* ar = acc + m * kQ8Panel;
      const float* tr = t + m * kQ8Panel;
      __m256 r0 = _mm256_fmadd_ps(_mm256_load_ps(tr), dw0, _mm256_load_ps(ar));
      __m256 r1 = _mm256_fmadd_ps(_mm256_load_ps(tr + 8), dw1, _mm256_load_ps(ar + 8));
      if constexpr (!OFF) {
        const __m256 sv = _mm256_set1_ps(sx[m * KB + j]);
        r0 = _mm256_fmadd_ps(sv, mw0, r0);
        r1 = _mm256_fmadd_ps(sv, mw1, r1);
      }
      _mm256_store_ps(ar, r0);
      _mm256_store_ps(ar + 8, r1);
    }
  }
  store_tile(acc, MR, n0, std::min<int64_t>(kQ8Panel, N - n0), bias, y, N);
}

template <bool NIB, bool OFF>
void tile_rows(int64_t mr, const int8_t* xm, const float* dm, const float* sm,
               const int32_t* xsm, int64_t K, const uint8_t* panel, int64_t n0,
               const float* bias, float* ym, int64_t N) {
#ifdef ROSEINFER_AVX512
  switch (mr) {
    case 1: tile_zmm<1, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    case 2: tile_zmm<2, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    case 3: tile_zmm<3, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    case 4: tile_zmm<4, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    case 5: tile_zmm<5, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    case 6: tile_zmm<6, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    case 7: tile_zmm<7, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    default: tile_zmm<8, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
  }
#else
  switch (mr) {
    case 1: tile<1, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    case 2: tile<2, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    case 3: tile<3, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    case 4: tile<4, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
    default: tile<5, NIB, OFF>(xm, dm, sm, xsm, K, panel, n0, bias, ym, N); break;
  }
#endif  // ROSEINFER_AVX512
}

template <bool OFF>
void tile_any(bool nib, int64_t mr, const int8_t* xm, const float* dm, const float* sm,
              const int32_t* xsm, int64_t K, const uint8_t* panel, int64_t n0,
              const float* bias, float* ym, int64_t N) {
  if (nib) tile_rows<true, OFF>(mr, xm, dm, sm, xsm, K, panel, n0, bias, ym, N);
  else tile_rows<false, OFF>(mr, xm, dm, sm, xsm, K, panel, n0, bias, ym, N);
}
#endif  // ROSEINFER_AVX2

}  // namespace

at::Tensor pack_q4_act8(const at::Tensor& q_, const at::Tensor& d_, const at::Tensor& m_,
                        bool nibbles, bool mins) {
  const auto q = q_.contiguous();
  const auto ds = d_.contiguous();
  const auto ms = m_.contiguous();
  const int64_t N = q.size(0), K = q.size(1), KB = K / kQ8Block;
  const int64_t NP = (N + kQ8Panel - 1) / kQ8Panel, bb = block_bytes(nibbles, mins);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = ds.data_ptr<float>();
  const float* mp = ms.data_ptr<float>();
  at::Tensor t = weight_zeros({NP * KB * bb}, at::kByte);
  uint8_t* out = t.data_ptr<uint8_t>();
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < KB; ++j) {
        uint8_t* blk = out + (p * KB + j) * bb;
        for (int c = 0; c < kQ8Panel && p * kQ8Panel + c < N; ++c) {
          const int64_t n = p * kQ8Panel + c;
          const int8_t* src = qp + n * K + j * kQ8Block;
          for (int k = 0; k < kQ8Block; ++k) {
            const int64_t b = byte_of(c, k);
            const auto v = static_cast<uint8_t>(src[k]);
            if (!nibbles) {
              blk[b] = v;
            } else {
              const int64_t within = b % kStepBytes;
              blk[(k / 4) * kNibStep + within % 32] |= static_cast<uint8_t>(v << (within < 32 ? 0 : 4));
            }
          }
          const float d = dp[n * KB + j], m = mp[n * KB + j];
          if (nibbles) {
            const uint16_t dh = c10::Half(d).x, mh = c10::Half(m).x;
            std::memcpy(blk + kNibScale + 2 * c, &dh, 2);
            if (mins) std::memcpy(blk + kNibScale + 32 + 2 * c, &mh, 2);
          } else {
            std::memcpy(blk + kBytesScale + 4 * c, &d, 4);
            if (mins) std::memcpy(blk + kBytesScale + 64 + 4 * c, &m, 4);
          }
        }
      }
  });
  return t;
}

void gemm_q4_act8(const uint8_t* bytes, const uint8_t* nibbles, int64_t N, int64_t K,
                  const float* x, int64_t M, const float* bias, float* y, bool portable,
                  int offset) {
  TORCH_CHECK(offset == 0 || offset == 8, "gemm_q4_act8: offset 0 (Q4_1) or 8 (Q4_0)");
  if (M <= 0 || N == 0) return;
  const int64_t KB = K / kQ8Block, KH = 2 * KB, NP = (N + kQ8Panel - 1) / kQ8Panel;
  std::unique_ptr<int8_t[]> xq(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * KH]), sx(new float[M * KB]);
  std::unique_ptr<int32_t[]> xs;  // Q4_0: each 16-value half's exact activation sum
  if (offset) xs.reset(new int32_t[M * KH]);
  quantize_rows_act8(x, M, K, xq.get(), dx.get(), sx.get(), portable, xs.get());
  const bool nib = M <= kNibMaxRows || bytes == nullptr;  // same integers either way
  const uint8_t* wp = nib ? nibbles : bytes;
  const int64_t panel_bytes = KB * block_bytes(nib, offset == 0);
  // Chunks of ~256 KB of rows.
  const int64_t mc = std::max<int64_t>(kTileRows, (int64_t(1) << 18) / K);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / (M * K * kQ8Panel));
  auto body = [&](int64_t p0, int64_t p1) {
#ifdef ROSEINFER_AVX2
    if (!portable) {
      for (int64_t c0 = 0; c0 < M; c0 += mc) {
        const int64_t c1 = std::min(M, c0 + mc);
        for (int64_t p = p0; p < p1; ++p) {
          const uint8_t* panel = wp + p * panel_bytes;
          const int64_t n0 = p * kQ8Panel;
          for_row_tiles(c0, c1, kTileRows, [&](int64_t m, int64_t mr) {
            const int8_t* xm = xq.get() + m * K;
            const float* dm = dx.get() + m * KH;
            const float* sm = sx.get() + m * KB;
            if (offset) tile_any<true>(nib, mr, xm, dm, sm, xs.get() + m * KH, K, panel, n0, bias, y + m * N, N);
            else tile_any<false>(nib, mr, xm, dm, sm, nullptr, K, panel, n0, bias, y + m * N, N);
          });
        }
      }
      return;
    }
#endif
    panels_scalar(xq.get(), dx.get(), sx.get(), M, K, wp, nib, offset, p0, p1, bias, y, N);
  };
  parallel_panels(NP, grain, M, kNibMaxRows, body);
}

}  // namespace roseinfer
