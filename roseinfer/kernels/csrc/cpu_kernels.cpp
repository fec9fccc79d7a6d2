// roseinfer CPU kernels: threaded fp16-weight GEMM, paged decode attention, and a
// whole Llama decoder stack for decode steps (one token per sequence), so a decode
// step runs its 30 layers without returning to Python.
//
// Registered as torch ops / classes under the "roseinfer" namespace:
//   torch.classes.roseinfer.Linear(weight[N,K] f32, bias[N]|None, fp16: bool)
//   torch.classes.roseinfer.LlamaStack(hidden, heads, kv_heads, head_dim, inter, eps, final_norm)
//   torch.ops.roseinfer.paged_decode_attention(q, kv_cache, block_tables, context_lens,
//                                              block_size, scale)
// Layouts follow docs/CONTRACTS.md: kv_cache [2, slots, Hkv, Dh] float32; slot of
// position p = block_table[p / block_size] * block_size + p % block_size.
// Everything here is float32 on CPU; the Python side falls back to PyTorch otherwise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fbgemm/FbgemmFP16.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <vector>

namespace roseinfer {

// ----------------------------------------------------------------- Linear
// y[M,N] = x[M,K] W^T + b.  fp16: weights packed for fbgemm's fp16 GEMM (fp32 math),
// the output columns split over the intra-op threads (torch's own op runs on one).
// fp32: the weight tensor as given, through at::mm (MKL), bit-identical to F.linear.
struct Linear : torch::CustomClassHolder {
  std::unique_ptr<fbgemm::PackedGemmMatrixFP16> packed;
  at::Tensor weight;  // fp32 [N, K] when not packed
  at::Tensor bias;    // undefined or fp32 [N]
  int64_t in_features = 0;
  int64_t out_features = 0;

  Linear(at::Tensor w, std::optional<at::Tensor> b, bool fp16) {
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
    }
  }

  void run(const at::Tensor& x, at::Tensor& y) const {  // x [M,K] contiguous, y [M,N]
    const int64_t m = x.size(0);
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
    } else if (bias.defined()) {
      at::addmm_out(y, bias, x, weight.t());
    } else {
      at::mm_out(y, x, weight.t());
    }
  }

  at::Tensor forward(at::Tensor x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == in_features,
                "Linear: input must be float32 [..., in_features]");
    auto sizes = x.sizes().vec();
    auto x2 = x.reshape({-1, in_features}).contiguous();
    auto y = at::empty({x2.size(0), out_features}, x.options());
    run(x2, y);
    sizes.back() = out_features;
    return y.view(sizes);
  }
};

// ------------------------------------------------------- decode attention
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
// sum_i a[i] * b[i] for n a multiple of 8.
static inline float dot(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i < n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  return hsum8(_mm256_add_ps(s0, s1));
}
// acc[i] += p * v[i] for n a multiple of 8.
static inline void axpy(float* acc, float p, const float* v, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i),
                                              _mm256_loadu_ps(acc + i)));
}
// exp(x) for 8 floats: range reduction x = n ln2 + r, degree-5 polynomial for e^r
// (Cephes expf), relative error ~2e-7 over the softmax range (x <= 0).
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                    _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// sg[t] = exp(sg[t] - max) / sum over t < L.
static inline void softmax_row(float* sg, int64_t L) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < L; ++t) mx = std::max(mx, sg[t]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vmx));
    _mm256_storeu_ps(sg + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum8(vsum);
  for (; t < L; ++t) {
    sg[t] = std::exp(sg[t] - mx);
    sum += sg[t];
  }
  const __m256 inv = _mm256_set1_ps(1.f / sum);
  t = 0;
  for (; t + 8 <= L; t += 8) _mm256_storeu_ps(sg + t, _mm256_mul_ps(_mm256_loadu_ps(sg + t), inv));
  for (; t < L; ++t) sg[t] *= 1.f / sum;
}

// One (sequence, KV head) work item with the head dim known at compile time, so the
// query-dot and the output accumulators stay in registers.
template <int DH>
static void attend_item(const float* qd, const float* kc, const float* vc, const int32_t* table,
                        int64_t L, int64_t G, int64_t row, int64_t bs, int64_t kh, float scale,
                        float* scores, float* od) {
  constexpr int NV = DH / 8;
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const float* kb = kc + ((int64_t)table[t0 / bs] * bs) * row + kh * DH;
    const int64_t n = std::min(bs, L - t0);
    for (int64_t j = 0; j < n; ++j) {
      const float* k = kb + j * row;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qd + g * DH;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int v = 0; v < NV; v += 2) {
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * v), _mm256_loadu_ps(k + 8 * v), a0);
          if (v + 1 < NV)
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * v + 8), _mm256_loadu_ps(k + 8 * v + 8), a1);
        }
        scores[g * L + t0 + j] = hsum8(_mm256_add_ps(a0, a1)) * scale;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) softmax_row(scores + g * L, L);
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
    const float* sg = scores + g * L;
    for (int64_t t0 = 0; t0 < L; t0 += bs) {
      const float* vb = vc + ((int64_t)table[t0 / bs] * bs) * row + kh * DH;
      const int64_t n = std::min(bs, L - t0);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 p = _mm256_set1_ps(sg[t0 + j]);
        const float* v = vb + j * row;
        for (int u = 0; u < NV; ++u) acc[u] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * u), acc[u]);
      }
    }
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(od + g * DH + 8 * v, acc[v]);
  }
}
static constexpr bool kVecDot = true;
#else
static inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
static inline void axpy(float* acc, float p, const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += p * v[i];
}
static constexpr bool kVecDot = false;
#endif

static inline float dot_any(const float* a, const float* b, int64_t n) {
  if (kVecDot && n % 8 == 0) return dot(a, b, n);
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
static inline void axpy_any(float* acc, float p, const float* v, int64_t n) {
  if (kVecDot && n % 8 == 0) return axpy(acc, p, v, n);
  for (int64_t i = 0; i < n; ++i) acc[i] += p * v[i];
}

// One query token per sequence attends to its whole context in the paged cache.
// Work item = (sequence, KV head): each K/V row is read once for the G query heads
// that share it.  q [D, H, Dh]; out [D, H, Dh].
static void decode_attention(const float* q, const float* kc, const float* vc,
                             const int32_t* bt, int64_t bt_stride, const int32_t* lens,
                             int64_t D, int64_t H, int64_t Hkv, int64_t Dh, int64_t bs,
                             float scale, float* out) {
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * Dh;  // floats between consecutive slots
  at::parallel_for(0, D * Hkv, 1, [&](int64_t b0, int64_t e0) {
    std::vector<float> scores;
    for (int64_t item = b0; item < e0; ++item) {
      const int64_t d = item / Hkv, kh = item % Hkv;
      const int64_t L = lens[d];
      scores.resize(G * L);
      const float* qd = q + (d * H + kh * G) * Dh;
      const int32_t* table = bt + d * bt_stride;
      float* od = out + (d * H + kh * G) * Dh;
#if defined(__AVX2__) && defined(__FMA__)
      if (Dh == 64) {
        attend_item<64>(qd, kc, vc, table, L, G, row, bs, kh, scale, scores.data(), od);
        continue;
      }
      if (Dh == 128) {
        attend_item<128>(qd, kc, vc, table, L, G, row, bs, kh, scale, scores.data(), od);
        continue;
      }
#endif
      for (int64_t t0 = 0; t0 < L; t0 += bs) {  // one KV block at a time
        const float* kb = kc + ((int64_t)table[t0 / bs] * bs * Hkv + kh) * Dh;
        const int64_t n = std::min(bs, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const float* k = kb + j * row;
          for (int64_t g = 0; g < G; ++g)
            scores[g * L + t0 + j] = dot_any(qd + g * Dh, k, Dh) * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float mx = -INFINITY;
        for (int64_t t = 0; t < L; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      std::fill(od, od + G * Dh, 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const float* vb = vc + ((int64_t)table[t0 / bs] * bs * Hkv + kh) * Dh;
        const int64_t n = std::min(bs, L - t0);
        for (int64_t g = 0; g < G; ++g) {
          const float* sg = scores.data() + g * L + t0;
          for (int64_t j = 0; j < n; ++j) axpy_any(od + g * Dh, sg[j], vb + j * row, Dh);
        }
      }
    }
  });
}

static void check_decode_args(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                              const at::Tensor& context_lens) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == at::kFloat,
              "kv_cache must be contiguous float32 [2, slots, Hkv, Dh]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1,
              "block_tables must be int32 [D, W] with unit column stride");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(),
              "context_lens must be contiguous int32 [D]");
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, int64_t block_size, double scale) {
  check_decode_args(kv_cache, block_tables, context_lens);
  auto qc = q.contiguous();
  TORCH_CHECK(qc.dim() == 3 && qc.scalar_type() == at::kFloat, "q must be float32 [D, H, Dh]");
  const int64_t D = qc.size(0), H = qc.size(1), Dh = qc.size(2);
  const int64_t S = kv_cache.size(1), Hkv = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == Dh && H % Hkv == 0, "head shapes do not match the cache");
  auto out = at::empty_like(qc);
  const float* kc = kv_cache.data_ptr<float>();
  decode_attention(qc.data_ptr<float>(), kc, kc + S * Hkv * Dh, block_tables.data_ptr<int32_t>(),
                   block_tables.stride(0), context_lens.data_ptr<int32_t>(), D, H, Hkv, Dh,
                   block_size, (float)scale, out.data_ptr<float>());
  return out;
}

// ------------------------------------------------------- small row kernels
// y = w * (x * rsqrt(mean(x^2) + eps)), like transformers' LlamaRMSNorm in fp32.
static void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n,
                     float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

// Neox rotate-half rotary on `heads` heads of Dh starting at x; cs = [cos(Dh/2), sin(Dh/2)].
static void rotate(float* x, int64_t heads, int64_t Dh, const float* cs) {
  const int64_t half = Dh / 2;
  const float* c = cs;
  const float* s = cs + half;
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * Dh;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = xh[i], x2 = xh[i + half];
      xh[i] = x1 * c[i] - x2 * s[i];
      xh[i + half] = x2 * c[i] + x1 * s[i];
    }
  }
}

// ------------------------------------------------------------ LlamaStack
// All decoder layers + final norm for a decode step: h [B, hidden] (embedded tokens)
// -> final-norm hidden [B, hidden].  Writes each token's K/V into its slot first.
struct LlamaStack : torch::CustomClassHolder {
  int64_t hidden, H, Hkv, Dh, inter;
  double eps;
  at::Tensor final_norm;
  std::vector<at::Tensor> in_norm, post_norm;
  std::vector<c10::intrusive_ptr<Linear>> qkv, o, gate_up, down;
  // Profile counters (seconds): gemm, attention, kv_write + rotary, other row ops.
  bool profiling = false;
  std::vector<double> times = std::vector<double>(4, 0.0);

  LlamaStack(int64_t hidden_, int64_t heads, int64_t kv_heads, int64_t head_dim,
             int64_t inter_, double eps_, at::Tensor final_norm_)
      : hidden(hidden_), H(heads), Hkv(kv_heads), Dh(head_dim), inter(inter_), eps(eps_),
        final_norm(final_norm_.contiguous()) {}

  void add_layer(at::Tensor in_w, at::Tensor post_w, c10::intrusive_ptr<Linear> qkv_,
                 c10::intrusive_ptr<Linear> o_, c10::intrusive_ptr<Linear> gate_up_,
                 c10::intrusive_ptr<Linear> down_) {
    in_norm.push_back(in_w.contiguous());
    post_norm.push_back(post_w.contiguous());
    qkv.push_back(qkv_);
    o.push_back(o_);
    gate_up.push_back(gate_up_);
    down.push_back(down_);
  }

  int64_t num_layers() const { return (int64_t)qkv.size(); }

  void set_profiling(bool on) {
    profiling = on;
    std::fill(times.begin(), times.end(), 0.0);
  }
  std::vector<double> profile() const { return times; }

  at::Tensor forward(at::Tensor h_in, at::Tensor positions, at::Tensor cos_sin,
                     std::vector<at::Tensor> kv_caches, at::Tensor block_tables,
                     at::Tensor context_lens, at::Tensor slot_mapping, int64_t block_size) {
    TORCH_CHECK((int64_t)kv_caches.size() == num_layers(), "one KV cache per layer");
    check_decode_args(kv_caches[0], block_tables, context_lens);
    TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
                "positions and slot_mapping must be int64");
    const int64_t B = h_in.size(0);
    const int64_t q_size = H * Dh, kv_size = Hkv * Dh, qkv_size = q_size + 2 * kv_size;
    auto opts = h_in.options();
    at::Tensor h = h_in.contiguous().clone();
    at::Tensor x = at::empty({B, hidden}, opts), tmp = at::empty({B, hidden}, opts);
    at::Tensor qkv_buf = at::empty({B, qkv_size}, opts), attn = at::empty({B, q_size}, opts);
    at::Tensor gu = at::empty({B, 2 * inter}, opts), act = at::empty({B, inter}, opts);
    auto pos = positions.contiguous();
    auto slots = slot_mapping.contiguous();
    auto cs = cos_sin.contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    const float* csp = cs.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    float* xp = x.data_ptr<float>();
    float* tp = tmp.data_ptr<float>();
    float* qp = qkv_buf.data_ptr<float>();
    const float feps = (float)eps;
    const float scale = 1.f / std::sqrt((float)Dh);

    using clock = std::chrono::steady_clock;
    auto mark = clock::now();
    auto lap = [&](int which) {
      if (!profiling) return;
      auto now = clock::now();
      times[which] += std::chrono::duration<double>(now - mark).count();
      mark = now;
    };
    for (int64_t l = 0; l < num_layers(); ++l) {
      rms_norm(hp, in_norm[l].data_ptr<float>(), xp, B, hidden, feps);
      lap(3);
      qkv[l]->run(x, qkv_buf);
      lap(0);
      const at::Tensor& cache = kv_caches[l];
      float* kc = cache.data_ptr<float>();
      float* vc = kc + cache.size(1) * kv_size;
      for (int64_t b = 0; b < B; ++b) {
        float* row = qp + b * qkv_size;
        const float* c = csp + pp[b] * Dh;
        rotate(row, H, Dh, c);
        rotate(row + q_size, Hkv, Dh, c);
        std::copy(row + q_size, row + q_size + kv_size, kc + sp[b] * kv_size);
        std::copy(row + q_size + kv_size, row + qkv_size, vc + sp[b] * kv_size);
      }
      // q rows are strided by qkv_size: gather them so attention reads [B, H, Dh].
      at::Tensor q = qkv_buf.narrow(1, 0, q_size).contiguous();
      lap(2);
      decode_attention(q.data_ptr<float>(), kc, vc, block_tables.data_ptr<int32_t>(),
                       block_tables.stride(0), context_lens.data_ptr<int32_t>(), B, H, Hkv, Dh,
                       block_size, scale, attn.data_ptr<float>());
      lap(1);
      o[l]->run(attn, tmp);
      lap(0);
      for (int64_t i = 0; i < B * hidden; ++i) hp[i] += tp[i];

      rms_norm(hp, post_norm[l].data_ptr<float>(), xp, B, hidden, feps);
      lap(3);
      gate_up[l]->run(x, gu);
      lap(0);
      const float* g = gu.data_ptr<float>();
      float* a = act.data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        const float* gr = g + b * 2 * inter;
        const float* ur = gr + inter;
        float* ar = a + b * inter;
        for (int64_t i = 0; i < inter; ++i) ar[i] = gr[i] / (1.f + std::exp(-gr[i])) * ur[i];
      }
      lap(3);
      down[l]->run(act, tmp);
      lap(0);
      for (int64_t i = 0; i < B * hidden; ++i) hp[i] += tp[i];
    }
    at::Tensor out = at::empty({B, hidden}, opts);
    rms_norm(hp, final_norm.data_ptr<float>(), out.data_ptr<float>(), B, hidden, feps);
    return out;
  }
};

}  // namespace roseinfer

TORCH_LIBRARY(roseinfer, m) {
  m.class_<roseinfer::Linear>("Linear")
      .def(torch::init<at::Tensor, std::optional<at::Tensor>, bool>())
      .def("forward", &roseinfer::Linear::forward)
      .def("in_features", [](const c10::intrusive_ptr<roseinfer::Linear>& self) {
        return self->in_features;
      })
      .def("out_features", [](const c10::intrusive_ptr<roseinfer::Linear>& self) {
        return self->out_features;
      });
  m.class_<roseinfer::LlamaStack>("LlamaStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, at::Tensor>())
      .def("add_layer", &roseinfer::LlamaStack::add_layer)
      .def("num_layers", &roseinfer::LlamaStack::num_layers)
      .def("set_profiling", &roseinfer::LlamaStack::set_profiling)
      .def("profile", &roseinfer::LlamaStack::profile)
      .def("forward", &roseinfer::LlamaStack::forward);
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor context_lens, int block_size, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &roseinfer::paged_decode_attention);
}
