// The packed block layouts of q4_act8.h (bytes and nibbles), shared by its vector
// loops (q4_act8.cpp) and its AMX tiles (q4_act8_amx.h).
#pragma once

#include "gguf_tiles.h"
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

// One row's fp32 steps for a block on 16 columns (q4_act8.h): z the block's exact dots
// with q, d / s / t the row's dx, sx and exact activation sum for the block.
// The GGUF GEMM's step (gguf_tiles.h) on the dots with q (Q4_1) or q - 8 (Q4_0).
template <bool OFF>
inline __m512 block_step(__m512 acc, __m512i z, float d, float s, int32_t t, __m512 dw,
                         __m512 mw) {
  if constexpr (OFF)
    return roseinfer::block_step<false>(acc, _mm512_add_epi32(z, _mm512_set1_epi32(-8 * t)), d,
                                        0.f, dw, dw);
  return roseinfer::block_step<true>(acc, z, d, s, dw, mw);
}
#endif  // ROSEINFER_AVX512

}  // namespace act8
}  // namespace roseinfer
