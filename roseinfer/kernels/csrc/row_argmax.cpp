// Row argmax (see row_argmax.h).
#include "row_argmax.h"

#include <limits>

namespace roseinfer {

namespace {

// The row's maximum ignoring NaNs, and whether it holds a NaN.
std::pair<float, bool> max_and_nan(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef ROSEINFER_AVX2
  __m256 vm = _mm256_set1_ps(m), vnan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vm = _mm256_max_ps(v, vm);  // a NaN in v yields vm: NaNs are tracked apart
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float l : lanes) m = l > m ? l : m;
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  return {m, nan};
}

}  // namespace

std::pair<float, int64_t> row_argmax(const float* x, int64_t n) {
  const auto [m, nan] = max_and_nan(x, n);
  int64_t i = 0;
  if (nan) {  // rare: the first NaN, as torch.argmax
    while (!std::isnan(x[i])) ++i;
    return {x[i], i};
  }
#ifdef ROSEINFER_AVX2
  const __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
    if (mask) return {m, i + __builtin_ctz((unsigned)mask)};
  }
#endif
  for (; i < n; ++i) {
    if (x[i] == m) return {m, i};
  }
  return {m, 0};  // unreachable: m is one of the row's values
}

std::tuple<at::Tensor, at::Tensor> row_argmax_op(at::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0,
              "row_argmax: float32 logits [B, V] with V >= 1");
  auto x = logits.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  auto values = at::empty({B}, x.options());
  auto ids = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, B, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) std::tie(vp[b], ip[b]) = row_argmax(xp + b * V, V);
  });
  return {values, ids};
}

}  // namespace roseinfer
