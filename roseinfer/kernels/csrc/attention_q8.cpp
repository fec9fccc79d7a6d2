// Paged attention over an int8 KV cache (kv_q8.h): K and V are read as int8 with their
// per-(token, head) scales, never copied to floats.  One arithmetic, two implementations
// that give the same bits: AVX2/FMA (head dims 32, 64, 128, 256) and a portable one that
// performs the AVX2 lanes' operations one lane at a time (std::fma for each FMA, the same
// reduction trees and exp polynomial); it also serves any other head dim.  Per query
// row of head g over L positions (docs/CONTRACTS.md):
//   dot_t  = 8 lanes, lane l an FMA chain over i = l, l+8, ... of q[i] * kq_t[i], summed
//            as ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))
//   s_t    = (dot_t * kscale_t) * softmax_scale
//   p_t    = softmax(s) as softmax_row (exp8 on groups of 8 positions, std::exp on the
//            tail; p_t = e_t * (1 / sum))
//   out[i] = FMA chain over t of (p_t * vscale_t) * vq_t[i]
// This file is compiled with -ffp-contract=off (build.py): the compiler fuses no mul + add
// pair on its own, so both implementations round exactly where their source says.

#include "attention.h"
#include "attention_parts.h"
#include "kv_q8.h"

namespace roseinfer {

// ------------------------------------------------------------------ portable lanes
static inline float lane_sum8(const float (&l)[8]) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
static inline float hsum8_lanes(const float (&l)[8]) {  // hsum8's tree
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// exp8 of common.h on one lane.
static inline float exp_lane(float x) {
  const float hi = 88.3762626647949f;
  x = x < hi ? x : hi;    // _mm256_min_ps(x, hi)
  x = x > -hi ? x : -hi;  // _mm256_max_ps(x, -hi)
  float fx = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  x = std::fma(-fx, 0.693359375f, x);
  x = std::fma(-fx, -2.12194440e-4f, x);
  float y = 1.9875691500E-4f;
  y = std::fma(y, x, 1.3981999507E-3f);
  y = std::fma(y, x, 8.3334519073E-3f);
  y = std::fma(y, x, 4.1665795894E-2f);
  y = std::fma(y, x, 1.6666665459E-1f);
  y = std::fma(y, x, 5.0000001201E-1f);
  y = std::fma(y, x * x, x + 1.0f);
  const uint32_t bits = (uint32_t)((int32_t)fx + 0x7f) << 23;
  float p;
  std::memcpy(&p, &bits, sizeof(float));
  return y * p;
}

// softmax_row of attention_parts.h, lane by lane.
static void softmax_portable(float* sg, int64_t L) {
  float vm[8];
  std::fill(vm, vm + 8, -INFINITY);
  int64_t t = 0;
  for (; t + 8 <= L; t += 8)
    for (int l = 0; l < 8; ++l) vm[l] = vm[l] > sg[t + l] ? vm[l] : sg[t + l];
  float mx = -INFINITY;
  for (float v : vm) mx = std::max(mx, v);
  for (; t < L; ++t) mx = std::max(mx, sg[t]);
  float vs[8] = {};
  t = 0;
  for (; t + 8 <= L; t += 8)
    for (int l = 0; l < 8; ++l) {
      sg[t + l] = exp_lane(sg[t + l] - mx);
      vs[l] = vs[l] + sg[t + l];
    }
  float sum = hsum8_lanes(vs);
  for (; t < L; ++t) {
    sg[t] = std::exp(sg[t] - mx);
    sum += sg[t];
  }
  const float inv = 1.f / sum;
  for (t = 0; t < L; ++t) sg[t] *= inv;
}

// One (row, KV head) item, G query heads, any head dim.
static void q8_item_portable(const float* qd, const int8_t* kc, const int8_t* vc,
                             const int32_t* table, int64_t L, int64_t G, int64_t rowb,
                             int64_t bs, int64_t kh, int64_t Dh, float scale, float* scores,
                             float* od) {
  const int64_t hoff = kh * q8_row_bytes(Dh);
  for (int64_t g = 0; g < G; ++g) {
    const float* q = qd + g * Dh;
    SlotCursor c(table, bs, 0);
    for (int64_t t = 0; t < L; ++t, c.next()) {
      const int8_t* k = kc + c.slot() * rowb + hoff;
      float lane[8] = {};
      for (int64_t i = 0; i < Dh; ++i) lane[i % 8] = std::fma((float)k[i], q[i], lane[i % 8]);
      scores[g * L + t] = (lane_sum8(lane) * q8_scale(k, Dh)) * scale;
    }
    softmax_portable(scores + g * L, L);
  }
  SlotCursor c(table, bs, 0);
  for (int64_t t = 0; t < L; ++t, c.next()) {
    const float sv = q8_scale(vc + c.slot() * rowb + hoff, Dh);
    for (int64_t g = 0; g < G; ++g) scores[g * L + t] *= sv;
  }
  std::fill(od, od + G * Dh, 0.f);
  SlotCursor v(table, bs, 0);
  for (int64_t t = 0; t < L; ++t, v.next()) {
    const int8_t* vr = vc + v.slot() * rowb + hoff;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + t];
      float* o = od + g * Dh;
      for (int64_t i = 0; i < Dh; ++i) o[i] = std::fma(p, (float)vr[i], o[i]);
    }
  }
}

// ------------------------------------------------------------------ AVX2
#ifdef ROSEINFER_AVX2
static inline __m256 load8q(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Query heads [0, GB) of one item (attend_heads of attention.cpp over int8 rows).
template <int DH, int GB>
static void q8_heads(const float* qd, const int8_t* kc, const int8_t* vc, const int32_t* table,
                     int64_t L, int64_t rowb, int64_t bs, int64_t kh, float scale,
                     float* scores, float* od) {
  constexpr int64_t kHead = DH + kQ8ScaleBytes;
  const int64_t hoff = kh * kHead;
  const int8_t* zero = reinterpret_cast<const int8_t*>(kZeroRow);
  SlotCursor c(table, bs, 0), ahead(table, bs, 0);
  for (int64_t t = 0; t < std::min(kAhead, L); ++t, ahead.next())
    prefetch_row(kc + ahead.slot() * rowb + hoff, kHead);
  for (int64_t t0 = 0; t0 < L; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, L - t0);
    const int8_t* k[4];
    alignas(16) float ks[4];
    for (int64_t j = 0; j < 4; ++j) {
      k[j] = j < n ? kc + c.slot() * rowb + hoff : zero;
      if (j < n) c.next();
      ks[j] = q8_scale(k[j], DH);
      if (t0 + j + kAhead < L) {
        prefetch_row(kc + ahead.slot() * rowb + hoff, kHead);
        ahead.next();
      }
    }
    __m256 a[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
    for (int v = 0; v < DH / 8; ++v)
      for (int j = 0; j < 4; ++j) {
        const __m256 kv = load8q(k[j] + 8 * v);
        for (int g = 0; g < GB; ++g)
          a[g][j] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qd + g * DH + 8 * v), a[g][j]);
      }
    const __m128 sk = _mm_load_ps(ks), sc = _mm_set1_ps(scale);
    for (int g = 0; g < GB; ++g) {
      alignas(16) float tmp[4];
      _mm_store_ps(tmp, _mm_mul_ps(_mm_mul_ps(reduce4(a[g]), sk), sc));
      for (int64_t j = 0; j < n; ++j) scores[g * L + t0 + j] = tmp[j];
    }
  }
  for (int g = 0; g < GB; ++g) softmax_row(scores + g * L, L);
  SlotCursor va(table, bs, 0);  // V scales into p, the V rows' first lines into cache
  for (int64_t t = 0; t < L; ++t, va.next()) {
    const int8_t* vr = vc + va.slot() * rowb + hoff;
    prefetch_row(vr, kHead);
    const float sv = q8_scale(vr, DH);
    for (int g = 0; g < GB; ++g) scores[g * L + t] *= sv;
  }
  constexpr int kChunk = DH / 8 < 4 ? DH / 8 : 4;  // vectors per pass
  for (int ch = 0; ch < DH / 8; ch += kChunk) {
    __m256 acc[GB][kChunk];
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < kChunk; ++u) acc[g][u] = _mm256_setzero_ps();
    SlotCursor v(table, bs, 0);
    for (int64_t t = 0; t < L; ++t, v.next()) {
      const int8_t* vr = vc + v.slot() * rowb + hoff + 8 * ch;
      __m256 p[GB];
      for (int g = 0; g < GB; ++g) p[g] = _mm256_broadcast_ss(scores + g * L + t);
      for (int u = 0; u < kChunk; ++u) {
        const __m256 vv = load8q(vr + 8 * u);
        for (int g = 0; g < GB; ++g) acc[g][u] = _mm256_fmadd_ps(p[g], vv, acc[g][u]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < kChunk; ++u) _mm256_storeu_ps(od + g * DH + 8 * (ch + u), acc[g][u]);
  }
}

// One item's G heads in passes of up to 3 (accumulators in registers; passes only group
// memory traffic, never change a value's arithmetic).
template <int DH>
static void q8_item(const float* qd, const int8_t* kc, const int8_t* vc, const int32_t* table,
                    int64_t L, int64_t G, int64_t rowb, int64_t bs, int64_t kh, float scale,
                    float* scores, float* od) {
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t gb = std::min<int64_t>(3, G - g0);
    const float* q = qd + g0 * DH;
    float* o = od + g0 * DH;
    if (gb == 3) q8_heads<DH, 3>(q, kc, vc, table, L, rowb, bs, kh, scale, scores, o);
    else if (gb == 2) q8_heads<DH, 2>(q, kc, vc, table, L, rowb, bs, kh, scale, scores, o);
    else q8_heads<DH, 1>(q, kc, vc, table, L, rowb, bs, kh, scale, scores, o);
    g0 += gb;
  }
}
#endif  // ROSEINFER_AVX2

void attend_rows_q8(const float* q, const int8_t* kc, const int8_t* vc, const int32_t* bt,
                    int64_t bt_stride, const int32_t* seq_of, const int32_t* lens, int64_t D,
                    int64_t H, int64_t Hkv, int64_t Dh, int64_t bs, float scale, float* out,
                    bool portable) {
  const int64_t G = H / Hkv;
  const int64_t rowb = Hkv * q8_row_bytes(Dh);  // bytes between consecutive slots
  const std::vector<int64_t> order = item_order(seq_of, D, Hkv);
  at::parallel_for(0, D * Hkv, 1, [&](int64_t b0, int64_t e0) {
    std::vector<float> scores;
    for (int64_t i = b0; i < e0; ++i) {
      const int64_t item = order[i], d = item / Hkv, kh = item % Hkv;
      const int64_t L = lens[d];
      scores.resize(G * L);
      const float* qd = q + (d * H + kh * G) * Dh;
      const int32_t* table = bt + (int64_t)seq_of[d] * bt_stride;
      float* od = out + (d * H + kh * G) * Dh;
#ifdef ROSEINFER_AVX2
      if (!portable && (Dh == 32 || Dh == 64 || Dh == 128 || Dh == 256)) {
        auto run = Dh == 32 ? q8_item<32> : Dh == 64 ? q8_item<64>
                 : Dh == 128 ? q8_item<128> : q8_item<256>;
        run(qd, kc, vc, table, L, G, rowb, bs, kh, scale, scores.data(), od);
        continue;
      }
#endif
      q8_item_portable(qd, kc, vc, table, L, G, rowb, bs, kh, Dh, scale, scores.data(), od);
    }
  });
}

template <>
void attend_rows<int8_t>(const float* q, const int8_t* kc, const int8_t* vc, const int32_t* bt,
                         int64_t bt_stride, const int32_t* seq_of, const int32_t* lens,
                         int64_t D, int64_t H, int64_t Hkv, int64_t Dh, int64_t bs, float scale,
                         float* out) {
  attend_rows_q8(q, kc, vc, bt, bt_stride, seq_of, lens, D, H, Hkv, Dh, bs, scale, out, false);
}

at::Tensor paged_attention_portable(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                    at::Tensor token_seq, at::Tensor token_lens,
                                    int64_t block_size, double scale) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar,
              "paged_attention_portable: an int8 KV cache [2, slots, Hkv, Dh + 4]");
  return paged_attention_impl(q, kv_cache, block_tables, token_seq, token_lens, block_size,
                              scale, true);
}

}  // namespace roseinfer
