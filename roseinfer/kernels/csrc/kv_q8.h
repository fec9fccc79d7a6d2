// The int8 KV cache rows (layout and arithmetic: roseinfer/model/kv_int8.py and
// docs/CONTRACTS.md): per (slot, KV head) Dh int8 values then their float32 scale
// (4 bytes), so one slot of a layer's K (or V) half is Hkv * (Dh + 4) bytes.
//   scale = absmax / 127 (0 for an all-zero row), q = clamp(rne(x / scale), -127, 127)
// The AVX2 and scalar quantizers give the same bits (IEEE division, round half to even),
// and the same bits as the PyTorch quantizer.
#pragma once

#include <cstring>

#include "common.h"

namespace roseinfer {

constexpr int64_t kQ8ScaleBytes = 4;

inline int64_t q8_row_bytes(int64_t Dh) { return Dh + kQ8ScaleBytes; }

inline float q8_scale(const int8_t* row, int64_t Dh) {
  float s;
  std::memcpy(&s, row + Dh, sizeof(float));
  return s;
}

// row[0..Dh) = x quantized, row[Dh..Dh+4) = its scale.
inline void q8_store_head(int8_t* row, const float* x, int64_t Dh) {
  float amax = 0.f;  // exact in any order
  for (int64_t i = 0; i < Dh; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.f;
  const float div = scale > 0.f ? scale : 1.f;
  int64_t i = 0;
#ifdef ROSEINFER_AVX2
  const __m256 vd = _mm256_set1_ps(div), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (; i + 8 <= Dh; i += 8) {
    __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vd);
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    const __m256i q32 = _mm256_cvtps_epi32(v);  // exact: already integers
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32),
                                        _mm256_extracti128_si256(q32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(row + i), _mm_packs_epi16(q16, q16));
  }
#endif
  for (; i < Dh; ++i)
    row[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / div))));
  std::memcpy(row + Dh, &scale, sizeof(float));
}

// Hkv heads of Dh floats (one token's K or V) into one slot of an int8 cache half.
inline void q8_store_slot(int8_t* slot, const float* x, int64_t Hkv, int64_t Dh) {
  for (int64_t h = 0; h < Hkv; ++h) q8_store_head(slot + h * q8_row_bytes(Dh), x + h * Dh, Dh);
}

}  // namespace roseinfer
