// The packed block layouts of q4_act8.h (bytes and nibbles) and its loops' fp32 step.
#pragma once

#include "q8_gemm.h"

namespace roseinfer {
namespace act8 {

constexpr int64_t kStepBytes = 64;                              // 16 columns x 4 k
constexpr int64_t kBytesScale = 8 * kStepBytes;                 // fp32 d, then fp32 m
constexpr int64_t kBytesBlock = kBytesScale + 8 * kQ8Panel;     // 640 (Q4_0: 576, no m)
constexpr int64_t kNibStep = 32;                                // 64 nibbles
constexpr int64_t kNibScale = 8 * kNibStep;                     // fp16 d, then fp16 m
constexpr int64_t kNibBlock = kNibScale + 4 * kQ8Panel;         // 320 (Q4_0: 288, no m)

// Bytes of one packed block: Q4_0 (offset 8) stores no minimums.
constexpr int64_t block_bytes(bool nib, bool mins) {
  return nib ? kNibBlock - (mins ? 0 : 2 * kQ8Panel) : kBytesBlock - (mins ? 0 : 4 * kQ8Panel);
}

#ifdef ROSEINFER_AVX512
// A block's weight scales d (and minimums m; zero for Q4_0) of its 16 columns.
template <bool NIB, bool OFF>
inline void block_scales(const uint8_t* blk, __m512& dw, __m512& mw) {
  mw = _mm512_setzero_ps();
  if constexpr (NIB) {
    const __m256i* hp = reinterpret_cast<const __m256i*>(blk + kNibScale);
    dw = _mm512_cvtph_ps(_mm256_loadu_si256(hp));
    if constexpr (!OFF) mw = _mm512_cvtph_ps(_mm256_loadu_si256(hp + 1));
  } else {
    const float* fp = reinterpret_cast<const float*>(blk + kBytesScale);
    dw = _mm512_loadu_ps(fp);
    if constexpr (!OFF) mw = _mm512_loadu_ps(fp + 16);
  }
}

// One row's fp32 steps for a 32-block on 16 columns (q4_act8.h): z0 / z1 the exact dots
// of its two 16-value halves (Q4_0: with q - 8), d0 / d1 the halves' dx, s the block's
// sx: t = float(z0) * d0, t = fma(float(z1), d1, t), acc = fma(t, dw, acc), then (Q4_1)
// acc = fma(s, mw, acc).
template <bool OFF>
inline __m512 block_step(__m512 acc, __m512i z0, __m512i z1, float d0, float d1, float s,
                         __m512 dw, __m512 mw) {
  __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(z0), _mm512_set1_ps(d0));
  t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z1), _mm512_set1_ps(d1), t);
  acc = _mm512_fmadd_ps(t, dw, acc);
  if constexpr (!OFF) acc = _mm512_fmadd_ps(_mm512_set1_ps(s), mw, acc);
  return acc;
}
#endif  // ROSEINFER_AVX512

}  // namespace act8
}  // namespace roseinfer
