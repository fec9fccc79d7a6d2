// Row kernels (see rowops.h): norms, SiLU-mul, rotary + KV-cache writes.
#include "rowops.h"

#include "kv_q8.h"

namespace roseinfer {

// Rows a thread takes at least in the row ops below (which thread runs a row never
// changes a value): a decode step of 16 rows over 2 threads.  kFetchRows: the most rows
// whose K/V slots rope_and_store fetches ahead (a decode step's; a prefill chunk writes
// runs of consecutive slots, which the hardware prefetchers follow).
constexpr int64_t kRopeGrain = 8, kNormGrain = 8, kFetchRows = 64;

// The sum of x[i]^2 in one fixed order on every machine: 16 lanes (lane l: fma(x[i],
// x[i], .) over i = l mod 16, in order), then halves added (l + 8, + 4, + 2, + 1).  A
// vectorized reduction (omp simd) summed in whatever width the compiler's target chose,
// so the same model gave other logits on another CPU.
static inline float sum_squares(const float* x, int64_t n) {
  float p[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) p[l] = std::fma(x[i + l], x[i + l], p[l]);
  for (int l = 0; i + l < n; ++l) p[l] = std::fma(x[i + l], x[i + l], p[l]);
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) p[l] += p[l + w];
  return p[0];
}

// y = w * (x * rsqrt(mean(x^2) + eps)), like transformers' LlamaRMSNorm in fp32.
void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    const float ss = sum_squares(xr, n);
    const float inv = 1.f / std::sqrt(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

// h += t, then y = rms_norm(h) * w; rows split over the threads.
void add_rms_norm(float* h, const float* t, const float* w, float* y, int64_t rows, int64_t n,
                  float eps) {
  at::parallel_for(0, rows, kNormGrain, [&](int64_t r0, int64_t r1) {
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
void silu_mul(const float* gu, float* a, int64_t B, int64_t inter) {
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
void rotate(float* x, int64_t heads, int64_t Dh, const float* cs) {
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

// Rows [b0, e0)'s K and V slots (slot_bytes each, at kc / vc + slot * slot_bytes) fetched
// for writing, when the range is a decode step's (at most kFetchRows): a hint, no value
// changes.
static inline void fetch_slots(const void* kc, const void* vc, const int64_t* slots, int64_t b0,
                               int64_t e0, int64_t slot_bytes) {
  if (e0 - b0 > kFetchRows) return;
  for (int64_t b = b0; b < e0; ++b)
    for (const void* half : {kc, vc})
      for (int64_t i = 0; i < slot_bytes; i += 64)
        __builtin_prefetch(static_cast<const char*>(half) + slots[b] * slot_bytes + i, 1, 3);
}

// Rotary on q and k of every row (in place), K/V into their cache slots, and q copied to
// q_out [B, H, Dh] unless q_out is null.
template <typename KV>
void rope_and_store(float* qkv, int64_t B, int64_t H, int64_t Hkv, int64_t Dh,
                           const int64_t* pos, const int64_t* slots, const float* cos_sin,
                           float* q_out, KV* kc, KV* vc) {
  const int64_t q_size = H * Dh, kv_size = Hkv * Dh, qkv_size = q_size + 2 * kv_size;
  // A decode step's slots are cold, a few lines a sequence, scattered: the range's are
  // fetched for writing first, so that their misses overlap.  With 8-row ranges and
  // the norms' too, a batch-16 step of the default model: K/V writes 1.13 -> 0.99 ms,
  // norms 1.01 -> 0.78 ms, the step 22.5 -> 22.0 ms (stack timers, 10 interleaved
  // rounds in one process).
  at::parallel_for(0, B, kRopeGrain, [&](int64_t b0, int64_t e0) {
    fetch_slots(kc, vc, slots, b0, e0, kv_size * (int64_t)sizeof(KV));
    for (int64_t b = b0; b < e0; ++b) {
      float* row = qkv + b * qkv_size;
      const float* c = cos_sin + pos[b] * Dh;
      rotate(row, H, Dh, c);
      rotate(row + q_size, Hkv, Dh, c);
      if (q_out) std::copy(row, row + q_size, q_out + b * q_size);
      store_row(kc + slots[b] * kv_size, row + q_size, kv_size);
      store_row(vc + slots[b] * kv_size, row + q_size + kv_size, kv_size);
    }
  });
}

// The int8 cache: each KV head of a row quantized with its own scale (kv_q8.h).
template <>
void rope_and_store<int8_t>(float* qkv, int64_t B, int64_t H, int64_t Hkv, int64_t Dh,
                            const int64_t* pos, const int64_t* slots, const float* cos_sin,
                            float* q_out, int8_t* kc, int8_t* vc) {
  const int64_t q_size = H * Dh, kv_size = Hkv * Dh, qkv_size = q_size + 2 * kv_size;
  const int64_t slot_bytes = Hkv * q8_row_bytes(Dh);
  at::parallel_for(0, B, kRopeGrain, [&](int64_t b0, int64_t e0) {
    fetch_slots(kc, vc, slots, b0, e0, slot_bytes);  // as the float caches'
    for (int64_t b = b0; b < e0; ++b) {
      float* row = qkv + b * qkv_size;
      const float* c = cos_sin + pos[b] * Dh;
      rotate(row, H, Dh, c);
      rotate(row + q_size, Hkv, Dh, c);
      if (q_out) std::copy(row, row + q_size, q_out + b * q_size);
      q8_store_slot(kc + slots[b] * slot_bytes, row + q_size, Hkv, Dh);
      q8_store_slot(vc + slots[b] * slot_bytes, row + q_size + kv_size, Hkv, Dh);
    }
  });
}

template void rope_and_store<float>(float*, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                                    const int64_t*, const float*, float*, float*, float*);
template void rope_and_store<at::Half>(float*, int64_t, int64_t, int64_t, int64_t,
                                       const int64_t*, const int64_t*, const float*, float*,
                                       at::Half*, at::Half*);

// ------------------------------------------------------------------- torch ops
at::Tensor rms_norm_op(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  x.size(-1) == w.numel(),
              "rms_norm: float32 x [..., n] and w [n]");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto y = at::empty_like(xc);
  const int64_t n = xc.size(-1), rows = xc.numel() / std::max<int64_t>(n, 1);
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    rms_norm(xp + r0 * n, wc.data_ptr<float>(), yp + r0 * n, r1 - r0, n, (float)eps);
  });
  return y;
}

at::Tensor silu_mul_op(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: float32 [T, 2 * inter]");
  auto gu = gate_up.contiguous();
  const int64_t T = gu.size(0), inter = gu.size(1) / 2;
  auto out = at::empty({T, inter}, gu.options());
  silu_mul(gu.data_ptr<float>(), out.data_ptr<float>(), T, inter);
  return out;
}

void rope_and_cache_op(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin,
                       at::Tensor kv_cache, at::Tensor slot_mapping, int64_t num_heads,
                       int64_t num_kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.is_contiguous(),
              "rope_and_cache: qkv must be contiguous float32 [T, (H + 2 Hkv) * Dh]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "rope_and_cache: positions and slot_mapping must be int64");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat, "rope_and_cache: float32 cos/sin cache");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf ||
                   kv_cache.scalar_type() == at::kChar),
              "rope_and_cache: kv_cache must be contiguous float32/float16 [2, slots, Hkv, Dh] "
              "or int8 [2, slots, Hkv, Dh + 4]");
  const int64_t T = qkv.size(0), Dh = cache_head_dim(kv_cache);
  TORCH_CHECK(kv_cache.size(2) == num_kv_heads &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * Dh &&
                  positions.numel() == T && slot_mapping.numel() == T && cos_sin.size(1) == Dh,
              "rope_and_cache: shapes do not match");
  auto pos = positions.contiguous();
  auto slots = slot_mapping.contiguous();
  auto cs = cos_sin.contiguous();
  // q keeps its place in qkv: rotated in place, not copied out (q_out = nullptr).
  with_kv_halves(kv_cache, [&](auto* kc, auto* vc) {
    rope_and_store(qkv.data_ptr<float>(), T, num_heads, num_kv_heads, Dh,
                   pos.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), cs.data_ptr<float>(),
                   nullptr, kc, vc);
  });
}

}  // namespace roseinfer
