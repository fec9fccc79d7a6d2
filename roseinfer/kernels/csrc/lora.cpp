// Segmented LoRA deltas (see lora.h for the layout and the per-row arithmetic).
#include "lora.h"

#include <cstring>

namespace roseinfer {

namespace {

constexpr int kPlanCols = 11;

// t = dot(x, a) over K in lora.h's order, portable (std::fma, then the same add tree).
inline float dot_portable(const float* x, const float* a, int64_t K) {
  float acc[32] = {};
  const int64_t k32 = K / 32 * 32, k8 = K / 8 * 8;
  for (int64_t k = 0; k < k32; k += 32)
    for (int j = 0; j < 32; ++j) acc[j] = std::fma(x[k + j], a[k + j], acc[j]);
  for (int64_t k = k32; k < k8; k += 8)
    for (int j = 0; j < 8; ++j) acc[j] = std::fma(x[k + j], a[k + j], acc[j]);
  float v[8];
  for (int j = 0; j < 8; ++j) v[j] = (acc[j] + acc[8 + j]) + (acc[16 + j] + acc[24 + j]);
  float lo[4];
  for (int j = 0; j < 4; ++j) lo[j] = v[j] + v[4 + j];
  float t = (lo[0] + lo[2]) + (lo[1] + lo[3]);
  for (int64_t k = k8; k < K; ++k) t = std::fma(x[k], a[k], t);
  return t;
}

#ifdef ROSEINFER_AVX2
// t[m * ts] = dot(x[m], a) for MM rows of x (stride K) sharing a's loads; per row the
// same lanes and tree as dot_portable.
template <int MM>
inline void dot_rows(const float* x, const float* a, int64_t K, float* t, int64_t ts) {
  __m256 acc[MM][4];
  for (int m = 0; m < MM; ++m)
    for (int h = 0; h < 4; ++h) acc[m][h] = _mm256_setzero_ps();
  const int64_t k32 = K / 32 * 32, k8 = K / 8 * 8;
  for (int64_t k = 0; k < k32; k += 32) {
    __m256 av[4];
    for (int h = 0; h < 4; ++h) av[h] = _mm256_loadu_ps(a + k + 8 * h);
    for (int m = 0; m < MM; ++m)
      for (int h = 0; h < 4; ++h)
        acc[m][h] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * h), av[h], acc[m][h]);
  }
  for (int64_t k = k32; k < k8; k += 8) {
    const __m256 av = _mm256_loadu_ps(a + k);
    for (int m = 0; m < MM; ++m)
      acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), av, acc[m][0]);
  }
  for (int m = 0; m < MM; ++m) {
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]),
                                  _mm256_add_ps(acc[m][2], acc[m][3])));
    for (int64_t k = k8; k < K; ++k) s = std::fma(x[m * K + k], a[k], s);
    t[m * ts] = s;
  }
}

// y[m, n0:n1] += sum_r t[m, r] Bt[r, n] for MM rows, columns [lo, hi) of the part.
template <int MM>
inline void outer_rows(const float* t, int64_t ts, const float* bt, int64_t nb, int64_t R,
                       int64_t lo, int64_t hi, float* y, int64_t ys) {
  int64_t n = lo;
  for (; n + 16 <= hi; n += 16) {
    __m256 acc[MM][2];
    for (int m = 0; m < MM; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t r = 0; r < R; ++r) {
      const __m256 b0 = _mm256_loadu_ps(bt + r * nb + n), b1 = _mm256_loadu_ps(bt + r * nb + n + 8);
      for (int m = 0; m < MM; ++m) {
        const __m256 tv = _mm256_broadcast_ss(t + m * ts + r);
        acc[m][0] = _mm256_fmadd_ps(tv, b0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(tv, b1, acc[m][1]);
      }
    }
    for (int m = 0; m < MM; ++m) {
      float* yr = y + m * ys + n;
      _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), acc[m][0]));
      _mm256_storeu_ps(yr + 8, _mm256_add_ps(_mm256_loadu_ps(yr + 8), acc[m][1]));
    }
  }
  for (; n + 8 <= hi; n += 8) {
    __m256 acc[MM];
    for (int m = 0; m < MM; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t r = 0; r < R; ++r) {
      const __m256 b0 = _mm256_loadu_ps(bt + r * nb + n);
      for (int m = 0; m < MM; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(t + m * ts + r), b0, acc[m]);
    }
    for (int m = 0; m < MM; ++m) {
      float* yr = y + m * ys + n;
      _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), acc[m]));
    }
  }
  for (; n < hi; ++n) {
    for (int m = 0; m < MM; ++m) {
      float acc = 0.f;
      for (int64_t r = 0; r < R; ++r) acc = std::fma(t[m * ts + r], bt[r * nb + n], acc);
      y[m * ys + n] += acc;
    }
  }
}
#endif  // ROSEINFER_AVX2

// t[m, :] for rows [0, M) of x, A rows [r_lo, r_hi).
void low_rank_rows(const LoraLinear& lin, const float* x, int64_t M, int64_t r_lo, int64_t r_hi,
                   float* t, bool portable) {
  const int64_t K = lin.K, R = lin.R;
#ifdef ROSEINFER_AVX2
  if (!portable) {
    for (int64_t r = r_lo; r < r_hi; ++r) {
      const float* a = lin.a + r * K;
      for (int64_t m = 0; m < M; m += 4) {
        const float* xm = x + m * K;
        float* tm = t + m * R + r;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: dot_rows<1>(xm, a, K, tm, R); break;
          case 2: dot_rows<2>(xm, a, K, tm, R); break;
          case 3: dot_rows<3>(xm, a, K, tm, R); break;
          default: dot_rows<4>(xm, a, K, tm, R); break;
        }
      }
    }
    return;
  }
#endif
  for (int64_t r = r_lo; r < r_hi; ++r)
    for (int64_t m = 0; m < M; ++m) t[m * R + r] = dot_portable(x + m * K, lin.a + r * K, K);
}

// y[m, lo:hi] += the delta's columns [lo, hi) (of the whole linear) for rows [0, M).
void expand_rows(const LoraLinear& lin, const float* t, int64_t M, int64_t lo, int64_t hi,
                 float* y, int64_t ys, bool portable) {
  for (const LoraPart& p : lin.parts) {
    const int64_t a = std::max(lo, p.n0), b = std::min(hi, p.n1);
    if (a >= b) continue;
    const int64_t nb = p.n1 - p.n0, rank = p.r1 - p.r0;
    const float* tp = t + p.r0;
    float* yp = y + p.n0;
#ifdef ROSEINFER_AVX2
    if (!portable) {
      for (int64_t m = 0; m < M; m += 4) {
        const float* tm = tp + m * lin.R;
        float* ym = yp + m * ys;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: outer_rows<1>(tm, lin.R, p.bt, nb, rank, a - p.n0, b - p.n0, ym, ys); break;
          case 2: outer_rows<2>(tm, lin.R, p.bt, nb, rank, a - p.n0, b - p.n0, ym, ys); break;
          case 3: outer_rows<3>(tm, lin.R, p.bt, nb, rank, a - p.n0, b - p.n0, ym, ys); break;
          default: outer_rows<4>(tm, lin.R, p.bt, nb, rank, a - p.n0, b - p.n0, ym, ys); break;
        }
      }
      continue;
    }
#endif
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = a - p.n0; n < b - p.n0; ++n) {
        float acc = 0.f;
        for (int64_t r = 0; r < rank; ++r) acc = std::fma(tp[m * lin.R + r], p.bt[r * nb + n], acc);
        yp[m * ys + n] += acc;
      }
  }
}

}  // namespace

LoraAdapter::LoraAdapter(at::Tensor buffer_, at::Tensor plan, int64_t num_layers)
    : buffer(buffer_), layers(num_layers) {
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.dim() == 1 && buffer.is_contiguous(),
              "LoraAdapter: buffer must be a contiguous 1-D float32 tensor");
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.dim() == 2 && plan.size(1) == kPlanCols,
              "LoraAdapter: plan must be int64 [P, 11]");
  auto pl = plan.contiguous();
  const int64_t* p = pl.data_ptr<int64_t>();
  const int64_t size = buffer.numel();
  const float* base = buffer.data_ptr<float>();
  for (int64_t i = 0; i < pl.size(0); ++i, p += kPlanCols) {
    const int64_t layer = p[0], which = p[1], a_off = p[2], R = p[3], K = p[4], N = p[5];
    const int64_t r0 = p[6], r1 = p[7], n0 = p[8], n1 = p[9], bt_off = p[10];
    TORCH_CHECK(layer >= 0 && layer < num_layers && which >= 0 && which < 4 && R > 0 && K > 0,
                "LoraAdapter: bad plan row ", i);
    TORCH_CHECK(0 <= r0 && r0 < r1 && r1 <= R && 0 <= n0 && n0 < n1 && n1 <= N,
                "LoraAdapter: plan row ", i, " has a bad part");
    TORCH_CHECK(a_off >= 0 && a_off + R * K <= size && bt_off >= 0 &&
                    bt_off + (r1 - r0) * (n1 - n0) <= size,
                "LoraAdapter: plan row ", i, " lies outside the buffer");
    LoraLinear& lin = layers[layer][which];
    if (lin.R == 0) {
      lin.a = base + a_off;
      lin.R = R;
      lin.K = K;
      lin.N = N;
    }
    TORCH_CHECK(lin.a == base + a_off && lin.R == R && lin.K == K && lin.N == N,
                "LoraAdapter: plan rows of one linear disagree (row ", i, ")");
    lin.parts.push_back({r0, r1, n0, n1, base + bt_off});
  }
}

void lora_fill(at::Tensor buffer, at::TensorList a_src, at::TensorList b_src,
               at::ArrayRef<double> scalings, at::Tensor plan) {
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.dim() == 1 && buffer.is_contiguous(),
              "lora_fill: buffer must be a contiguous 1-D float32 tensor");
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.dim() == 2 && plan.size(1) == kPlanCols,
              "lora_fill: plan must be int64 [P, 11]");
  const int64_t P = plan.size(0);
  TORCH_CHECK((int64_t)a_src.size() == P && (int64_t)b_src.size() == P &&
                  (int64_t)scalings.size() == P,
              "lora_fill: one A, B and scaling per plan row");
  auto pl = plan.contiguous();
  const int64_t* p = pl.data_ptr<int64_t>();
  const int64_t size = buffer.numel();
  float* base = buffer.data_ptr<float>();
  for (int64_t i = 0; i < P; ++i, p += kPlanCols) {
    const int64_t a_off = p[2], K = p[4], r0 = p[6], r1 = p[7], n0 = p[8], n1 = p[9], bt_off = p[10];
    const int64_t rank = r1 - r0, nn = n1 - n0;
    TORCH_CHECK(rank > 0 && nn > 0 && K > 0 && r0 >= 0 && a_off >= 0 && bt_off >= 0 &&
                    a_off + r1 * K <= size && bt_off + rank * nn <= size,
                "lora_fill: plan row ", i, " lies outside the buffer");
    TORCH_CHECK(a_src[i].dim() == 2 && a_src[i].size(0) == rank && a_src[i].size(1) == K &&
                    b_src[i].dim() == 2 && b_src[i].size(0) == nn && b_src[i].size(1) == rank,
                "lora_fill: part ", i, " has A / B of the wrong shape");
    const at::Tensor a = a_src[i].to(at::kFloat).contiguous();
    const at::Tensor b = b_src[i].to(at::kFloat).contiguous();
    std::memcpy(base + a_off + r0 * K, a.data_ptr<float>(), sizeof(float) * rank * K);
    const float* bp = b.data_ptr<float>();
    float* bt = base + bt_off;
    const float s = (float)scalings[i];
    for (int64_t n = 0; n < nn; ++n)
      for (int64_t r = 0; r < rank; ++r) bt[r * nn + n] = bp[n * rank + r] * s;
  }
}

void LoraStep::add(int64_t start, int64_t end, c10::intrusive_ptr<LoraAdapter> adapter) {
  TORCH_CHECK(0 <= start && start < end && (starts.empty() || start >= ends.back()),
              "LoraStep.add: segments must be non-empty, in order and disjoint");
  starts.push_back(start);
  ends.push_back(end);
  adapters.push_back(std::move(adapter));
}

void LoraStep::apply(int64_t layer, int64_t which, const at::Tensor& x, at::Tensor& y) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && x.dim() == 2 &&
                  y.dim() == 2 && x.is_contiguous() && y.is_contiguous() && x.size(0) == y.size(0),
              "LoraStep.apply: x [B, K] and y [B, N] must be contiguous float32");
  TORCH_CHECK(which >= 0 && which < 4, "LoraStep.apply: linear index out of range");
  const int64_t B = x.size(0), K = x.size(1), N = y.size(1);
  // The adapted segments of this linear and where their t rows start.
  std::vector<const LoraLinear*> lins;
  std::vector<int64_t> seg, t_off(1, 0);
  for (size_t s = 0; s < adapters.size(); ++s) {
    const auto& layers = adapters[s]->layers;
    TORCH_CHECK(layer >= 0 && layer < (int64_t)layers.size(), "LoraStep.apply: bad layer");
    const LoraLinear& lin = layers[layer][which];
    if (lin.R == 0) continue;
    TORCH_CHECK(ends[s] <= B && lin.K == K && lin.N == N,
                "LoraStep.apply: adapter shapes do not match the linear");
    lins.push_back(&lin);
    seg.push_back((int64_t)s);
    t_off.push_back(t_off.back() + (ends[s] - starts[s]) * lin.R);
  }
  if (lins.empty()) return;
  std::vector<float> t(t_off.back());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Phase 1: t = x A^T, split over (segment, rank row) work items.
  std::vector<int64_t> items(1, 0);  // prefix sums of ranks
  int64_t macs = 0;
  for (size_t i = 0; i < lins.size(); ++i) {
    items.push_back(items.back() + lins[i]->R);
    macs += (ends[seg[i]] - starts[seg[i]]) * lins[i]->R * (K + lins[i]->N);
  }
  // Threads only for large steps (prefill chunks): a decode step's delta (~1-2M MACs at
  // 16 rows, ~0.1 ms) runs inline, since a parallel region per linear (120 a step) costs
  // more than it saves on a busy machine (measured: 2 threads at load 17, 0.37x base).
  const int64_t min_macs = 1 << 22;
  const int64_t grain1 = std::max<int64_t>(1, items.back() * min_macs / std::max<int64_t>(macs, 1));
  at::parallel_for(0, items.back(), grain1, [&](int64_t i0, int64_t i1) {
    for (size_t i = 0; i < lins.size(); ++i) {
      const int64_t lo = std::max(i0, items[i]), hi = std::min(i1, items[i + 1]);
      if (lo >= hi) continue;
      const int64_t s = seg[i];
      low_rank_rows(*lins[i], xp + starts[s] * K, ends[s] - starts[s], lo - items[i],
                    hi - items[i], t.data() + t_off[i], portable);
    }
  });
  // Phase 2: y += t Bt per part, split over 16-column blocks of y.
  const int64_t blocks = (N + 15) / 16;
  const int64_t grain2 = std::max<int64_t>(1, blocks * min_macs / std::max<int64_t>(macs, 1));
  at::parallel_for(0, blocks, grain2, [&](int64_t b0, int64_t b1) {
    const int64_t lo = b0 * 16, hi = std::min(N, b1 * 16);
    for (size_t i = 0; i < lins.size(); ++i) {
      const int64_t s = seg[i];
      expand_rows(*lins[i], t.data() + t_off[i], ends[s] - starts[s], lo, hi,
                  yp + starts[s] * N, N, portable);
    }
  });
}

}  // namespace roseinfer
