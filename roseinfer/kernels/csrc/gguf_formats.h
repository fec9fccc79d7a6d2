// GGUF block formats as the CPU kernels use them (gguf_gemm.h): each weight keeps its
// file's integers and scales, repacked once into 16-column panels of the same size.
// Stored layouts (ggml-common.h; fp16 little-endian, per row of K values):
//   Q8_0 (34 B / 32): d, qs[32] int8                    w = d * q
//   Q4_0 (18 B / 32): d, qs[16] (k<16: low nibble of qs[k], else high of qs[k-16])
//                                                       w = d * (q - 8)
//   Q5_0 (22 B / 32): d, qh u32 (bit k: 5th bit of k), qs[16]   w = d * (q - 16)
//   Q5_1 (24 B / 32): d, m, qh, qs[16]                  w = fp32(d * q) + m
//   Q4_K (144 B / 256): d, dmin, scales[12] (6-bit sc_j / mn_j of the 8 32-blocks),
//        qs[128] (block j: nibble j%2 of qs[32 (j/2) + i])    w = (d sc_j) q - dmin mn_j
//   Q5_K (176 B / 256): d, dmin, scales[12], qh[32] (bit j of qh[i]: 5th bit), qs[128]
//   Q6_K (210 B / 256): ql[128], qh[64], sc[16] int8 (one per 16 values), d
//                                                       w = (d sc_{e/16}) (q - 32)
//   Q4_1 (20 B / 32): d, m, qs[16] (as Q4_0)            w = fp32(d * q) + m
// (Q4_1 parts of act8 layers stay with Q8Gemm, q8_gemm.h; F16 / BF16 with PanelGemm,
// panel_gemm.h.)
// Every product above is exact in fp32 (d sc: 11 + 8 bits; times q: <= 24 bits), so
// the kernel's weight is the dequantized value (gguf.quants.dequantize) bit for bit:
// w = D * v + M with v the integer multiplied (q minus the format's offset), D the
// 32-block's scale (Q6_K: the 16-value half's), M its minimum term (Q5_1: m; K-quants:
// -(dmin mn); else none).
//
// Packed panel layout: per 16 output columns and super-block (32 values; K-quants 256),
// first the integers of each 32-block j, in the order the int16 GEMM reads them ("I8
// order": byte (k/2) * 32 + 2c + k%2 holds column c's value k), then the scales:
//   8 bits (Q8_0): 512 bytes per block, the int8 values;
//   4 bits: 256 bytes per block: byte 32t + b holds I8 byte b of step 2t (low nibble)
//           and of step 2t+1 (high nibble);
//   5 bits: the nibbles of every block, then 64 bytes per block: per I8 byte b one
//           16-bit word at 32 (b / 16) + 2 (b % 16) (the lanes of a step's widened
//           half) whose bit t / 8 + t holds bit 4 of step 2t / 2t + 1 (t = 0..7: one
//           running shift gives both steps of a pair, gguf_tiles.h);
//   6 bits (Q6_K): 384 bytes per block, per 16-value half h and 8-column half P (I8
//           bytes b = 16P + L) three 16-bit words w0..w2 per lane L at 192h + 96P +
//           32i + 2L holding the unsigned q of steps 8h + t (t = 0..7) of I8 byte b:
//           t = 0 / 2 / 4 in bits 0-5 of w0 / w1 / w2, t = 1 / 3 / 5 in their bits
//           10-15, t = 6 / 7: low 4 bits in bits 6-9 of w0 / w1, high 2 in bits 6-7 /
//           8-9 of w2 (one load and one AND or shift per step for six of eight steps).
// Scales (per column c): Q8_0 / Q4_0 / Q5_0: d[16] fp16; Q5_1: d[16], m[16];
// Q4_K / Q5_K: d[16], dmin[16], then the 12 scale bytes as planes (byte 64 + 16 i + c
// of the region = scales[i] of column c); Q6_K: sc[16 sub][16 columns] int8, then d[16].
// Panel bytes = 16 x stored bytes: the only copy.
#pragma once

#include <cstring>

#include "common.h"

namespace roseinfer {

enum GgmlType : int64_t {
  kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};

// (values per stored block, bytes per stored block); false for unsupported types.
inline bool ggml_block(int64_t type, int64_t& elems, int64_t& bytes) {
  switch (type) {
    case kF16: elems = 1; bytes = 2; return true;
    case kBF16: elems = 1; bytes = 2; return true;
    case kQ4_0: elems = 32; bytes = 18; return true;
    case kQ4_1: elems = 32; bytes = 20; return true;
    case kQ5_0: elems = 32; bytes = 22; return true;
    case kQ5_1: elems = 32; bytes = 24; return true;
    case kQ8_0: elems = 32; bytes = 34; return true;
    case kQ4_K: elems = 256; bytes = 144; return true;
    case kQ5_K: elems = 256; bytes = 176; return true;
    case kQ6_K: elems = 256; bytes = 210; return true;
    default: return false;
  }
}

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}
inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The scales of one 32-block of one column, as the kernel applies them.
struct BlockScales {
  float d0 = 0.f, d1 = 0.f, m = 0.f;  // d1: Q6_K's second 16 values; m: minimum term
};

// Integer placement in the packed integer region (BITS = 8, 4, 5 or 6) of a super-block
// of NB 32-blocks: value v (unsigned, or int8 for BITS 8) of column c, element e.
template <int BITS, int NB>
struct IntLayout {
  static constexpr int64_t kNib = NB * 256;
  static constexpr int64_t kHiPer = BITS == 5 ? 64 : 0;
  static constexpr int64_t kBytes = BITS == 8 ? NB * 512 : BITS == 6 ? NB * 384 : kNib + NB * kHiPer;
  // 6 bits: (word, bit) of the low 6 (or 4) bits of step t of a half, and (word, bit)
  // of the high 2 of t = 6 / 7.
  static constexpr int kW6[8] = {0, 0, 1, 1, 2, 2, 0, 1}, kB6[8] = {0, 10, 0, 10, 0, 10, 6, 6};
  static int64_t at6(int j, int s, int b, int w) {
    return j * 384 + (s / 8) * 192 + (b / 16) * 96 + w * 32 + 2 * (b % 16);
  }
  // 5 bits: the byte holding bit 4 of step s of I8 byte b (bit s / 2 of it).
  static int64_t hi5(int j, int s, int b) { return kNib + j * 64 + 32 * (b / 16) + 2 * (b % 16) + s % 2; }
  static int word6(const uint8_t* r, int j, int s, int b, int w) {
    return r[at6(j, s, b, w)] | (r[at6(j, s, b, w) + 1] << 8);
  }
  static void or6(uint8_t* r, int j, int s, int b, int w, int bits) {
    r[at6(j, s, b, w)] |= static_cast<uint8_t>(bits & 255);
    r[at6(j, s, b, w) + 1] |= static_cast<uint8_t>(bits >> 8);
  }
  static void put(uint8_t* r, int c, int e, int v) {
    const int j = e / 32, k = e % 32, s = k / 2, b = 2 * c + (k & 1);
    if constexpr (BITS == 8) {
      r[j * 512 + s * 32 + b] = static_cast<uint8_t>(v);
    } else if constexpr (BITS == 6) {
      const int t = s % 8;
      if (t < 6) {
        or6(r, j, s, b, kW6[t], (v & 63) << kB6[t]);
      } else {
        or6(r, j, s, b, kW6[t], (v & 15) << 6);
        or6(r, j, s, b, 2, ((v >> 4) & 3) << (t == 6 ? 6 : 8));
      }
    } else {
      r[j * 256 + (s / 2) * 32 + b] |= static_cast<uint8_t>((v & 15) << ((s & 1) * 4));
      if constexpr (BITS == 5) r[hi5(j, s, b)] |= static_cast<uint8_t>(((v >> 4) & 1) << (s / 2));
    }
  }
  static int get(const uint8_t* r, int c, int e) {
    const int j = e / 32, k = e % 32, s = k / 2, b = 2 * c + (k & 1);
    if constexpr (BITS == 8) {
      return static_cast<int8_t>(r[j * 512 + s * 32 + b]);
    } else if constexpr (BITS == 6) {
      const int t = s % 8;
      if (t < 6) return (word6(r, j, s, b, kW6[t]) >> kB6[t]) & 63;
      return ((word6(r, j, s, b, kW6[t]) >> 6) & 15) | (((word6(r, j, s, b, 2) >> (t == 6 ? 6 : 8)) & 3) << 4);
    } else {
      int v = (r[j * 256 + (s / 2) * 32 + b] >> ((s & 1) * 4)) & 15;
      if constexpr (BITS == 5) v |= ((r[hi5(j, s, b)] >> (s / 2)) & 1) << 4;
      return v;
    }
  }
};

// Q4_K / Q5_K 6-bit scale (which 0) or minimum (which 1) of 32-block j from 12 bytes
// B[i] = at(i) (ggml's get_scale_min_k4).
template <typename At>
inline int kquant_scale(At at, int j, int which) {
  if (j < 4) return at(j + 4 * which) & 63;
  const int lo = which == 0 ? (at(j + 4) & 15) : (at(j + 4) >> 4);
  return lo | ((at(j - 4 + 4 * which) >> 6) << 4);
}

// Format traits: E values per super-block, the stored block's size, BITS of the packed
// integers, OFFSET subtracted to get the value multiplied, HALVES scales per 32-block.
// stored_q(s, e): the stored unsigned integer (Q8_0: the int8) of element e of block s.
// pack_scales(s, p, c): column c's scales into the packed scale region p.
// scales(p, j, c): the BlockScales of 32-block j of column c from region p.
// dequant(s, out): the gguf package's values (float32 rounding as numpy's).
#define GGUF_FMT(NAME, TYPE, E_, STORED, BITS_, OFFSET_, HALVES_, MIN_) \
  struct NAME {                                                         \
    static constexpr int64_t kType = TYPE, E = E_, kStored = STORED;    \
    static constexpr int BITS = BITS_, OFFSET = OFFSET_, HALVES = HALVES_; \
    static constexpr bool kMin = MIN_;                                  \
    using Ints = IntLayout<BITS_, E_ / 32>;                             \
    static constexpr int64_t kPanel = 16 * STORED;                      \
    static constexpr int64_t kScaleOff = Ints::kBytes;

GGUF_FMT(FQ8_0, kQ8_0, 32, 34, 8, 0, 1, false)
  static int stored_q(const uint8_t* s, int e) { return static_cast<int8_t>(s[2 + e]); }
  static void pack_scales(const uint8_t* s, uint8_t* p, int c) { std::memcpy(p + 2 * c, s, 2); }
  static BlockScales scales(const uint8_t* p, int, int c) { return {f16_at(p + 2 * c), 0.f, 0.f}; }
  static void dequant(const uint8_t* s, float* out) {
    const float d = f16_at(s);
    for (int e = 0; e < 32; ++e) out[e] = static_cast<float>(stored_q(s, e)) * d;
  }
};

GGUF_FMT(FQ4_0, kQ4_0, 32, 18, 4, 8, 1, false)
  static int stored_q(const uint8_t* s, int e) { return e < 16 ? s[2 + e] & 15 : s[2 + e - 16] >> 4; }
  static void pack_scales(const uint8_t* s, uint8_t* p, int c) { std::memcpy(p + 2 * c, s, 2); }
  static BlockScales scales(const uint8_t* p, int, int c) { return {f16_at(p + 2 * c), 0.f, 0.f}; }
  static void dequant(const uint8_t* s, float* out) {
    const float d = f16_at(s);
    for (int e = 0; e < 32; ++e) out[e] = d * static_cast<float>(stored_q(s, e) - 8);
  }
};

// Q4_1 and Q5_1: fp16 d and m first in the stored block, w = fp32(d * q) + m; packed as
// d[16] then m[16].
struct MinScales {
  static void pack_scales(const uint8_t* s, uint8_t* p, int c) {
    std::memcpy(p + 2 * c, s, 2);
    std::memcpy(p + 32 + 2 * c, s + 2, 2);
  }
  static BlockScales scales(const uint8_t* p, int, int c) {
    return {f16_at(p + 2 * c), 0.f, f16_at(p + 32 + 2 * c)};
  }
  template <typename Q>
  static void dequant(const uint8_t* s, float* out, Q stored_q) {
    const float d = f16_at(s), m = f16_at(s + 2);
    for (int e = 0; e < 32; ++e) {
      const float dq = d * static_cast<float>(stored_q(s, e));  // exact
      out[e] = dq + m;
    }
  }
};

GGUF_FMT(FQ4_1, kQ4_1, 32, 20, 4, 0, 1, true)
  static int stored_q(const uint8_t* s, int e) { return e < 16 ? s[4 + e] & 15 : s[4 + e - 16] >> 4; }
  static void pack_scales(const uint8_t* s, uint8_t* p, int c) { MinScales::pack_scales(s, p, c); }
  static BlockScales scales(const uint8_t* p, int j, int c) { return MinScales::scales(p, j, c); }
  static void dequant(const uint8_t* s, float* out) { MinScales::dequant(s, out, stored_q); }
};

GGUF_FMT(FQ5_0, kQ5_0, 32, 22, 5, 16, 1, false)
  static int stored_q(const uint8_t* s, int e) {
    const int lo = e < 16 ? s[6 + e] & 15 : s[6 + e - 16] >> 4;
    return lo | (((u32_at(s + 2) >> e) & 1) << 4);
  }
  static void pack_scales(const uint8_t* s, uint8_t* p, int c) { std::memcpy(p + 2 * c, s, 2); }
  static BlockScales scales(const uint8_t* p, int, int c) { return {f16_at(p + 2 * c), 0.f, 0.f}; }
  static void dequant(const uint8_t* s, float* out) {
    const float d = f16_at(s);
    for (int e = 0; e < 32; ++e) out[e] = d * static_cast<float>(stored_q(s, e) - 16);
  }
};

GGUF_FMT(FQ5_1, kQ5_1, 32, 24, 5, 0, 1, true)
  static int stored_q(const uint8_t* s, int e) {
    const int lo = e < 16 ? s[8 + e] & 15 : s[8 + e - 16] >> 4;
    return lo | (((u32_at(s + 4) >> e) & 1) << 4);
  }
  static void pack_scales(const uint8_t* s, uint8_t* p, int c) { MinScales::pack_scales(s, p, c); }
  static BlockScales scales(const uint8_t* p, int j, int c) { return MinScales::scales(p, j, c); }
  static void dequant(const uint8_t* s, float* out) { MinScales::dequant(s, out, stored_q); }
};

// Q4_K and Q5_K: the same scales; QS / QH: offsets of the nibbles / 5th bits.
template <int QS, int QH>
struct KQuantScales {
  static int q(const uint8_t* s, int e) {
    const int j = e / 32, i = e % 32;
    int v = (s[QS + (j / 2) * 32 + i] >> (4 * (j % 2))) & 15;
    if (QH >= 0) v |= ((s[QH + i] >> j) & 1) << 4;
    return v;
  }
  static void pack_scales(const uint8_t* s, uint8_t* p, int c) {
    std::memcpy(p + 2 * c, s, 2);
    std::memcpy(p + 32 + 2 * c, s + 2, 2);
    for (int i = 0; i < 12; ++i) p[64 + 16 * i + c] = s[4 + i];
  }
  static BlockScales scales(const uint8_t* p, int j, int c) {
    const auto at = [&](int i) { return int(p[64 + 16 * i + c]); };
    const float d = f16_at(p + 2 * c), dmin = f16_at(p + 32 + 2 * c);
    return {d * static_cast<float>(kquant_scale(at, j, 0)), 0.f,
            -(dmin * static_cast<float>(kquant_scale(at, j, 1)))};
  }
  static void dequant(const uint8_t* s, float* out) {
    const float d = f16_at(s), dmin = f16_at(s + 2);
    const auto at = [&](int i) { return int(s[4 + i]); };
    for (int e = 0; e < 256; ++e) {
      const float sc = d * static_cast<float>(kquant_scale(at, e / 32, 0));
      const float mn = dmin * static_cast<float>(kquant_scale(at, e / 32, 1));
      const float dq = sc * static_cast<float>(q(s, e));  // exact
      out[e] = dq - mn;
    }
  }
};

GGUF_FMT(FQ4_K, kQ4_K, 256, 144, 4, 0, 1, true)
  using S = KQuantScales<16, -1>;
  static int stored_q(const uint8_t* s, int e) { return S::q(s, e); }
  static void pack_scales(const uint8_t* s, uint8_t* p, int c) { S::pack_scales(s, p, c); }
  static BlockScales scales(const uint8_t* p, int j, int c) { return S::scales(p, j, c); }
  static void dequant(const uint8_t* s, float* out) { S::dequant(s, out); }
};

GGUF_FMT(FQ5_K, kQ5_K, 256, 176, 5, 0, 1, true)
  using S = KQuantScales<48, 16>;
  static int stored_q(const uint8_t* s, int e) { return S::q(s, e); }
  static void pack_scales(const uint8_t* s, uint8_t* p, int c) { S::pack_scales(s, p, c); }
  static BlockScales scales(const uint8_t* p, int j, int c) { return S::scales(p, j, c); }
  static void dequant(const uint8_t* s, float* out) { S::dequant(s, out); }
};

GGUF_FMT(FQ6_K, kQ6_K, 256, 210, 6, 32, 2, false)
  static int stored_q(const uint8_t* s, int e) {
    const int h = e / 128, r = e % 128;
    const int lo = (s[h * 64 + r % 64] >> (4 * (r / 64))) & 15;
    const int hi = (s[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
    return lo | (hi << 4);
  }
  static void pack_scales(const uint8_t* s, uint8_t* p, int c) {
    for (int i = 0; i < 16; ++i) p[16 * i + c] = s[192 + i];
    std::memcpy(p + 256 + 2 * c, s + 208, 2);
  }
  static BlockScales scales(const uint8_t* p, int j, int c) {
    const float d = f16_at(p + 256 + 2 * c);
    return {d * static_cast<float>(static_cast<int8_t>(p[16 * (2 * j) + c])),
            d * static_cast<float>(static_cast<int8_t>(p[16 * (2 * j + 1) + c])), 0.f};
  }
  static void dequant(const uint8_t* s, float* out) {
    const float d = f16_at(s + 208);
    for (int e = 0; e < 256; ++e) {
      const float ds = d * static_cast<float>(static_cast<int8_t>(s[192 + e / 16]));
      out[e] = ds * static_cast<float>(stored_q(s, e) - 32);
    }
  }
};
#undef GGUF_FMT

// Calls f(Fmt{}) for a quantized type handled by gguf_gemm; false otherwise.
template <typename F>
inline bool with_format(int64_t type, F&& f) {
  switch (type) {
    case kQ8_0: f(FQ8_0{}); return true;
    case kQ4_0: f(FQ4_0{}); return true;
    case kQ4_1: f(FQ4_1{}); return true;
    case kQ5_0: f(FQ5_0{}); return true;
    case kQ5_1: f(FQ5_1{}); return true;
    case kQ4_K: f(FQ4_K{}); return true;
    case kQ5_K: f(FQ5_K{}); return true;
    case kQ6_K: f(FQ6_K{}); return true;
    default: return false;
  }
}

}  // namespace roseinfer
