// Batch-invariant panel GEMM (see panel_gemm.h): packing and the AVX2 micro-kernels,
// with a portable fallback computing the same chains in plain C++.
#include "panel_gemm.h"

#include <cstring>

namespace roseinfer {

PanelGemm::PanelGemm(const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(1) % 32 == 0,
              "PanelGemm: q must be int8 [N, K] with K a multiple of 32");
  N = q.size(0);
  K = q.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N * (K / 32),
              "PanelGemm: scales must be float32 [N, K / 32]");
  Np = (N + 31) / 32 * 32;
  auto qc = q.contiguous();
  auto sc = scales.contiguous();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  q8 = at::zeros({Np / 32, K, 32}, q.options());
  s8 = at::zeros({Np / 32, K / 32, 32}, sc.options());
  int8_t* q8p = q8.data_ptr<int8_t>();
  float* s8p = s8.data_ptr<float>();
  q16 = at::zeros({Np / 16, K, 16}, sc.options().dtype(at::kHalf));  // the same q, exact
  at::Half* q16p = q16.data_ptr<at::Half>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      q8p[((n / 32) * K + k) * 32 + n % 32] = qp[n * K + k];
      q16p[((n / 16) * K + k) * 16 + n % 16] = at::Half((float)qp[n * K + k]);
    }
    for (int64_t j = 0; j < K / 32; ++j) s8p[((n / 32) * (K / 32) + j) * 32 + n % 32] = sp[n * (K / 32) + j];
  }
}

PanelGemm::PanelGemm(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "PanelGemm: w must be [N, K]");
  N = w.size(0);
  K = w.size(1);
  Np = (N + 31) / 32 * 32;
  auto wh = w.to(at::kHalf).contiguous();
  const at::Half* wp = wh.data_ptr<at::Half>();
  f16 = at::zeros({Np / 16, K, 16}, wh.options());
  at::Half* fp = f16.data_ptr<at::Half>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) fp[((n / 16) * K + k) * 16 + n % 16] = wp[n * K + k];
}

#ifdef ROSEINFER_AVX2
// 8 weights q of one k, as fp32 (exact small integers): from int8, or from their fp16
// copy (one F16C convert instead of a widen and a convert).
static inline __m256 w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline __m256 w8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// MR rows x 8*NV columns of an int8 panel [K][32], starting at column col0 (0 or 16 with
// NV == 2; 0 with NV == 4).  Per element and 32-block j: t = FMA chain of x * q over the
// block's k in order (from 0), then acc = fma(t, s[n, j], acc); out = acc.  The tile
// shape only decides which elements share the widened weights.
template <int MR, int NV, typename Q>
static inline void q8_tile(const float* x, int64_t K, const Q* panel, int64_t ldw,
                           const float* pscales, int col0, float* out, int64_t ldo) {
  // acc lives in `out` (L1): only the MR x NV chains t stay in registers.
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + m * ldo + 8 * v, _mm256_setzero_ps());
  for (int64_t j = 0; j < K / 32; ++j) {
    __m256 t[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) t[m][v] = _mm256_setzero_ps();
    for (int64_t k = 32 * j; k < 32 * j + 32; ++k) {
      __m256 w[NV];
      for (int v = 0; v < NV; ++v) w[v] = w8(panel + k * ldw + 8 * v);
      for (int m = 0; m < MR; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
        for (int v = 0; v < NV; ++v) t[m][v] = _mm256_fmadd_ps(xb, w[v], t[m][v]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m256 s = _mm256_loadu_ps(pscales + j * 32 + col0 + 8 * v);
      for (int m = 0; m < MR; ++m) {
        float* a = out + m * ldo + 8 * v;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(t[m][v], s, _mm256_loadu_ps(a)));
      }
    }
  }
}

// MR rows x 16 columns of an fp16 panel [K][16].
template <int MR>
static inline void f16_tile(const float* x, int64_t K, const at::Half* panel, float* out,
                            int64_t ldo) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m128i* p = reinterpret_cast<const __m128i*>(panel);
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(p + 2 * k));
    const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128(p + 2 * k + 1));
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + m * ldo, acc[m][0]);
    _mm256_storeu_ps(out + m * ldo + 8, acc[m][1]);
  }
}

// Copy a tile's [rows, cols] results into y (+ bias), dropping padded columns.
static inline void emit(const float* tile, int64_t ldt, int64_t rows, int64_t n0, int64_t cols,
                        const float* bias, float* y, int64_t N) {
  const int64_t nc = std::min(cols, N - n0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < nc; ++c) y[m * N + n0 + c] = tile[m * ldt + c] + (bias ? bias[n0 + c] : 0.f);
}

// int8 format, every M: 32 columns per work item over the threads.  One row: the int8
// panel, whole panel per tile (4 independent chains; half the bytes of fp16).  More rows:
// the fp16 copy of the same q (cheaper to widen) in 16-column panels, 4 rows per tile
// (6 spill the chains: measured 24% slower).
static void run_q8(const PanelGemm& g, const float* x, int64_t M, const float* bias, float* y) {
  const int64_t K = g.K, panels = g.Np / 32;
  const float* s = g.s8.data_ptr<float>();
  const int8_t* q8 = g.q8.data_ptr<int8_t>();
  const at::Half* q16 = g.q16.data_ptr<at::Half>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    float tile[4 * 32];
    for (int64_t p = p0; p < p1; ++p) {
      const float* ps = s + p * (K / 32) * 32;
      if (M <= g.small_rows) {  // one row: the whole int8 panel
        q8_tile<1, 4>(x, K, q8 + p * K * 32, 32, ps, 0, tile, 32);
        emit(tile, 32, 1, p * 32, 32, bias, y, g.N);
        continue;
      }
      for (int half = 0; half < 2; ++half) {  // two 16-column fp16 panels
        const at::Half* panel = q16 + (2 * p + half) * K * 16;
        const int c0 = 16 * half;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const float* xm = x + m0 * K;
          const int64_t mr = std::min<int64_t>(4, M - m0);
          switch (mr) {
            case 1: q8_tile<1, 2>(xm, K, panel, 16, ps, c0, tile, 16); break;
            case 2: q8_tile<2, 2>(xm, K, panel, 16, ps, c0, tile, 16); break;
            case 3: q8_tile<3, 2>(xm, K, panel, 16, ps, c0, tile, 16); break;
            default: q8_tile<4, 2>(xm, K, panel, 16, ps, c0, tile, 16); break;
          }
          emit(tile, 16, mr, p * 32 + c0, 16, bias, y + m0 * g.N, g.N);
        }
      }
    }
  });
}

// fp16 format, every M: 16-column panels, 6 rows per tile.
static void run_f16(const PanelGemm& g, const float* x, int64_t M, const float* bias, float* y) {
  const int64_t K = g.K, panels = g.Np / 16;
  const at::Half* w = g.f16.data_ptr<at::Half>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    float tile[6 * 16];
    for (int64_t p = p0; p < p1; ++p) {
      const at::Half* panel = w + p * K * 16;
      for (int64_t m0 = 0; m0 < M; m0 += 6) {
        const float* xm = x + m0 * K;
        const int64_t mr = std::min<int64_t>(6, M - m0);
        switch (mr) {
          case 1: f16_tile<1>(xm, K, panel, tile, 16); break;
          case 2: f16_tile<2>(xm, K, panel, tile, 16); break;
          case 3: f16_tile<3>(xm, K, panel, tile, 16); break;
          case 4: f16_tile<4>(xm, K, panel, tile, 16); break;
          case 5: f16_tile<5>(xm, K, panel, tile, 16); break;
          default: f16_tile<6>(xm, K, panel, tile, 16); break;
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
        if (g.q8.defined()) {
          const int8_t* col = g.q8.data_ptr<int8_t>() + (n / 32) * K * 32 + n % 32;
          const float* sc = g.s8.data_ptr<float>() + (n / 32) * (K / 32) * 32 + n % 32;
          for (int64_t j = 0; j < K / 32; ++j) {
            float t = 0.f;
            for (int64_t k = 32 * j; k < 32 * j + 32; ++k) t = std::fma(xm[k], (float)col[k * 32], t);
            acc = std::fma(t, sc[j * 32], acc);
          }
        } else {
          const at::Half* col = g.f16.data_ptr<at::Half>() + (n / 16) * K * 16 + n % 16;
          for (int64_t k = 0; k < K; ++k) acc = std::fma(xm[k], (float)col[k * 16], acc);
        }
        y[m * g.N + n] = acc + (bias ? bias[n] : 0.f);
      }
  });
}

void PanelGemm::run(const float* x, int64_t M, const float* bias, float* y) const {
  if (M <= 0) return;
#ifdef ROSEINFER_AVX2
  if (q8.defined()) return run_q8(*this, x, M, bias, y);
  return run_f16(*this, x, M, bias, y);
#else
  run_portable(*this, x, M, bias, y);
#endif
}

}  // namespace roseinfer
