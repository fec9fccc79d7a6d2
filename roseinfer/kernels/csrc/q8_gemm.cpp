// int8-weight x int16-activation GEMM (see q8_gemm.h): packing (activations: act_quant.h),
// the AVX2 kernel (int8 weights widened to int16 in registers, vpmaddwd against
// broadcast int16 pairs of the activations: exact int32 block dots), the portable kernel
// (same results) and the driver.
#include "q8_gemm.h"
#include "q4_act8.h"
#include "act_quant.h"
#include "parallel_chunks.h"
#include "q8_tiles.h"
#include "weight_memory.h"

#include <cstring>
#include <memory>

namespace roseinfer {

namespace {

constexpr int64_t kStepBytes = 32;                        // 16 columns x 2 k
constexpr int64_t kScaleOffset = 16 * kStepBytes;         // scales follow 512 weight bytes
constexpr int64_t kBlockBytes = kScaleOffset + 4 * kQ8Panel;  // 576
constexpr int64_t kQ4StepBytes = 16;                          // 32 nibbles
constexpr int64_t kQ4ScaleOffset = 16 * kQ4StepBytes;         // fp16 d, then fp16 m
constexpr int64_t kQ4BlockBytes = kQ4ScaleOffset + 4 * kQ8Panel;  // 320
constexpr int64_t kI8MBlockBytes = kBlockBytes + 4 * kQ8Panel;     // int8 layout + fp32 m: 640
constexpr int64_t kQ4MaxRows = 4;  // Q4_1: up to this many rows read the nibbles
#ifdef ROSEINFER_AVX512
constexpr int64_t kTileRows = 8;  // rows per register tile (32 registers)
#else
constexpr int64_t kTileRows = 5;
#endif

// Packed layouts: int8 (Q8_0), int8 with minimums (Q4_1's q as int8, for larger M), and
// nibbles (Q4_1, for decode steps).
enum class Kind { I8, I8M, Q4 };
constexpr int64_t block_bytes_of(Kind k) {
  return k == Kind::I8 ? kBlockBytes : k == Kind::I8M ? kI8MBlockBytes : kQ4BlockBytes;
}

inline int8_t packed_q(const uint8_t* blk, int c, int k) {
  return static_cast<int8_t>(blk[(k / 2) * kStepBytes + 2 * c + k % 2]);
}
inline int packed_q4(const uint8_t* blk, int c, int k) {
  const int b = 2 * c + k % 2;  // byte of the int8 layout's step
  const uint8_t v = blk[(k / 2) * kQ4StepBytes + b % 16];
  return b < 16 ? (v & 15) : (v >> 4);
}

// Portable kernel: one output element at a time, the same fp operations.
void panels_scalar(const int16_t* xq, const float* dx, const float* sx, int64_t M, int64_t K,
                   const uint8_t* wp, Kind kind, int64_t p0, int64_t p1, const float* bias,
                   float* y, int64_t N) {
  const int64_t KB = K / kQ8Block;
  const int64_t block_bytes = block_bytes_of(kind);
  float acc[kQ8Panel];
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t m = 0; m < M; ++m) {
      for (int c = 0; c < kQ8Panel; ++c) acc[c] = 0.f;
      for (int64_t j = 0; j < KB; ++j) {
        const uint8_t* blk = wp + (p * KB + j) * block_bytes;
        const int16_t* xr = xq + m * K + j * kQ8Block;
        const float d = dx[m * KB + j];
        for (int c = 0; c < kQ8Panel; ++c) {
          int32_t dot = 0;
          if (kind == Kind::Q4) {
            for (int k = 0; k < kQ8Block; ++k) dot += int32_t(xr[k]) * packed_q4(blk, c, k);
            acc[c] = std::fma(static_cast<float>(dot), d * half_at(blk + kQ4ScaleOffset + 2 * c),
                              acc[c]);
            acc[c] = std::fma(sx[m * KB + j], half_at(blk + kQ4ScaleOffset + 32 + 2 * c),
                              acc[c]);
            continue;
          }
          for (int k = 0; k < kQ8Block; ++k) dot += int32_t(xr[k]) * int32_t(packed_q(blk, c, k));
          float dw;
          std::memcpy(&dw, blk + kScaleOffset + 4 * c, 4);
          acc[c] = std::fma(static_cast<float>(dot), d * dw, acc[c]);
          if (kind == Kind::I8M) {
            float mw;
            std::memcpy(&mw, blk + kBlockBytes + 4 * c, 4);
            acc[c] = std::fma(sx[m * KB + j], mw, acc[c]);
          }
        }
      }
      const int64_t n0 = p * kQ8Panel;
      store_tile(acc, 1, n0, std::min<int64_t>(kQ8Panel, N - n0), bias, y + m * N, N);
    }
  }
}

#ifdef ROSEINFER_AVX2
// The integer part of one 32-block for MR rows x 16 columns, in inline asm (GCC spills
// the accumulators of an intrinsics version): 16 steps of two k; per step the 16
// columns' int8 pairs are widened to int16 (2 x vpmovsxbw), and per row the k-pair of
// int16 activations is broadcast and multiplied in with vpmaddwd (each int32 lane gets
// at most 2 * 32767 * 127 per step: exact).
#define Q8_HEAD "1:\n\tvpmovsxbw (%[w]), %%ymm12\n\tvpmovsxbw 16(%[w]), %%ymm13\n\t"
// Up to 4 rows the weights stream from memory: prefetch them 2 KB ahead (one line per
// two steps); a 5-row tile re-reads a panel already in L1.
#define Q8_HEAD_PF \
  "1:\n\tprefetcht0 2048(%[w])\n\tvpmovsxbw (%[w]), %%ymm12\n\tvpmovsxbw 16(%[w]), %%ymm13\n\t"
// Q4_1: 16 bytes of nibbles per step, widened (vpmovzxbw) and split into the low
// nibbles (columns 0-7) and high nibbles (columns 8-15).
#define Q4_HEAD                                                                        \
  "1:\n\tprefetcht0 1024(%[w])\n\tvpmovzxbw (%[w]), %%ymm12\n\tvpsrlw $4, %%ymm12, %%ymm13\n\t" \
  "vpand %[mask], %%ymm12, %%ymm12\n\t"
#define Q4_TAIL "add $16, %[w]\n\tadd $4, %[s]\n\tcmp $64, %[s]\n\tjne 1b\n\t"
#ifdef ROSEINFER_VNNI
// VNNI: vpdpwssd adds the pair products into the accumulators (the same exact sums).
#define Q8_ROW(m)                                        \
  "vpbroadcastd (%[x" #m "],%[s]), %%ymm14\n\t"          \
  RI_VNNI "vpdpwssd %%ymm12, %%ymm14, %[a" #m "0]\n\t"   \
  RI_VNNI "vpdpwssd %%ymm13, %%ymm14, %[a" #m "1]\n\t"
#else
#define Q8_ROW(m)                                 \
  "vpbroadcastd (%[x" #m "],%[s]), %%ymm14\n\t"   \
  "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"        \
  "vpaddd %%ymm15, %[a" #m "0], %[a" #m "0]\n\t"  \
  "vpmaddwd %%ymm13, %%ymm14, %%ymm14\n\t"        \
  "vpaddd %%ymm14, %[a" #m "1], %[a" #m "1]\n\t"
#endif
#define Q8_TAIL "add $32, %[w]\n\tadd $4, %[s]\n\tcmp $64, %[s]\n\tjne 1b\n\t"

#ifdef ROSEINFER_AVX512
// One 32-block on 512-bit registers: a step's 16 columns (int16 pairs) in one register,
// one accumulator per row, vpdpwssd (the same exact sums).  Q4_1: two steps' nibbles
// (32 bytes) widened at once, their low (columns 0-7) and high (8-15) halves regrouped
// per step.  Every tile prefetches the weights 2 KB (nibbles: 1 KB) ahead: tiles of up
// to 8 rows, so the first tile of a panel is often a full one.
template <int MR, bool Q4>
inline void block_int_zmm(const int16_t* const* xr, const uint8_t* wp, __m512i (&z)[MR]) {
  const __m512i nib = _mm512_set1_epi16(15);
  for (int s = 0; s < 16; s += 2) {
    __m512i w0, w1;
    if constexpr (Q4) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + kQ4StepBytes * s + 1024), _MM_HINT_T0);
      const __m512i v = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + kQ4StepBytes * s)));
      const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_srli_epi16(v, 4);
      w0 = _mm512_shuffle_i64x2(lo, hi, 0x44);  // step s: lo's first half, hi's first
      w1 = _mm512_shuffle_i64x2(lo, hi, 0xEE);  // step s + 1: the second halves
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(wp + kStepBytes * s + 2048), _MM_HINT_T0);
      w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + kStepBytes * s)));
      w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + kStepBytes * s + 32)));
    }
    for (int m = 0; m < MR; ++m) {
      z[m] = _mm512_dpwssd_epi32(z[m], w0, bcast4(xr[m] + 2 * s));
      z[m] = _mm512_dpwssd_epi32(z[m], w1, bcast4(xr[m] + 2 * s + 2));
    }
  }
}

// tile_avx2 on 512-bit registers: per row one integer and one fp32 accumulator register
// (16 columns), the same fp32 operations per column in the same order (the same bits).
template <int MR, Kind KIND>
void tile_zmm(const int16_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* w,
              int64_t n0, const float* bias, float* y, int64_t N) {
  const int64_t KB = K / kQ8Block;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < KB; ++j) {
    __m512i z[MR];
    const int16_t* xr[MR];
    for (int m = 0; m < MR; ++m) {
      z[m] = _mm512_setzero_si512();
      xr[m] = xq + m * K + j * kQ8Block;
    }
    __m512 dw, mw = _mm512_setzero_ps();
    if constexpr (KIND == Kind::Q4) {
      const uint8_t* blk = w + j * kQ4BlockBytes;
      block_int_zmm<MR, true>(xr, blk, z);
      const __m256i* hp = reinterpret_cast<const __m256i*>(blk + kQ4ScaleOffset);
      dw = _mm512_cvtph_ps(_mm256_loadu_si256(hp));
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(hp + 1));
    } else {
      const uint8_t* blk = w + j * block_bytes_of(KIND);
      block_int_zmm<MR, false>(xr, blk, z);
      dw = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + kScaleOffset));
      if constexpr (KIND == Kind::I8M) mw = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + kBlockBytes));
    }
    for (int m = 0; m < MR; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z[m]), _mm512_mul_ps(_mm512_set1_ps(dx[m * KB + j]), dw), acc[m]);
      if constexpr (KIND != Kind::I8) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(sx[m * KB + j]), mw, acc[m]);
    }
  }
  alignas(64) float out[MR * kQ8Panel];
  for (int m = 0; m < MR; ++m) _mm512_store_ps(out + m * kQ8Panel, acc[m]);
  store_tile(out, MR, n0, std::min<int64_t>(kQ8Panel, N - n0), bias, y, N);
}
#endif  // ROSEINFER_AVX512

// One 32-block for MR rows x 16 columns, int8 or Q4_1 weights.
template <int MR, bool Q4>
inline void block_int_avx2(const int16_t* const* xr, const uint8_t* wp, __m256i (&a)[MR][2]) {
  int64_t s = 0;
  const __m256i mask = _mm256_set1_epi16(15);
  if constexpr (Q4) {
    ROWTILE_ASM(Q4_HEAD, Q4_HEAD, Q8_ROW, Q4_TAIL)
  } else {
    ROWTILE_ASM(Q8_HEAD_PF, Q8_HEAD, Q8_ROW, Q8_TAIL)
  }
}
#undef Q8_HEAD
#undef Q4_HEAD
#undef Q4_TAIL
#undef Q8_HEAD_PF
#undef Q8_ROW
#undef Q8_TAIL

// Rows [0, MR) x one panel (w: its first block) into y (+ bias); xq: int16 rows of
// stride K, dx / sx: per-block scales / sums of stride K/32.
template <int MR, Kind KIND>
void tile_avx2(const int16_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* w,
               int64_t n0, const float* bias, float* y, int64_t N) {
  const int64_t KB = K / kQ8Block;
  alignas(64) float acc[MR * kQ8Panel] = {};
  for (int64_t j = 0; j < KB; ++j) {
    __m256i a[MR][2];
    const int16_t* xr[MR];
    for (int m = 0; m < MR; ++m) {
      a[m][0] = a[m][1] = _mm256_setzero_si256();
      xr[m] = xq + m * K + j * kQ8Block;
    }
    if constexpr (KIND == Kind::Q4) {
      const uint8_t* blk = w + j * kQ4BlockBytes;
      block_int_avx2<MR, true>(xr, blk, a);
      const __m128i* hp = reinterpret_cast<const __m128i*>(blk + kQ4ScaleOffset);
      const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128(hp)), dw1 = _mm256_cvtph_ps(_mm_loadu_si128(hp + 1));
      const __m256 mw0 = _mm256_cvtph_ps(_mm_loadu_si128(hp + 2)), mw1 = _mm256_cvtph_ps(_mm_loadu_si128(hp + 3));
      for (int m = 0; m < MR; ++m)
        add_q4_block(acc + m * kQ8Panel, a[m][0], a[m][1], dx[m * KB + j], sx[m * KB + j], dw0,
                     dw1, mw0, mw1);
    } else {
      const uint8_t* blk = w + j * block_bytes_of(KIND);
      block_int_avx2<MR, false>(xr, blk, a);
      const float* dwp = reinterpret_cast<const float*>(blk + kScaleOffset);
      const __m256 dw0 = _mm256_loadu_ps(dwp), dw1 = _mm256_loadu_ps(dwp + 8);
      for (int m = 0; m < MR; ++m) {
        const __m256 d = _mm256_set1_ps(dx[m * KB + j]);
        float* ar = acc + m * kQ8Panel;
        __m256 r0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][0]), _mm256_mul_ps(d, dw0), _mm256_load_ps(ar));
        __m256 r1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][1]), _mm256_mul_ps(d, dw1), _mm256_load_ps(ar + 8));
        if constexpr (KIND == Kind::I8M) {
          const float* mwp = reinterpret_cast<const float*>(blk + kBlockBytes);
          const __m256 sv = _mm256_set1_ps(sx[m * KB + j]);
          r0 = _mm256_fmadd_ps(sv, _mm256_loadu_ps(mwp), r0);
          r1 = _mm256_fmadd_ps(sv, _mm256_loadu_ps(mwp + 8), r1);
        }
        _mm256_store_ps(ar, r0);
        _mm256_store_ps(ar + 8, r1);
      }
    }
  }
  store_tile(acc, MR, n0, std::min<int64_t>(kQ8Panel, N - n0), bias, y, N);
}

template <Kind KIND>
void tile_avx2_rows(int64_t mr, const int16_t* xm, const float* dm, const float* sm, int64_t K,
                    const uint8_t* panel, int64_t n0, const float* bias, float* ym, int64_t N) {
#ifdef ROSEINFER_AVX512
  switch (mr) {
    case 1: tile_zmm<1, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    case 2: tile_zmm<2, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    case 3: tile_zmm<3, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    case 4: tile_zmm<4, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    case 5: tile_zmm<5, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    case 6: tile_zmm<6, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    case 7: tile_zmm<7, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    default: tile_zmm<8, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
  }
#else
  switch (mr) {
    case 1: tile_avx2<1, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    case 2: tile_avx2<2, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    case 3: tile_avx2<3, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    case 4: tile_avx2<4, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
    default: tile_avx2<5, KIND>(xm, dm, sm, K, panel, n0, bias, ym, N); break;
  }
#endif  // ROSEINFER_AVX512
}
#endif  // ROSEINFER_AVX2

// Output panels split over the threads; per thread, rows in chunks whose activations
// stay in L2, each panel (~K/2 KB, in L1) then swept by register tiles of rows.
void gemm(const Q8Gemm& g, const float* x, int64_t M, const float* bias, float* y,
          bool portable) {
  if (M <= 0 || g.N == 0) return;
  const int64_t K = g.K, N = g.N, KB = K / kQ8Block, NP = (N + kQ8Panel - 1) / kQ8Panel;
  std::unique_ptr<int16_t[]> xq(new int16_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * KB]), sx(new float[M * KB]);
  quantize_rows(x, M, K, xq.get(), dx.get(), sx.get(), portable);
  // Q4_1: decode-size steps read the nibbles, larger ones the int8 copy (same integers).
  const Kind kind = !g.q4 ? Kind::I8 : M <= kQ4MaxRows || !g.packed.defined() ? Kind::Q4 : Kind::I8M;
  const uint8_t* wp = (kind == Kind::Q4 ? g.packed4 : g.packed).data_ptr<uint8_t>();
  const int64_t panel_bytes = KB * block_bytes_of(kind);
  const int64_t mc = std::max<int64_t>(8, (int64_t(1) << 17) / K);  // ~256 KB of rows
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / (M * K * kQ8Panel));
  parallel_panels(NP, grain, M, kQ4MaxRows, [&](int64_t p0, int64_t p1) {
#ifdef ROSEINFER_AVX2
    if (!portable) {
      for (int64_t c0 = 0; c0 < M; c0 += mc) {
        for (int64_t p = p0; p < p1; ++p) {
          const uint8_t* panel = wp + p * panel_bytes;
          const int64_t n0 = p * kQ8Panel;
          for_row_tiles(c0, std::min(M, c0 + mc), kTileRows, [&](int64_t m, int64_t mr) {
            const int16_t* xm = xq.get() + m * K;
            const float* dm = dx.get() + m * KB;
            const float* sm = sx.get() + m * KB;
            if (kind == Kind::Q4)
              tile_avx2_rows<Kind::Q4>(mr, xm, dm, sm, K, panel, n0, bias, y + m * N, N);
            else if (kind == Kind::I8M)
              tile_avx2_rows<Kind::I8M>(mr, xm, dm, sm, K, panel, n0, bias, y + m * N, N);
            else
              tile_avx2_rows<Kind::I8>(mr, xm, dm, sm, K, panel, n0, bias, y + m * N, N);
          });
        }
      }
      return;
    }
#endif
    panels_scalar(xq.get(), dx.get(), sx.get(), M, K, wp, kind, p0, p1, bias, y, N);
  });
}

}  // namespace

void q8_quantize_act(const float* x, int64_t M, int64_t K, int16_t* xq, float* dx) {
  std::unique_ptr<float[]> sx(new float[M * (K / kQ8Block)]);
  quantize_rows(x, M, K, xq, dx, sx.get(), false);
}

Q8Gemm::Q8Gemm(const at::Tensor& q_, const at::Tensor& scales_,
               const c10::optional<at::Tensor>& mins_, bool act8_, bool int8_copy,
               int offset_) {
  TORCH_CHECK(q_.dim() == 2 && q_.scalar_type() == at::kChar && q_.size(1) % kQ8Block == 0,
              "Q8Gemm: expected int8 weights [N, K] with K % 32 == 0");
  N = q_.size(0);
  K = q_.size(1);
  const int64_t KB = K / kQ8Block;
  TORCH_CHECK(scales_.scalar_type() == at::kFloat && scales_.numel() == N * KB,
              "Q8Gemm: expected float32 scales [N, K / 32]");
  q4 = mins_.has_value() && mins_->defined();
  const auto q = q_.contiguous();
  const auto sc = scales_.contiguous();
  at::Tensor mn;
  if (q4) {
    mn = mins_->contiguous();
    TORCH_CHECK(mn.scalar_type() == at::kFloat && mn.numel() == N * KB,
                "Q8Gemm: expected float32 mins [N, K / 32]");
    TORCH_CHECK(!((q < 0) | (q > 15)).any().item<bool>(), "Q8Gemm: Q4_1 weights must lie in [0, 15]");
    TORCH_CHECK(at::equal(sc, sc.to(at::kHalf).to(at::kFloat)) && at::equal(mn, mn.to(at::kHalf).to(at::kFloat)),
                "Q8Gemm: Q4_1 scales and mins must be exact fp16 values");
  } else {
    TORCH_CHECK(!(q == -128).any().item<bool>(), "Q8Gemm: weights must lie in [-127, 127]");
  }
  act8 = act8_;
  TORCH_CHECK(!act8 || q4, "Q8Gemm: int8 activations need Q4_1 weights");
  offset = offset_;
  TORCH_CHECK(offset == 0 || (act8 && offset == 8), "Q8Gemm: offset 8 (Q4_0) needs act8");
  if (act8) {
    if (int8_copy) packed = pack_q4_act8(q, sc, mn, false, offset == 0);
    packed4 = pack_q4_act8(q, sc, mn, true, offset == 0);
    return;
  }
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const float* mp = q4 ? mn.data_ptr<float>() : nullptr;
  const int64_t NP = (N + kQ8Panel - 1) / kQ8Panel;
  const auto pack = [&](Kind kind) {
    const int64_t bb = block_bytes_of(kind);
    at::Tensor t = weight_zeros({NP * KB * bb}, at::kByte);
    uint8_t* out = t.data_ptr<uint8_t>();
    at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t j = 0; j < KB; ++j) {
          uint8_t* blk = out + (p * KB + j) * bb;
          for (int c = 0; c < kQ8Panel && p * kQ8Panel + c < N; ++c) {
            const int64_t n = p * kQ8Panel + c;
            const int8_t* src = qp + n * K + j * kQ8Block;
            if (kind == Kind::Q4) {
              for (int k = 0; k < kQ8Block; ++k) {
                const int b = 2 * c + k % 2;
                blk[(k / 2) * kQ4StepBytes + b % 16] |=
                    static_cast<uint8_t>(src[k] << (b < 16 ? 0 : 4));
              }
              const uint16_t d = c10::Half(sp[n * KB + j]).x, m = c10::Half(mp[n * KB + j]).x;
              std::memcpy(blk + kQ4ScaleOffset + 2 * c, &d, 2);
              std::memcpy(blk + kQ4ScaleOffset + 32 + 2 * c, &m, 2);
              continue;
            }
            for (int k = 0; k < kQ8Block; ++k)
              blk[(k / 2) * kStepBytes + 2 * c + k % 2] = static_cast<uint8_t>(src[k]);
            std::memcpy(blk + kScaleOffset + 4 * c, sp + n * KB + j, 4);
            if (kind == Kind::I8M) std::memcpy(blk + kBlockBytes + 4 * c, mp + n * KB + j, 4);
          }
        }
    });
    return t;
  };
  if (!q4 || int8_copy) packed = pack(q4 ? Kind::I8M : Kind::I8);
  if (q4) packed4 = pack(Kind::Q4);
}

void Q8Gemm::run(const float* x, int64_t M, const float* bias, float* y) const {
  const uint8_t* bytes = packed.defined() ? packed.data_ptr<uint8_t>() : nullptr;
  if (act8)
    gemm_q4_act8(bytes, packed4.data_ptr<uint8_t>(), N, K, x, M, bias, y, false, offset);
  else
    gemm(*this, x, M, bias, y, false);
}

void Q8Gemm::run_reference(const float* x, int64_t M, const float* bias, float* y) const {
  const uint8_t* bytes = packed.defined() ? packed.data_ptr<uint8_t>() : nullptr;
  if (act8)
    gemm_q4_act8(bytes, packed4.data_ptr<uint8_t>(), N, K, x, M, bias, y, true, offset);
  else
    gemm(*this, x, M, bias, y, true);
}

}  // namespace roseinfer
