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

// fp32 GEMM for every M (K % 8 == 0): each output element is gemv_row's arithmetic
// whatever the row count (the MM template only shares the weight loads), so a row's
// result never depends on the batch (docs/CONTRACTS.md).  Columns are split over the
// intra-op threads in blocks whose weights stay in cache while 4-row chunks of x pass.
static void gemm_fp32(const float* x, const float* w, const float* b, float* y, int64_t M,
                      int64_t K, int64_t N) {
  constexpr int64_t kCols = 32;
  at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0 * kCols; nb < std::min(N, b1 * kCols); nb += kCols) {
      const int64_t ne = std::min(N, nb + kCols);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* xm = x + m0 * K;
        float* ym = y + m0 * N;
        for (int64_t n = nb; n < ne; ++n) {
          switch (std::min<int64_t>(4, M - m0)) {
            case 1: gemv_row<1>(xm, w, b, ym, n, K, N); break;
            case 2: gemv_row<2>(xm, w, b, ym, n, K, N); break;
            case 3: gemv_row<3>(xm, w, b, ym, n, K, N); break;
            default: gemv_row<4>(xm, w, b, ym, n, K, N); break;
          }
        }
      }
    }
  });
}
#endif

// gemm_fp32 without SIMD (builds without AVX2; forward_portable): every output element
// is gemv_row's arithmetic, lane by lane (p[h][l] the FMA chain of k = 32 i + 8 h + l,
// the tail's steps of 8 into p[0], then the lanes summed as gemv_row and hsum8 sum them),
// so a row's bits never depend on the batch here either (at::mm's do) and equal the AVX2
// kernel's.
static void gemm_fp32_portable(const float* x, const float* w, const float* b, float* y,
                               int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      for (int64_t n = n0; n < n1; ++n) {
        const float* wr = w + n * K;
        float p[4][8] = {};
        int64_t k = 0;
        for (; k + 32 <= K; k += 32)
          for (int h = 0; h < 4; ++h)
            for (int l = 0; l < 8; ++l)
              p[h][l] = std::fma(xr[k + 8 * h + l], wr[k + 8 * h + l], p[h][l]);
        for (; k < K; k += 8)
          for (int l = 0; l < 8; ++l) p[0][l] = std::fma(xr[k + l], wr[k + l], p[0][l]);
        float t[4];  // hsum8: lanes l and l + 4, then (t0 + t2) + (t1 + t3)
        for (int l = 0; l < 4; ++l)
          t[l] = ((p[0][l] + p[1][l]) + (p[2][l] + p[3][l])) +
                 ((p[0][l + 4] + p[1][l + 4]) + (p[2][l + 4] + p[3][l + 4]));
        y[m * N + n] = ((t[0] + t[2]) + (t[1] + t[3])) + (b ? b[n] : 0.f);
      }
    }
  });
}

Linear::Linear(at::Tensor w, std::optional<at::Tensor> b, bool fp16) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "Linear: weight must be a 2-D float32 CPU tensor");
  out_features = w.size(0);
  in_features = w.size(1);
  if (b.has_value() && b->defined()) bias = b->contiguous().to(at::kFloat);
  if (fp16) {
    panels = std::make_shared<PanelGemm>(w);
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

void Linear::set_int8_weight(at::Tensor q, at::Tensor scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(0) == out_features &&
                  q.size(1) == in_features && in_features % 32 == 0,
              "Linear.set_int8_weight: expected int8 [out_features, in_features], "
              "in_features a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == out_features * (in_features / 32),
              "Linear.set_int8_weight: expected float32 scales [out_features, in_features / 32]");
  q8 = std::make_shared<Q8Gemm>(q, scales);
  panels.reset();
  // Every input now runs the int8 kernel: the other copies would only hold memory.
  weight = at::Tensor();
  weight_bf16 = at::Tensor();
}

void Linear::set_q4_weight(at::Tensor q, at::Tensor scales, at::Tensor mins, bool act8) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(0) == out_features &&
                  q.size(1) == in_features && in_features % 32 == 0,
              "Linear.set_q4_weight: expected int8 [out_features, in_features] in [0, 15], "
              "in_features a multiple of 32");
  q8 = std::make_shared<Q8Gemm>(q, scales, mins, act8);
  panels.reset();
  weight = at::Tensor();
  weight_bf16 = at::Tensor();
}

void Linear::set_gguf_weight(std::vector<int64_t> types, std::vector<at::Tensor> raws, bool act8,
                             bool extra_copy) {
  auto g = std::make_shared<GgufGemm>(types, raws, act8, extra_copy);
  TORCH_CHECK(!bias.defined() || bias.numel() == g->N,
              "Linear.set_gguf_weight: bias of ", bias.numel(), " for ", g->N, " output columns");
  gguf = g;
  in_features = g->K;
  out_features = g->N;
  q8.reset();
  panels.reset();
  weight = at::Tensor();
  weight_bf16 = at::Tensor();
}

void Linear::run(const at::Tensor& x, at::Tensor& y) const {
  const int64_t m = x.size(0);
  if (weight_bf16.defined() && m >= bf16_min_rows) {  // fp16+bf16 only: not invariant
    y.copy_(at::linear(x.to(at::kBFloat16), weight_bf16));
    if (bias.defined()) y.add_(bias);
    return;
  }
  if (gguf) {
    gguf->run(x.data_ptr<float>(), m, bias.defined() ? bias.data_ptr<float>() : nullptr,
              y.data_ptr<float>(), false);
    return;
  }
  if (q8) {
    q8->run(x.data_ptr<float>(), m, bias.defined() ? bias.data_ptr<float>() : nullptr,
            y.data_ptr<float>());
    return;
  }
  if (panels) {
    panels->run(x.data_ptr<float>(), m, bias.defined() ? bias.data_ptr<float>() : nullptr,
                y.data_ptr<float>());
    return;
  }
  if (in_features % 8 == 0 && weight.is_contiguous() && use_gemv) {
#ifdef ROSEINFER_AVX2
    gemm_fp32(x.data_ptr<float>(), weight.data_ptr<float>(),
              bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(), m,
              in_features, out_features);
#else
    gemm_fp32_portable(x.data_ptr<float>(), weight.data_ptr<float>(),
                       bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                       m, in_features, out_features);
#endif
    return;
  }
  if (bias.defined()) {
    at::addmm_out(y, bias, x, weight.t());
  } else {
    at::mm_out(y, x, weight.t());
  }
}

at::Tensor Linear::forward_portable(at::Tensor x) {
  // fp32 weights (the int8 / GGUF setters drop them): run's condition for gemm_fp32.
  const bool fp32 = weight.defined() && !panels && in_features % 8 == 0 && weight.is_contiguous();
  TORCH_CHECK((q8 || gguf || fp32) && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.size(1) == in_features,
              "Linear.forward_portable: int8 / GGUF weights or contiguous fp32 ones "
              "(in_features a multiple of 8) and a float32 [M, in_features] input");
  auto x2 = x.contiguous();
  auto y = at::empty({x2.size(0), out_features}, x.options());
  if (fp32) {
    gemm_fp32_portable(x2.data_ptr<float>(), weight.data_ptr<float>(),
                       bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                       x2.size(0), in_features, out_features);
    return y;
  }
  if (gguf) {
    gguf->run(x2.data_ptr<float>(), x2.size(0), bias.defined() ? bias.data_ptr<float>() : nullptr,
              y.data_ptr<float>(), true);
    return y;
  }
  q8->run_reference(x2.data_ptr<float>(), x2.size(0),
                    bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
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

bool Linear::has_greedy() const {
  return GreedyHead::available() && gguf && !bias.defined() && gguf->segments.size() == 1 &&
         gguf->segments[0].quant && gguf->segments[0].type == kQ8_0;
}

std::tuple<at::Tensor, at::Tensor> Linear::greedy(at::Tensor x) const {
  TORCH_CHECK(has_greedy(), "Linear.greedy: a GGUF Q8_0 head without bias, in a build with "
              "AVX-512 VNNI and VBMI");
  std::call_once(greedy_once, [&] {
    greedy_head = std::make_shared<GreedyHead>(gguf->segments[0].quant);
  });
  return greedy_head->run(x);
}

}  // namespace roseinfer
