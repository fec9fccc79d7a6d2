// Batch-invariant fp16 panel GEMM (see panel_gemm.h): packing and the AVX2 micro-kernels,
// with a portable fallback computing the same chains in plain C++.
#include "panel_gemm.h"

#include <cstring>

#include "parallel_chunks.h"
#include "weight_memory.h"

namespace roseinfer {

PanelGemm::PanelGemm(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "PanelGemm: w must be [N, K]");
  N = w.size(0);
  K = w.size(1);
  Np = (N + 15) / 16 * 16;
  bf16 = w.scalar_type() == at::kBFloat16;
  auto wh = w.to(bf16 ? at::kBFloat16 : at::kHalf).contiguous();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wh.data_ptr());
  f16 = weight_zeros({Np / 16, K, 16}, wh.scalar_type());
  uint16_t* fp = reinterpret_cast<uint16_t*>(f16.data_ptr());
  at::parallel_for(0, Np / 16, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t n = p0 * 16; n < std::min(N, p1 * 16); ++n)
      for (int64_t k = 0; k < K; ++k) fp[((n / 16) * K + k) * 16 + n % 16] = wp[n * K + k];
  });
}

// One 16-bit weight as fp32 (exact).
static inline float weight_at(const uint16_t* p, bool bf16) {
  if (!bf16) return static_cast<float>(c10::Half(*p, c10::Half::from_bits()));
  const uint32_t bits = uint32_t(*p) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

#ifdef ROSEINFER_AVX2
// MR rows x 16 columns of an fp16 panel [K][16].
static inline __m256 widen8(const __m128i* p, bool bf16) {
  const __m128i h = _mm_loadu_si128(p);
  if (!bf16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// MR rows x NP adjacent panels (16 columns each, panel stride K * 16): NP > 1 gives a
// one- or two-row step more independent FMA chains (the same chain per output).
template <int MR, int NP, bool BF16>
static inline void f16_tile(const float* x, int64_t K, const uint16_t* panel, float* out,
                            int64_t ldo) {
  __m256 acc[MR][2 * NP];
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < 2 * NP; ++i) acc[m][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    for (int q = 0; q < NP; ++q) {
      const __m128i* p = reinterpret_cast<const __m128i*>(panel + q * K * 16);
      const __m256 w0 = widen8(p + 2 * k, BF16);
      const __m256 w1 = widen8(p + 2 * k + 1, BF16);
      for (int m = 0; m < MR; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
        acc[m][2 * q] = _mm256_fmadd_ps(xb, w0, acc[m][2 * q]);
        acc[m][2 * q + 1] = _mm256_fmadd_ps(xb, w1, acc[m][2 * q + 1]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < 2 * NP; ++i) _mm256_storeu_ps(out + m * ldo + 8 * i, acc[m][i]);
}

// Copy a tile's [rows, cols] results into y (+ bias), dropping padded columns.
static inline void emit(const float* tile, int64_t ldt, int64_t rows, int64_t n0, int64_t cols,
                        const float* bias, float* y, int64_t N) {
  const int64_t nc = std::min(cols, N - n0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < nc; ++c) y[m * N + n0 + c] = tile[m * ldt + c] + (bias ? bias[n0 + c] : 0.f);
}

// Steps of up to this many rows are GEMVs bound by memory: equal ranges of panels a
// thread (parallel_panels), as the other formats' few-row steps.
constexpr int64_t kF16FewRows = 4;

// fp16 format, every M: 16-column panels, 6 rows per tile (1-2 rows: 4 / 2 panels).
template <bool BF16>
static void run_f16(const PanelGemm& g, const float* x, int64_t M, const float* bias, float* y) {
  const int64_t K = g.K, panels = g.Np / 16;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(g.f16.data_ptr());
  parallel_panels(panels, 1, M, kF16FewRows, [&](int64_t p0, int64_t p1) {
    float tile[6 * 16 * 4];
    int64_t p = p0;
    // One or two rows: 4 / 2 panels per tile (8 FMA chains per row, not 2).
    for (; M <= 2 && p + 4 / M <= p1; p += 4 / M) {
      const uint16_t* panel = w + p * K * 16;
      if (M == 1) f16_tile<1, 4, BF16>(x, K, panel, tile, 64);
      else f16_tile<2, 2, BF16>(x, K, panel, tile, 32);
      emit(tile, 64 / M, M, p * 16, 64 / M, bias, y, g.N);
    }
    for (; p < p1; ++p) {
      const uint16_t* panel = w + p * K * 16;
      for (int64_t m0 = 0; m0 < M; m0 += 6) {
        const float* xm = x + m0 * K;
        const int64_t mr = std::min<int64_t>(6, M - m0);
        switch (mr) {
          case 1: f16_tile<1, 1, BF16>(xm, K, panel, tile, 16); break;
          case 2: f16_tile<2, 1, BF16>(xm, K, panel, tile, 16); break;
          case 3: f16_tile<3, 1, BF16>(xm, K, panel, tile, 16); break;
          case 4: f16_tile<4, 1, BF16>(xm, K, panel, tile, 16); break;
          case 5: f16_tile<5, 1, BF16>(xm, K, panel, tile, 16); break;
          default: f16_tile<6, 1, BF16>(xm, K, panel, tile, 16); break;
        }
        emit(tile, 16, mr, p * 16, 16, bias, y + m0 * g.N, g.N);
      }
    }
  });
}
#endif  // ROSEINFER_AVX2

// Portable: the same chains in plain C++.
[[maybe_unused]] static void run_portable(const PanelGemm& g, const float* x, int64_t M,
                                          const float* bias, float* y) {
  const int64_t K = g.K;
  at::parallel_for(0, g.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) {
        const float* xm = x + m * K;
        float acc = 0.f;
        const uint16_t* col = reinterpret_cast<const uint16_t*>(g.f16.data_ptr()) + (n / 16) * K * 16 + n % 16;
        for (int64_t k = 0; k < K; ++k) acc = std::fma(xm[k], weight_at(col + k * 16, g.bf16), acc);
        y[m * g.N + n] = acc + (bias ? bias[n] : 0.f);
      }
  });
}

void PanelGemm::run(const float* x, int64_t M, const float* bias, float* y, bool portable) const {
  if (M <= 0) return;
#ifdef ROSEINFER_AVX2
  if (!portable) return bf16 ? run_f16<true>(*this, x, M, bias, y) : run_f16<false>(*this, x, M, bias, y);
#endif
  run_portable(*this, x, M, bias, y);
}

}  // namespace roseinfer
