// The integer loop of the GGUF GEMM (gguf_gemm.h): STEPS steps of two k for MR rows x 16
// columns, two steps per iteration, in inline asm (GCC spills the accumulators of an
// intrinsics version).  Per step the 16 columns' values, as int16 pairs, meet each row's
// broadcast k-pair of int16 activations in vpmaddwd (exact int32 sums, as the int8
// format's loop, q8_gemm.cpp).  Heads: int16 values of decoded blocks (gguf_decode.h),
// Q8_0's packed int8 values, or 4-bit values straight from a packed panel
// (gguf_formats.h: byte i of a 32-byte group holds byte i of two steps), widened and
// split in registers (5 bits: with bit 4 from running words, up to 4 rows); an offset
// (q - 8, q - 16, q - 32) is the accumulators' start, -offset * the activations' sum.
// The caller prefetches (gguf_gemm.cpp).
#pragma once

#include "common.h"

namespace roseinfer {

#ifdef ROSEINFER_AVX2
enum class Head { I8, NIB, I16 };

#define GG_H8                                                                             \
  "1:\n\tvpmovsxbw (%[w]), %%ymm12\n\tvpmovsxbw 16(%[w]), %%ymm13\n\t"              \
  "vpmovsxbw 32(%[w]), %%ymm10\n\tvpmovsxbw 48(%[w]), %%ymm11\n\t"
#define GG_H16                                                                            \
  "1:\n\tvmovdqa (%[w]), %%ymm12\n\tvmovdqa 32(%[w]), %%ymm13\n\t"                          \
  "vmovdqa 64(%[w]), %%ymm10\n\tvmovdqa 96(%[w]), %%ymm11\n\t"
#define GG_H4                                                                             \
  "1:\n\tvpmovzxbw (%[w]), %%ymm12\n\tvpmovzxbw 16(%[w]), %%ymm13\n\t"                     \
  "vpsrlw $4, %%ymm12, %%ymm10\n\tvpsrlw $4, %%ymm13, %%ymm11\n\t"                        \
  "vpand (%[c]), %%ymm12, %%ymm12\n\tvpand (%[c]), %%ymm13, %%ymm13\n\t"
// 5 bits: the 4-bit head, plus bit 4 of both steps from the running words g0 / g1
// (gguf_formats.h: bit 0 of g: the even step, bit 8: the odd one, shifted right once per
// iteration): the odd step's bit joins the byte before its >> 4, the even's is placed by
// << 4.
#define GG_H5                                                                             \
  "1:\n\tvpmovzxbw (%[w]), %%ymm12\n\tvpmovzxbw 16(%[w]), %%ymm13\n\t"                     \
  "vpand 32(%[c]), %[g0], %%ymm14\n\tvpand 32(%[c]), %[g1], %%ymm15\n\t"                    \
  "vpor %%ymm14, %%ymm12, %%ymm12\n\tvpor %%ymm15, %%ymm13, %%ymm13\n\t"                    \
  "vpsrlw $4, %%ymm12, %%ymm10\n\tvpsrlw $4, %%ymm13, %%ymm11\n\t"                        \
  "vpsllw $4, %[g0], %%ymm14\n\tvpsllw $4, %[g1], %%ymm15\n\t"                            \
  "vpand 64(%[c]), %%ymm14, %%ymm14\n\tvpand 64(%[c]), %%ymm15, %%ymm15\n\t"              \
  "vpand (%[c]), %%ymm12, %%ymm12\n\tvpand (%[c]), %%ymm13, %%ymm13\n\t"                  \
  "vpor %%ymm14, %%ymm12, %%ymm12\n\tvpor %%ymm15, %%ymm13, %%ymm13\n\t"                  \
  "vpsrlw $1, %[g0], %[g0]\n\tvpsrlw $1, %[g1], %[g1]\n\t"
#ifdef ROSEINFER_VNNI
// VNNI: vpdpwssd adds the pair products into the accumulators (the same exact sums).
#define GG_ROW(m)                                          \
  "vpbroadcastd (%[x" #m "],%[s]), %%ymm14\n\t"            \
  RI_VNNI "vpdpwssd %%ymm12, %%ymm14, %[a" #m "0]\n\t"     \
  RI_VNNI "vpdpwssd %%ymm13, %%ymm14, %[a" #m "1]\n\t"     \
  "vpbroadcastd 4(%[x" #m "],%[s]), %%ymm15\n\t"           \
  RI_VNNI "vpdpwssd %%ymm10, %%ymm15, %[a" #m "0]\n\t"     \
  RI_VNNI "vpdpwssd %%ymm11, %%ymm15, %[a" #m "1]\n\t"
#else
#define GG_ROW(m)                                   \
  "vpbroadcastd (%[x" #m "],%[s]), %%ymm14\n\t"     \
  "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"          \
  "vpaddd %%ymm15, %[a" #m "0], %[a" #m "0]\n\t"    \
  "vpmaddwd %%ymm13, %%ymm14, %%ymm14\n\t"          \
  "vpaddd %%ymm14, %[a" #m "1], %[a" #m "1]\n\t"    \
  "vpbroadcastd 4(%[x" #m "],%[s]), %%ymm14\n\t"    \
  "vpmaddwd %%ymm10, %%ymm14, %%ymm15\n\t"          \
  "vpaddd %%ymm15, %[a" #m "0], %[a" #m "0]\n\t"    \
  "vpmaddwd %%ymm11, %%ymm14, %%ymm14\n\t"          \
  "vpaddd %%ymm14, %[a" #m "1], %[a" #m "1]\n\t"
#endif
#define GG_TAIL(WB, END) "add $" WB ", %[w]\n\tadd $8, %[s]\n\tcmp $" END ", %[s]\n\tjne 1b\n\t"
#define GG_ACC(m) [a##m##0] "+x"(a[m][0]), [a##m##1] "+x"(a[m][1])
#define GG_OUT_IN(...) : __VA_ARGS__, [w] "+r"(wp), [s] "+r"(s)
#define GG_CONST [c] "r"(consts)
#define GG_CLOBBER : "cc", "memory", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define GG_ASM(BODY)                                                                      \
  if constexpr (MR == 1) {                                                                \
    asm volatile(BODY(GG_ROW(0)) GG_OUT_IN(GG_ACC(0)) : [x0] "r"(xr[0]), GG_CONST GG_CLOBBER); \
  } else if constexpr (MR == 2) {                                                         \
    asm volatile(BODY(GG_ROW(0) GG_ROW(1)) GG_OUT_IN(GG_ACC(0), GG_ACC(1))                \
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), GG_CONST GG_CLOBBER);                 \
  } else if constexpr (MR == 3) {                                                         \
    asm volatile(BODY(GG_ROW(0) GG_ROW(1) GG_ROW(2)) GG_OUT_IN(GG_ACC(0), GG_ACC(1), GG_ACC(2)) \
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), [x2] "r"(xr[2]), GG_CONST GG_CLOBBER); \
  } else if constexpr (MR == 4) {                                                         \
    asm volatile(BODY(GG_ROW(0) GG_ROW(1) GG_ROW(2) GG_ROW(3))                            \
                 GG_OUT_IN(GG_ACC(0), GG_ACC(1), GG_ACC(2), GG_ACC(3))                    \
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), [x2] "r"(xr[2]), [x3] "r"(xr[3]),    \
                   GG_CONST GG_CLOBBER);                                                  \
  } else {                                                                                \
    static_assert(MR == 5, "tile rows: 1..5");                                            \
    asm volatile(BODY(GG_ROW(0) GG_ROW(1) GG_ROW(2) GG_ROW(3) GG_ROW(4))                  \
                 GG_OUT_IN(GG_ACC(0), GG_ACC(1), GG_ACC(2), GG_ACC(3), GG_ACC(4))         \
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), [x2] "r"(xr[2]), [x3] "r"(xr[3]),    \
                   [x4] "r"(xr[4]), GG_CONST GG_CLOBBER);                                 \
  }

// Masks of the 4- and 5-bit heads (int16 lanes): 15, 0x100, 16.
alignas(32) inline const int16_t kNibMasks[48] = {
    15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15,
    256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};

#ifdef ROSEINFER_AVX512
// steps_int on 512-bit registers: a step's 16 columns (int16 pairs in I8 order) in one
// register, one accumulator per row (z[m]: columns 0-15), vpdpwssd per row and step
// (the same exact sums).  Heads: int16 values (64 bytes a step), int8 ones (32), 4-bit
// ones (32 bytes: two steps, low / high nibbles).  Each vpdpwssd waits for the one
// before on its accumulator, so few rows sum into more registers: 1 row into four (by
// step modulo 4), 2-4 rows into two each (even / odd steps), folded into z at the end
// (exact int32 sums: the same bits in any order).
template <int MR, int STEPS, Head H>
inline void steps_zmm(const int16_t* const* xr, const uint8_t* q, __m512i (&z)[MR]) {
  constexpr int kChains = MR == 1 ? 4 : MR <= 4 ? 2 : 1;
  const __m512i nib = _mm512_set1_epi16(15);
  __m512i t[kChains][MR];
  for (int c = 1; c < kChains; ++c)
    for (int m = 0; m < MR; ++m) t[c][m] = _mm512_setzero_si512();
  for (int m = 0; m < MR; ++m) t[0][m] = z[m];
  for (int s = 0; s < STEPS; s += 2) {
    __m512i w0, w1;
    if constexpr (H == Head::I16) {
      w0 = _mm512_loadu_si512(q + 64 * s);
      w1 = _mm512_loadu_si512(q + 64 * s + 64);
    } else if constexpr (H == Head::I8) {
      w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * s)));
      w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * s + 32)));
    } else {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16 * s)));
      w0 = _mm512_and_si512(v, nib);
      w1 = _mm512_srli_epi16(v, 4);
    }
    constexpr int kOdd = kChains > 1 ? 1 : 0;
    const int c = kChains == 4 ? (s & 2) : 0;  // 1 row: chains 0-1 or 2-3
    for (int m = 0; m < MR; ++m) {
      t[c][m] = _mm512_dpwssd_epi32(t[c][m], w0, bcast4(xr[m] + 2 * s));
      t[c + kOdd][m] = _mm512_dpwssd_epi32(t[c + kOdd][m], w1, bcast4(xr[m] + 2 * s + 2));
    }
  }
  for (int m = 0; m < MR; ++m) {
    z[m] = t[0][m];
    if constexpr (kChains == 4) z[m] = _mm512_add_epi32(_mm512_add_epi32(z[m], t[1][m]), _mm512_add_epi32(t[2][m], t[3][m]));
    else if constexpr (kChains == 2) z[m] = _mm512_add_epi32(z[m], t[1][m]);
  }
}

// One row's fp32 steps for a 32-block on 16 columns (gguf_gemm.h): acc + float(z) *
// (dx * d), then + sx * mn (formats with a minimum term), z the block's exact dots.
template <bool MIN>
inline __m512 block_step(__m512 acc, __m512i z, float dx, float sx, __m512 d, __m512 mn) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z), _mm512_mul_ps(_mm512_set1_ps(dx), d), acc);
  if constexpr (MIN) acc = _mm512_fmadd_ps(_mm512_set1_ps(sx), mn, acc);
  return acc;
}

// The same with the 256-bit loops' accumulator pairs.
template <int MR, int STEPS, Head H>
inline void steps_int_zmm(const int16_t* const* xr, const uint8_t* q, __m256i (&a)[MR][2]) {
  __m512i z[MR];
  for (int m = 0; m < MR; ++m) z[m] = join256(a[m][0], a[m][1]);
  steps_zmm<MR, STEPS, H>(xr, q, z);
  for (int m = 0; m < MR; ++m) split512(z[m], a[m][0], a[m][1]);
}
#endif  // ROSEINFER_AVX512

// a[m][0 / 1] += the exact int32 dots of rows m's STEPS * 2 activations (xr[m]) with
// columns 0-7 / 8-15 of the values at q (STEPS = 8 or 16); a holds the caller's start
// (zero, or minus offset * the activations' sum: the dot with q - offset).
template <int MR, int STEPS, Head H>
inline void steps_int(const int16_t* const* xr, const uint8_t* q, __m256i (&a)[MR][2]) {
#ifdef ROSEINFER_AVX512
  steps_int_zmm<MR, STEPS, H>(xr, q, a);
#else
  int64_t s = 0;
  const uint8_t* wp = q;
  const int16_t* consts = kNibMasks;
#define GG_B16(ROWS) GG_H16 ROWS GG_TAIL("128", END)
#define GG_B8(ROWS) GG_H8 ROWS GG_TAIL("64", END)
#define GG_B4(ROWS) GG_H4 ROWS GG_TAIL("32", END)
  if constexpr (STEPS == 16) {
#define END "64"
    if constexpr (H == Head::I16) { GG_ASM(GG_B16) }
    else if constexpr (H == Head::I8) { GG_ASM(GG_B8) }
    else { GG_ASM(GG_B4) }
#undef END
  } else {
    static_assert(STEPS == 8, "8 or 16 steps");
#define END "32"
    if constexpr (H == Head::I16) { GG_ASM(GG_B16) }
    else if constexpr (H == Head::I8) { GG_ASM(GG_B8) }
    else { GG_ASM(GG_B4) }
#undef END
  }
#undef GG_B16
#undef GG_B8
#undef GG_B4
#endif  // ROSEINFER_AVX512
}

// The 5-bit formats' 32-block (16 steps) for MR <= 4 rows straight from a packed panel:
// nibbles at q, bit-4 words at hp (two running words take two registers: at most 4
// rows).  a as in steps_int (unsigned q).
template <int MR>
inline void steps_q5(const int16_t* const* xr, const uint8_t* q, const uint8_t* hp,
                     __m256i (&a)[MR][2]) {
  static_assert(MR >= 1 && MR <= 4, "5-bit tiles in registers: 1..4 rows");
  int64_t s = 0;
  const uint8_t* wp = q;
  const int16_t* consts = kNibMasks;
  __m256i g0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hp));
  __m256i g1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hp + 32));
#define GG_B5(ROWS) GG_H5 ROWS GG_TAIL("32", "64")
#define GG_G [g0] "+x"(g0), [g1] "+x"(g1)
  if constexpr (MR == 1) {
    asm volatile(GG_B5(GG_ROW(0)) GG_OUT_IN(GG_ACC(0), GG_G) : [x0] "r"(xr[0]), GG_CONST GG_CLOBBER);
  } else if constexpr (MR == 2) {
    asm volatile(GG_B5(GG_ROW(0) GG_ROW(1)) GG_OUT_IN(GG_ACC(0), GG_ACC(1), GG_G)
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), GG_CONST GG_CLOBBER);
  } else if constexpr (MR == 3) {
    asm volatile(GG_B5(GG_ROW(0) GG_ROW(1) GG_ROW(2)) GG_OUT_IN(GG_ACC(0), GG_ACC(1), GG_ACC(2), GG_G)
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), [x2] "r"(xr[2]), GG_CONST GG_CLOBBER);
  } else {
    asm volatile(GG_B5(GG_ROW(0) GG_ROW(1) GG_ROW(2) GG_ROW(3))
                 GG_OUT_IN(GG_ACC(0), GG_ACC(1), GG_ACC(2), GG_ACC(3), GG_G)
                 : [x0] "r"(xr[0]), [x1] "r"(xr[1]), [x2] "r"(xr[2]), [x3] "r"(xr[3]),
                   GG_CONST GG_CLOBBER);
  }
#undef GG_B5
#undef GG_G
}

// Q6_K: a 16-value half (8 steps) of one 32-block for MR rows x 16 columns from the
// panel's words at w (gguf_formats.h, 6 bits: 192 bytes): per step and 8-column half,
// the unsigned q widened in registers (steps 0-5: one load and one AND / shift, three
// iterations of two steps; then 6-7: two of each and an OR), the rows as in steps_int.  a: plus
// the exact dots with q (the caller starts it at -32 * the activations' sum: q - 32).
#define Q6_LO(O, R) "vmovdqu " O "(%[w]), %%ymm" R "\n\tvpand (%[c]), %%ymm" R ", %%ymm" R "\n\t"
#define Q6_HI(O, R) "vmovdqu " O "(%[w]), %%ymm" R "\n\tvpsrlw $10, %%ymm" R ", %%ymm" R "\n\t"
#define Q6_MID(O, O2, SH, R)                                                              \
  "vmovdqu " O "(%[w]), %%ymm" R "\n\tvpsrlw $6, %%ymm" R ", %%ymm" R "\n\t"                \
  "vpand 32(%[c]), %%ymm" R ", %%ymm" R "\n\tvmovdqu " O2 "(%[w]), %%ymm14\n\t"             \
  "vpsrlw $" SH ", %%ymm14, %%ymm14\n\tvpand 64(%[c]), %%ymm14, %%ymm14\n\t"                \
  "vpor %%ymm14, %%ymm" R ", %%ymm" R "\n\t"
#define Q6_BODY(ROWS)                                                                     \
  "1:\n\t" Q6_LO("0", "12") Q6_LO("96", "13") Q6_HI("0", "10") Q6_HI("96", "11") ROWS         \
  "add $32, %[w]\n\tadd $8, %[s]\n\tcmp $24, %[s]\n\tjne 1b\n\t"                               \
  Q6_MID("-96", "-32", "2", "12") Q6_MID("0", "64", "2", "13")                                \
  Q6_MID("-64", "-32", "4", "10") Q6_MID("32", "64", "4", "11") ROWS

template <int MR>
inline void q6k_half(const int16_t* const* xr, const uint8_t* q, __m256i (&a)[MR][2]) {
  int64_t s = 0;
  const uint8_t* wp = q;
  alignas(32) static const int16_t kMasks[48] = {
      63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63,
      15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15,
      48, 48, 48, 48, 48, 48, 48, 48, 48, 48, 48, 48, 48, 48, 48, 48};
  const int16_t* consts = kMasks;
  GG_ASM(Q6_BODY)
}
#undef Q6_LO
#undef Q6_HI
#undef Q6_MID
#undef Q6_BODY

#undef GG_H8
#undef GG_H4
#undef GG_H5
#undef GG_ROW
#undef GG_TAIL
#undef GG_ACC
#undef GG_OUT_IN
#undef GG_CONST
#undef GG_CLOBBER
#undef GG_ASM
#endif  // ROSEINFER_AVX2

}  // namespace roseinfer
