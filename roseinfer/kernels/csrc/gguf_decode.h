// Per-format block decoders of the GGUF GEMM (gguf_gemm.h): one 32-block of a packed
// panel (gguf_formats.h) -> its 16 columns' integers v = q - offset as int8 in the order
// the int16 GEMM reads them (byte (k/2) * 32 + 2c + k%2) and their fp32 scales D0 / D1
// and minimum terms M (decode_avx2: only 5-bit values are decoded; the others' qp points
// at the panel, widened in registers by gguf_tiles.h).  decode_scalar and decode_avx2 give the same bytes and floats
// (integer bit moves; D = d * sc and M = -(dmin * mn) as the same fp32 products).
#pragma once

#include <utility>

#include "gguf_formats.h"

namespace roseinfer {

struct alignas(64) DBlock {
  int8_t q[512];  // the integers (unused by Q8_0, whose qp points at its panel)
  float d0[16], d1[16], m[16];
  // The integers the GEMM reads: q or Q8_0's panel; decode_avx2 of a 4- or 6-bit format:
  // the panel's nibbles / Q6_K words (gguf_tiles.h widens them in registers).
  const uint8_t* qp = nullptr;
};

template <class F>
inline void decode_scalar(const uint8_t* psb, int jj, DBlock& o) {
  if constexpr (F::BITS == 8) {
    o.qp = psb + jj * 512;
  } else {
    for (int c = 0; c < 16; ++c)
      for (int k = 0; k < 32; ++k)
        o.q[(k / 2) * 32 + 2 * c + k % 2] =
            static_cast<int8_t>(F::Ints::get(psb, c, jj * 32 + k) - F::OFFSET);
    o.qp = reinterpret_cast<const uint8_t*>(o.q);
  }
  for (int c = 0; c < 16; ++c) {
    const BlockScales s = F::scales(psb + F::kScaleOff, jj, c);
    o.d0[c] = s.d0;
    o.d1[c] = s.d1;
    o.m[c] = s.m;
  }
}

#ifdef ROSEINFER_AVX2
// Shift a vector of 16-bit lanes left (N > 0) or right (N < 0) by |N| bits.
template <int N>
inline __m256i shift16(__m256i v) {
  if constexpr (N > 0) return _mm256_slli_epi16(v, N);
  else if constexpr (N < 0) return _mm256_srli_epi16(v, -N);
  else return v;
}

// Steps 2T, 2T+1 of a 5-bit block (the nibbles and high bits at nib / hi, a panel's
// layout) minus OFF into out (the GEMM's int8 order).
template <int BITS, int OFF, int T>
inline void decode_pair(const uint8_t* nib, const uint8_t* hi, int8_t* out) {
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + 32 * T));
  __m256i w[2] = {_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
  static_assert(BITS == 5, "6-bit values are widened in registers (gguf_tiles.h)");
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + 32 * (2 * T / 8)));
  constexpr int u0 = (2 * T) % 8;  // 8 steps per 32 bytes of high bits
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  w[0] = _mm256_or_si256(w[0], _mm256_and_si256(shift16<4 - u0>(h), bit4));
  w[1] = _mm256_or_si256(w[1], _mm256_and_si256(shift16<3 - u0>(h), bit4));
  for (int i = 0; i < 2; ++i) {
    if constexpr (OFF != 0) w[i] = _mm256_sub_epi8(w[i], _mm256_set1_epi8(static_cast<char>(OFF)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64 * T + 32 * i), w[i]);
  }
}

template <int BITS, int OFF, int... T>
inline void decode_pairs(const uint8_t* nib, const uint8_t* hi, int8_t* out,
                         std::integer_sequence<int, T...>) {
  (decode_pair<BITS, OFF, T>(nib, hi, out), ...);
}

// 16 fp16 values -> two vectors of 8 fp32.
inline void load_f16x16(const uint8_t* p, float* out) {
  const __m128i* h = reinterpret_cast<const __m128i*>(p);
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(h)));
  _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128(h + 1)));
}

// out[c] = d[c] * float(u8 / i8 values v[c]) (sign: -(d * v)), 16 columns.
template <bool SIGNED_V>
inline void scale16(const float* d, __m128i v, float* out, bool negate = false) {
  const __m256i lo = SIGNED_V ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
  const __m256i hi = SIGNED_V ? _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))
                              : _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
  const __m256 sign = _mm256_set1_ps(negate ? -0.f : 0.f);
  _mm256_storeu_ps(out, _mm256_xor_ps(sign, _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_cvtepi32_ps(lo))));
  _mm256_storeu_ps(out + 8, _mm256_xor_ps(sign, _mm256_mul_ps(_mm256_loadu_ps(d + 8), _mm256_cvtepi32_ps(hi))));
}

template <class F>
inline void decode_avx2(const uint8_t* psb, int jj, DBlock& o) {
  if constexpr (F::BITS == 8) {
    o.qp = psb + jj * 512;
  } else if constexpr (F::BITS == 4) {
    o.qp = psb + jj * 256;
  } else if constexpr (F::BITS == 6) {
    o.qp = psb + jj * 384;
  } else {
    const uint8_t* hi = psb + F::Ints::kNib + jj * F::Ints::kHiPer;
    decode_pairs<F::BITS, F::OFFSET>(psb + jj * 256, hi, o.q, std::make_integer_sequence<int, 8>{});
    o.qp = reinterpret_cast<const uint8_t*>(o.q);
  }
  const uint8_t* sp = psb + F::kScaleOff;
  if constexpr (F::kType == kQ4_K || F::kType == kQ5_K) {
    alignas(32) float d[16], dmin[16];
    load_f16x16(sp, d);
    load_f16x16(sp + 32, dmin);
    const auto plane = [&](int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 64 + 16 * i)); };
    const __m128i m6 = _mm_set1_epi8(63), m4 = _mm_set1_epi8(15), top = _mm_set1_epi8(0x30);
    __m128i sc, mn;
    if (jj < 4) {
      sc = _mm_and_si128(plane(jj), m6);
      mn = _mm_and_si128(plane(jj + 4), m6);
    } else {  // bits 6-7 of bytes j-4 / j become bits 4-5
      const __m128i p = plane(jj + 4);
      sc = _mm_or_si128(_mm_and_si128(p, m4), _mm_and_si128(_mm_srli_epi16(plane(jj - 4), 2), top));
      mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(p, 4), m4),
                        _mm_and_si128(_mm_srli_epi16(plane(jj), 2), top));
    }
    scale16<false>(d, sc, o.d0);
    scale16<false>(dmin, mn, o.m, true);
  } else if constexpr (F::kType == kQ6_K) {
    alignas(32) float d[16];
    load_f16x16(sp + 256, d);
    scale16<true>(d, _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 32 * jj)), o.d0);
    scale16<true>(d, _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 32 * jj + 16)), o.d1);
  } else {
    load_f16x16(sp, o.d0);
    if constexpr (F::kMin) load_f16x16(sp + 32, o.m);
  }
}
#endif  // ROSEINFER_AVX2

}  // namespace roseinfer
