// Small helpers shared by the int8-weight GEMMs (q8_gemm.cpp, q4_act8.cpp): fp16 scale
// reads, storing a register tile's accumulators, balanced row tiles, and the inline-asm
// statement of a register tile's block loop.
#pragma once

#include <cstring>

#include "q8_gemm.h"

namespace roseinfer {

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// y rows [0, mr) x columns [n0, n0 + nc) from the accumulators: y = acc + b (or acc),
// the same fp32 adds either way.
inline void store_tile(const float* acc, int64_t mr, int64_t n0, int64_t nc, const float* bias,
                       float* y, int64_t N) {
  for (int64_t m = 0; m < mr; ++m) {
    float* yr = y + m * N + n0;
    const float* ar = acc + m * kQ8Panel;
#ifdef ROSEINFER_AVX2
    if (nc == kQ8Panel) {  // a whole panel: no call to memcpy (the loop below becomes one)
      for (int h = 0; h < kQ8Panel; h += 8) {
        __m256 v = _mm256_loadu_ps(ar + h);
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0 + h));
        _mm256_storeu_ps(yr + h, v);
      }
      continue;
    }
#endif
    for (int64_t c = 0; c < nc; ++c) yr[c] = bias ? ar[c] + bias[n0 + c] : ar[c];
  }
}

// Row tiles of at most mr_max rows over [m0, m1), sizes balanced (16 rows -> 4 x 4).
template <typename F>
inline void for_row_tiles(int64_t m0, int64_t m1, int64_t mr_max, F&& f) {
  const int64_t n = m1 - m0;
  if (n <= 0) return;
  const int64_t tiles = (n + mr_max - 1) / mr_max, base = n / tiles, extra = n % tiles;
  for (int64_t t = 0, m = m0; t < tiles; ++t) {
    const int64_t mr = base + (t < extra ? 1 : 0);
    f(m, mr);
    m += mr;
  }
}

#ifdef ROSEINFER_AVX2
// One Q4_1 block's share of a row's 16 accumulators ar: i0 / i1 its exact int32 dots
// (columns 0-7 / 8-15), dx / sx the row's activation scale and scaled sum for the block,
// dw / mw the columns' scales and minimums: ar += dot * (dx * dw), then += sx * mw.
inline void add_q4_block(float* ar, __m256i i0, __m256i i1, float dx, float sx, __m256 dw0,
                         __m256 dw1, __m256 mw0, __m256 mw1) {
  const __m256 d = _mm256_set1_ps(dx), sv = _mm256_set1_ps(sx);
  const __m256 r0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(d, dw0), _mm256_load_ps(ar));
  const __m256 r1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(d, dw1), _mm256_load_ps(ar + 8));
  _mm256_store_ps(ar, _mm256_fmadd_ps(sv, mw0, r0));
  _mm256_store_ps(ar + 8, _mm256_fmadd_ps(sv, mw1, r1));
}
#endif

}  // namespace roseinfer

// One asm statement for the integer loop of an MR-row register tile (MR = 1..5, a
// compile-time constant in scope): HEAD1_4 / HEAD5 start a step for up to 4 / 5 rows,
// ROW(m) multiplies row m in, TAIL advances the step. It binds the caller's locals:
// accumulators a[MR][2] (%[am0], %[am1]), row pointers xr[MR] (%[xm]), weight pointer
// wp (%[w]), step offset s (%[s]) and an __m256i mask (%[mask], unused by some loops);
// ymm12-15 are scratch.
#define ROWTILE_ACC(m) [a##m##0] "+x"(a[m][0]), [a##m##1] "+x"(a[m][1])
#define ROWTILE_TMP [w] "+r"(wp), [s] "+r"(s)
#define ROWTILE_CLOBBER "cc", "memory", "xmm12", "xmm13", "xmm14", "xmm15"
#define ROWTILE_ASM(HEAD1_4, HEAD5, ROW, TAIL)                                             \
  if constexpr (MR == 1) {                                                                 \
    asm volatile(HEAD1_4 ROW(0) TAIL                                                       \
                 : ROWTILE_ACC(0), ROWTILE_TMP                                             \
                 : [x0] "r"(xr[0]), [mask] "x"(mask)                                       \
                 : ROWTILE_CLOBBER);                                                       \
  } else if constexpr (MR == 2) {                                                          \
    asm volatile(HEAD1_4 ROW(0) ROW(1) TAIL                                                \
                 : ROWTILE_ACC(0), ROWTILE_ACC(1), ROWTILE_TMP                             \
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), [mask] "x"(mask)                      \
                 : ROWTILE_CLOBBER);                                                       \
  } else if constexpr (MR == 3) {                                                          \
    asm volatile(HEAD1_4 ROW(0) ROW(1) ROW(2) TAIL                                         \
                 : ROWTILE_ACC(0), ROWTILE_ACC(1), ROWTILE_ACC(2), ROWTILE_TMP             \
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), [x2] "r"(xr[2]), [mask] "x"(mask)     \
                 : ROWTILE_CLOBBER);                                                       \
  } else if constexpr (MR == 4) {                                                          \
    asm volatile(HEAD1_4 ROW(0) ROW(1) ROW(2) ROW(3) TAIL                                  \
                 : ROWTILE_ACC(0), ROWTILE_ACC(1), ROWTILE_ACC(2), ROWTILE_ACC(3),         \
                   ROWTILE_TMP                                                             \
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), [x2] "r"(xr[2]), [x3] "r"(xr[3]),     \
                   [mask] "x"(mask)                                                        \
                 : ROWTILE_CLOBBER);                                                       \
  } else {                                                                                 \
    static_assert(MR == 5, "tile rows: 1..5");                                             \
    asm volatile(HEAD5 ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) TAIL                             \
                 : ROWTILE_ACC(0), ROWTILE_ACC(1), ROWTILE_ACC(2), ROWTILE_ACC(3),         \
                   ROWTILE_ACC(4), ROWTILE_TMP                                             \
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), [x2] "r"(xr[2]), [x3] "r"(xr[3]),     \
                   [x4] "r"(xr[4]), [mask] "x"(mask)                                       \
                 : ROWTILE_CLOBBER);                                                       \
  }
