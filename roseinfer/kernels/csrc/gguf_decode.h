// Per-format block decoders of the GGUF GEMM (gguf_gemm.h): one 32-block of a packed
// panel (gguf_formats.h) -> its 16 columns' integers v = q - offset in the order the
// int16 GEMM reads them (step k/2, then 2c + k%2) and their fp32 scales D0 / D1 and
// minimum terms M.  decode_scalar: int8 values; decode_avx2: int16 values (5- and 6-bit
// formats with `wide`: steps of more than one row tile), else qp (and hp) point at the
// panel's bytes, widened in registers by gguf_tiles.h.  Both give the same integers
// and floats (integer bit moves; D = d * sc and M = -(dmin * mn) as the same fp32
// products).
#pragma once

#include <utility>

#include "gguf_formats.h"

namespace roseinfer {

struct alignas(64) DBlock {
  int16_t w[512];  // the integers widened to int16 (decode_avx2 with wide)
  int8_t q[512];   // the integers (decode_scalar; unused by Q8_0, whose qp points at its panel)
  float d0[16], d1[16], m[16];
  // The integers the GEMM reads: q or Q8_0's panel (decode_scalar); decode_avx2: w, or
  // without wide the panel's bytes of a 4-, 6- or 8-bit format (gguf_tiles.h widens them
  // in registers).
  const uint8_t* qp = nullptr;
  const uint8_t* hp = nullptr;  // 5 bits, decode_avx2 without wide: the panel's bit-4 words
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

// 32 int8 values (one step of the GEMM's order) -> 32 int16 at out.
inline void store_i16(__m256i v8, int16_t* out) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v8)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(out + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v8, 1)));
}

// The 16 steps of one 32-block as int16 v = q - OFF in the GEMM's order (out: 32 values
// per step), from a panel's integers at q (gguf_formats.h; 5 bits: high bits at hi).
template <int BITS, int OFF>
inline void decode_i16(const uint8_t* q, const uint8_t* hi, int16_t* out) {
  if constexpr (BITS == 8) {
    for (int s = 0; s < 16; ++s) store_i16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * s)), out + 32 * s);
  } else if constexpr (BITS == 4) {
    const __m256i low4 = _mm256_set1_epi8(15), off = _mm256_set1_epi8(static_cast<char>(OFF));
    for (int t = 0; t < 8; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * t));
      const __m256i w[2] = {_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
      for (int i = 0; i < 2; ++i) store_i16(_mm256_sub_epi8(w[i], off), out + 32 * (2 * t + i));
    }
  } else if constexpr (BITS == 5) {
    // Per 8-column half P: the nibble bytes widened to the step's 16-bit lanes, bit 4
    // from the lanes' words (bit t: step 2t, bit 8 + t: step 2t + 1).
    const __m256i low4 = _mm256_set1_epi16(15), bit4 = _mm256_set1_epi16(16);
    const __m256i off = _mm256_set1_epi16(OFF);
    const __m256i r[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + 32))};
    for (int t = 0; t < 8; ++t)
      for (int P = 0; P < 2; ++P) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * t + 16 * P)));
        const __m256i h = _mm256_srli_epi16(r[P], t);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
        const __m256i up = _mm256_or_si256(_mm256_srli_epi16(v, 4), _mm256_and_si256(_mm256_srli_epi16(h, 4), bit4));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * (2 * t) + 16 * P), _mm256_sub_epi16(lo, off));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * (2 * t + 1) + 16 * P), _mm256_sub_epi16(up, off));
      }
  } else {
    static_assert(BITS == 6, "8, 4, 5 or 6 bits");
    // Per 16-value half h and 8-column half P: three words per lane (gguf_formats.h).
    const __m256i m63 = _mm256_set1_epi16(63), m15 = _mm256_set1_epi16(15), m48 = _mm256_set1_epi16(48);
    const __m256i off = _mm256_set1_epi16(OFF);
    for (int h = 0; h < 2; ++h)
      for (int P = 0; P < 2; ++P) {
        const uint8_t* base = q + 192 * h + 96 * P;
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 32));
        const __m256i w2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 64));
        const __m256i v[8] = {
            _mm256_and_si256(w0, m63), _mm256_srli_epi16(w0, 10),
            _mm256_and_si256(w1, m63), _mm256_srli_epi16(w1, 10),
            _mm256_and_si256(w2, m63), _mm256_srli_epi16(w2, 10),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w0, 6), m15), _mm256_and_si256(_mm256_srli_epi16(w2, 2), m48)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w1, 6), m15), _mm256_and_si256(_mm256_srli_epi16(w2, 4), m48))};
        for (int t = 0; t < 8; ++t)
          _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * (8 * h + t) + 16 * P), _mm256_sub_epi16(v[t], off));
      }
  }
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

// Q4_K / Q5_K: the 6-bit scales sc and minima mn of 32-block jj of 16 columns from a
// panel's scale region sp (the 12 byte planes at sp + 64, gguf_formats.h).
inline void kquant_sc_mn(const uint8_t* sp, int jj, __m128i& sc, __m128i& mn) {
  const auto plane = [&](int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 64 + 16 * i)); };
  const __m128i m6 = _mm_set1_epi8(63), m4 = _mm_set1_epi8(15), top = _mm_set1_epi8(0x30);
  if (jj < 4) {
    sc = _mm_and_si128(plane(jj), m6);
    mn = _mm_and_si128(plane(jj + 4), m6);
  } else {  // bits 6-7 of bytes j-4 / j become bits 4-5
    const __m128i p = plane(jj + 4);
    sc = _mm_or_si128(_mm_and_si128(p, m4), _mm_and_si128(_mm_srli_epi16(plane(jj - 4), 2), top));
    mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(p, 4), m4),
                      _mm_and_si128(_mm_srli_epi16(plane(jj), 2), top));
  }
}

// wide: every format's integers decoded to int16 (o.w) for tiles that read them as
// they are; else the values stay in the panel (widened in registers).
template <class F>
inline void decode_avx2(const uint8_t* psb, int jj, DBlock& o, bool wide) {
  constexpr int64_t kIntBytes = F::BITS == 8 ? 512 : F::BITS == 6 ? 384 : 256;
  const uint8_t* hi = psb + F::Ints::kNib + jj * F::Ints::kHiPer;
  if (wide) {
    decode_i16<F::BITS, F::OFFSET>(psb + jj * kIntBytes, hi, o.w);
    o.qp = reinterpret_cast<const uint8_t*>(o.w);
  } else {
    o.qp = psb + jj * kIntBytes;
    o.hp = hi;
  }
  const uint8_t* sp = psb + F::kScaleOff;
  if constexpr (F::kType == kQ4_K || F::kType == kQ5_K) {
    alignas(32) float d[16], dmin[16];
    load_f16x16(sp, d);
    load_f16x16(sp + 32, dmin);
    __m128i sc, mn;
    kquant_sc_mn(sp, jj, sc, mn);
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
