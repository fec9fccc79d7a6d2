// LlamaStack decode step (see stack.h) and its small row kernels.
#include "stack.h"

#include <chrono>

#include "attention.h"

namespace roseinfer {

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

// h += t, then y = rms_norm(h) * w; rows split over the threads.
static void add_rms_norm(float* h, const float* t, const float* w, float* y, int64_t rows,
                         int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* hr = h + r * n;
      const float* tr = t + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) hr[i] += tr[i];
    }
    rms_norm(h + r0 * n, w, y + r0 * n, r1 - r0, n, eps);
  });
}

// a[b, i] = silu(gu[b, i]) * gu[b, inter + i]  (gu rows = [gate | up]).
static void silu_mul(const float* gu, float* a, int64_t B, int64_t inter) {
  at::parallel_for(0, B, 8, [&](int64_t b0, int64_t e0) {
    for (int64_t b = b0; b < e0; ++b) {
      const float* gr = gu + b * 2 * inter;
      const float* ur = gr + inter;
      float* ar = a + b * inter;
      int64_t i = 0;
#ifdef ROSEINFER_AVX2
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; i + 8 <= inter; i += 8) {
        const __m256 g = _mm256_loadu_ps(gr + i);
        const __m256 e = exp8(_mm256_sub_ps(zero, g));
        _mm256_storeu_ps(ar + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                               _mm256_loadu_ps(ur + i)));
      }
#endif
      for (; i < inter; ++i) ar[i] = gr[i] / (1.f + std::exp(-gr[i])) * ur[i];
    }
  });
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

// Copy n floats into a cache row (float: as is; fp16: rounded to nearest).
static inline void store_row(float* dst, const float* src, int64_t n) {
  std::copy(src, src + n, dst);
}
static inline void store_row(at::Half* dst, const float* src, int64_t n) {
  int64_t i = 0;
#ifdef ROSEINFER_AVX2
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) dst[i] = static_cast<at::Half>(src[i]);
}

// Rotary on q and k of every row, K/V into their cache slots, q gathered to [B, H, Dh].
template <typename KV>
static void rope_and_store(float* qkv, int64_t B, int64_t H, int64_t Hkv, int64_t Dh,
                           const int64_t* pos, const int64_t* slots, const float* cos_sin,
                           float* q_out, KV* kc, KV* vc) {
  const int64_t q_size = H * Dh, kv_size = Hkv * Dh, qkv_size = q_size + 2 * kv_size;
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t e0) {
    for (int64_t b = b0; b < e0; ++b) {
      float* row = qkv + b * qkv_size;
      const float* c = cos_sin + pos[b] * Dh;
      rotate(row, H, Dh, c);
      rotate(row + q_size, Hkv, Dh, c);
      std::copy(row, row + q_size, q_out + b * q_size);
      store_row(kc + slots[b] * kv_size, row + q_size, kv_size);
      store_row(vc + slots[b] * kv_size, row + q_size + kv_size, kv_size);
    }
  });
}

at::Tensor LlamaStack::forward(at::Tensor h_in, at::Tensor positions, at::Tensor cos_sin,
                               std::vector<at::Tensor> kv_caches, at::Tensor block_tables,
                               at::Tensor context_lens, at::Tensor slot_mapping,
                               int64_t block_size) {
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
  at::Tensor qbuf = at::empty({B, q_size}, opts);
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
  if (num_layers() > 0) rms_norm(hp, in_norm[0].data_ptr<float>(), xp, B, hidden, feps);
  for (int64_t l = 0; l < num_layers(); ++l) {
    lap(3);
    qkv[l]->run(x, qkv_buf);
    lap(0);
    const at::Tensor& cache = kv_caches[l];
    const int64_t half_off = cache.size(1) * kv_size;  // V half starts here
    float* qg = qbuf.data_ptr<float>();
    const int32_t* bt = block_tables.data_ptr<int32_t>();
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    if (cache.scalar_type() == at::kHalf) {
      at::Half* kc = cache.data_ptr<at::Half>();
      rope_and_store(qp, B, H, Hkv, Dh, pp, sp, csp, qg, kc, kc + half_off);
      lap(2);
      decode_attention(qg, kc, kc + half_off, bt, block_tables.stride(0), lens, B, H, Hkv, Dh,
                       block_size, scale, attn.data_ptr<float>());
    } else {
      float* kc = cache.data_ptr<float>();
      rope_and_store(qp, B, H, Hkv, Dh, pp, sp, csp, qg, kc, kc + half_off);
      lap(2);
      decode_attention(qg, kc, kc + half_off, bt, block_tables.stride(0), lens, B, H, Hkv, Dh,
                       block_size, scale, attn.data_ptr<float>());
    }
    lap(1);
    o[l]->run(attn, tmp);
    lap(0);
    add_rms_norm(hp, tp, post_norm[l].data_ptr<float>(), xp, B, hidden, feps);
    lap(3);
    gate_up[l]->run(x, gu);
    lap(0);
    silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), B, inter);
    lap(3);
    down[l]->run(act, tmp);
    lap(0);
    if (l + 1 < num_layers()) {
      add_rms_norm(hp, tp, in_norm[l + 1].data_ptr<float>(), xp, B, hidden, feps);
    }
  }
  at::Tensor out = at::empty({B, hidden}, opts);
  float* op = out.data_ptr<float>();
  if (num_layers() > 0) add_rms_norm(hp, tp, final_norm.data_ptr<float>(), op, B, hidden, feps);
  else rms_norm(hp, final_norm.data_ptr<float>(), op, B, hidden, feps);
  return out;
}

}  // namespace roseinfer
