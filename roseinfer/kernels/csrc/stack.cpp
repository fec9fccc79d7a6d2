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
    float* kc = cache.data_ptr<float>();
    float* vc = kc + cache.size(1) * kv_size;
    // Rotary, K/V into their slots, and q gathered to [B, H, Dh] for the attention.
    float* qg = qbuf.data_ptr<float>();
    at::parallel_for(0, B, 16, [&](int64_t b0, int64_t e0) {
      for (int64_t b = b0; b < e0; ++b) {
        float* row = qp + b * qkv_size;
        const float* c = csp + pp[b] * Dh;
        rotate(row, H, Dh, c);
        rotate(row + q_size, Hkv, Dh, c);
        std::copy(row, row + q_size, qg + b * q_size);
        std::copy(row + q_size, row + q_size + kv_size, kc + sp[b] * kv_size);
        std::copy(row + q_size + kv_size, row + qkv_size, vc + sp[b] * kv_size);
      }
    });
    lap(2);
    decode_attention(qg, kc, vc, block_tables.data_ptr<int32_t>(),
                     block_tables.stride(0), context_lens.data_ptr<int32_t>(), B, H, Hkv, Dh,
                     block_size, scale, attn.data_ptr<float>());
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
