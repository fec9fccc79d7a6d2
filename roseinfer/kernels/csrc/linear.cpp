// Linear layer kernel (see linear.h).
#include "linear.h"

#include <cstdlib>

namespace roseinfer {

#ifdef ROSEINFER_AVX2
// y[m, n] = x[m, :] . w[n, :] (+ b[n]) for MM input rows and one weight row: fp32
// products, four fp32 partial sums per input row, one reduction at the end.  One weight
// row at a time keeps a single sequential stream per thread, which the hardware
// prefetcher follows best (measured: 32 GB/s vs 23 GB/s for 4 interleaved rows).
template <int MM>
static inline void gemv_row(const float* x, const float* w, const float* b, float* y,
                            int64_t n, int64_t K, int64_t N) {
  __m256 acc[MM][4];
  for (int m = 0; m < MM; ++m)
    for (int h = 0; h < 4; ++h) acc[m][h] = _mm256_setzero_ps();
  const float* wr = w + n * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m256 wv[4];
    for (int h = 0; h < 4; ++h) wv[h] = _mm256_loadu_ps(wr + k + 8 * h);
    for (int m = 0; m < MM; ++m)
      for (int h = 0; h < 4; ++h)
        acc[m][h] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * h), wv[h], acc[m][h]);
  }
  for (; k < K; k += 8) {
    const __m256 wv = _mm256_loadu_ps(wr + k);
    for (int m = 0; m < MM; ++m)
      acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[m][0]);
  }
  for (int m = 0; m < MM; ++m)
    y[m * N + n] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]),
                                       _mm256_add_ps(acc[m][2], acc[m][3]))) +
                   (b ? b[n] : 0.f);
}

// y[m, n] = sum over 32-blocks j of scale[n, j] * (q[n, 32j:32j+32] . x[m, 32j:32j+32]):
// int8 weights widened to fp32 in registers, fp32 products and accumulation.
static inline __m256 load_i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int MM>
static inline void q8_row(const float* x, const int8_t* q, const float* sc, const float* b,
                          float* y, int64_t n, int64_t K, int64_t N) {
  __m256 acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = _mm256_setzero_ps();
  const int8_t* qr = q + n * K;
  const float* sr = sc + n * (K / 32);
  for (int64_t j = 0; j < K / 32; ++j) {
    const int8_t* p = qr + 32 * j;
    const __m256 w0 = load_i8x8(p), w1 = load_i8x8(p + 8), w2 = load_i8x8(p + 16),
                 w3 = load_i8x8(p + 24);
    const __m256 s = _mm256_set1_ps(sr[j]);
    for (int m = 0; m < MM; ++m) {
      const float* xm = x + m * K + 32 * j;
      __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xm));
      t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), t);
      t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), t);
      t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), t);
      acc[m] = _mm256_fmadd_ps(t, s, acc[m]);
    }
  }
  for (int m = 0; m < MM; ++m) y[m * N + n] = hsum8(acc[m]) + (b ? b[n] : 0.f);
}

template <int MM>
static void gemv_q8(const float* x, const int8_t* q, const float* sc, const float* b, float* y,
                    int64_t K, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) q8_row<MM>(x, q, sc, b, y, n, K, N);
  });
}

// Small-batch fp32 GEMM (M <= 4, K % 8 == 0): memory-bound, so stream W once with the
// output rows split over the intra-op threads (MKL runs one row of x as a slow GEMM).
template <int MM>
static void gemv_fp32(const float* x, const float* w, const float* b, float* y, int64_t K,
                      int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) gemv_row<MM>(x, w, b, y, n, K, N);
  });
}
#endif

Linear::Linear(at::Tensor w, std::optional<at::Tensor> b, bool fp16) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "Linear: weight must be a 2-D float32 CPU tensor");
  out_features = w.size(0);
  in_features = w.size(1);
  if (b.has_value() && b->defined()) bias = b->contiguous().to(at::kFloat);
  if (fp16) {
    auto wc = w.contiguous();
    packed = std::make_unique<fbgemm::PackedGemmMatrixFP16>(
        fbgemm::matrix_op_t::Transpose, (int)in_features, (int)out_features, 1.0f,
        wc.data_ptr<float>());
  } else {
    weight = w;
    const char* env = std::getenv("ROSEINFER_FP32_GEMV");
    use_gemv = !(env && env[0] == '0');
  }
}

void Linear::set_bf16_weight(at::Tensor w, int64_t min_rows) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) == out_features &&
                  w.size(1) == in_features,
              "Linear.set_bf16_weight: expected a bf16 [out_features, in_features] tensor");
  TORCH_CHECK(min_rows >= 1, "Linear.set_bf16_weight: min_rows must be >= 1");
  weight_bf16 = w.contiguous();
  bf16_min_rows = min_rows;
}

void Linear::set_int8_weight(at::Tensor q, at::Tensor scales, int64_t max_rows) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(0) == out_features &&
                  q.size(1) == in_features && in_features % 32 == 0,
              "Linear.set_int8_weight: expected int8 [out_features, in_features], "
              "in_features a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == out_features * (in_features / 32),
              "Linear.set_int8_weight: expected float32 scales [out_features, in_features / 32]");
  TORCH_CHECK(max_rows >= 1 && max_rows <= 4, "Linear.set_int8_weight: max_rows in 1..4");
  qweight = q.contiguous();
  qscales = scales.contiguous();
  int8_max_rows = max_rows;
}

void Linear::run(const at::Tensor& x, at::Tensor& y) const {
  const int64_t m = x.size(0);
#ifdef ROSEINFER_AVX2
  if (qweight.defined() && m <= int8_max_rows) {
    const float* xp = x.data_ptr<float>();
    const int8_t* qp = qweight.data_ptr<int8_t>();
    const float* sp = qscales.data_ptr<float>();
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    switch (m) {
      case 1: gemv_q8<1>(xp, qp, sp, bp, yp, in_features, out_features); return;
      case 2: gemv_q8<2>(xp, qp, sp, bp, yp, in_features, out_features); return;
      case 3: gemv_q8<3>(xp, qp, sp, bp, yp, in_features, out_features); return;
      case 4: gemv_q8<4>(xp, qp, sp, bp, yp, in_features, out_features); return;
      default: break;
    }
  }
#endif
  if (weight_bf16.defined() && m >= bf16_min_rows) {
    y.copy_(at::linear(x.to(at::kBFloat16), weight_bf16));
    if (bias.defined()) y.add_(bias);
    return;
  }
  if (packed) {
    const int nt = std::max<int>(1, at::get_num_threads());
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const auto& bp = *packed;
    if (nt == 1) {
      fbgemm::cblas_gemm_compute(fbgemm::matrix_op_t::NoTranspose, (int)m, xp, bp, 0.0f, yp);
    } else {
      at::parallel_for(0, nt, 1, [&](int64_t b0, int64_t e0) {
        for (int64_t t = b0; t < e0; ++t)
          fbgemm::cblas_gemm_compute(fbgemm::matrix_op_t::NoTranspose, (int)m, xp, bp, 0.0f,
                                     yp, (int)t, nt);
      });
    }
    if (bias.defined()) y.add_(bias);
    return;
  }
#ifdef ROSEINFER_AVX2
  if (m <= 4 && in_features % 8 == 0 && weight.is_contiguous() && use_gemv) {
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const int64_t K = in_features, N = out_features;
    switch (m) {
      case 1: gemv_fp32<1>(xp, wp, bp, yp, K, N); return;
      case 2: gemv_fp32<2>(xp, wp, bp, yp, K, N); return;
      case 3: gemv_fp32<3>(xp, wp, bp, yp, K, N); return;
      case 4: gemv_fp32<4>(xp, wp, bp, yp, K, N); return;
      default: break;
    }
  }
#endif
  if (bias.defined()) {
    at::addmm_out(y, bias, x, weight.t());
  } else {
    at::mm_out(y, x, weight.t());
  }
}

at::Tensor Linear::forward(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == in_features,
              "Linear: input must be float32 [..., in_features]");
  auto sizes = x.sizes().vec();
  auto x2 = x.reshape({-1, in_features}).contiguous();
  auto y = at::empty({x2.size(0), out_features}, x.options());
  run(x2, y);
  sizes.back() = out_features;
  return y.view(sizes);
}

}  // namespace roseinfer
