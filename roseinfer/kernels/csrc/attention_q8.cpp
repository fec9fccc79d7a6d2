// Paged attention over an int8 KV cache (kv_q8.h): K and V are read as int8 with their
// per-(token, head) scales, never copied to floats.  One arithmetic, two implementations
// that give the same bits: AVX2/FMA (head dims 32, 64, 128, 256) and a portable one that
// performs the AVX2 lanes' operations one lane at a time (std::fma for each FMA, the same
// reduction trees and exp polynomial); it also serves any other head dim.  Per query
// row of head g over L positions (docs/CONTRACTS.md):
//   qq, qs = the row's head g quantized as a cache row (q8_store_head: absmax / 127, rne)
//   dot_t  = sum_i qq[i] * kq_t[i], exact in int32 (AVX2: vpsignb / vpabsb, vpmaddubsw,
//            vpmaddwd; AMX: tdpbssd, q8_block_scores_amx; |dot_t| <= 256 * 128 * 127 < 2^24,
//            so float(dot_t) is exact too)
//   s_t    = (float(dot_t) * (qs * kscale_t)) * softmax_scale
//   p_t    = softmax(s) as softmax_row (exp8's lanes on groups of 8 positions, summed
//            in 8 lanes, std::exp on the tail; p_t = e_t * (1 / sum), applied in the
//            pass that multiplies by vscale_t)
//   out[i] = FMA chain over t of (p_t * vscale_t) * vq_t[i]
// This file is compiled with -ffp-contract=off (build.py): the compiler fuses no mul + add
// pair on its own, so both implementations round exactly where their source says.

#include "attention.h"
#include <memory>

#include "amx.h"
#include "attention_parts.h"
#include "attention_q8_amx.h"
#include "kv_q8.h"

namespace roseinfer {

// ------------------------------------------------------------------ portable lanes
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
static void q8_item_portable(const int8_t* qq, const float* qs, const int8_t* kc, const int8_t* vc,
                             const int32_t* table, int64_t L, int64_t G, int64_t rowb,
                             int64_t bs, int64_t kh, int64_t Dh, float scale, float* scores,
                             float* od) {
  const int64_t hoff = kh * q8_row_bytes(Dh);
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* q = qq + g * q8_row_bytes(Dh);
    SlotCursor c(table, bs, 0);
    for (int64_t t = 0; t < L; ++t, c.next()) {
      const int8_t* k = kc + c.slot() * rowb + hoff;
      int32_t dot = 0;  // exact: |dot| <= 256 * 128 * 127 < 2^24 for any head dim served
      for (int64_t i = 0; i < Dh; ++i) dot += (int32_t)q[i] * (int32_t)k[i];
      scores[g * L + t] = ((float)dot * (qs[g] * q8_scale(k, Dh))) * scale;
    }
    softmax_portable(scores + g * L, L);
  }
  SlotCursor c(table, bs, 0);
  for (int64_t t = 0; t < L; ++t, c.next()) {  // w_t = p_t * vscale_t
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

// The 4 int32 dots of q (int8, |q| <= 127) with 4 int8 K rows, as lanes of one vector:
// 32 bytes at a time, |k| * sign(q, k) by vpmaddubsw (a pair sums to at most
// 2 * 128 * 127 < 2^15: never saturates), pairs to int32 by vpmaddwd (VNNI: vpdpbusd
// straight into int32).  Exact.
template <int DH, int GB>
static inline void dots4(const int8_t* qq, const int8_t* const (&k)[4], __m128i (&out)[GB]) {
  constexpr int64_t kHead = DH + kQ8ScaleBytes;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  __m256i a[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_si256();
  for (int c = 0; c < DH / 32; ++c)
    for (int j = 0; j < 4; ++j) {
      const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[j] + 32 * c));
      const __m256i ka = _mm256_abs_epi8(kv);
      for (int g = 0; g < GB; ++g) {
        const __m256i qv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qq + g * kHead + 32 * c));
#ifdef ROSEINFER_VNNI
        a[g][j] = dpbusd8(a[g][j], ka, _mm256_sign_epi8(qv, kv));  // the same exact sums
#else
        const __m256i m = _mm256_maddubs_epi16(ka, _mm256_sign_epi8(qv, kv));
        a[g][j] = _mm256_add_epi32(a[g][j], _mm256_madd_epi16(m, ones));
#endif
      }
    }
  for (int g = 0; g < GB; ++g) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a[g][0], a[g][1]),
                                        _mm256_hadd_epi32(a[g][2], a[g][3]));
    out[g] = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  }
}

// Query heads [0, GB) of one (row, KV head) item (attend_heads of attention.cpp over
// int8 rows); qq: their quantized rows (kv_q8.h layout), qs their scales; scores [GB, L];
// od [GB, DH].  Block-wise walks over the slots (no per-position cursor), the next block
// prefetched.
template <int DH, int GB>
static void q8_heads(const int8_t* qq, const float* qs, const int8_t* kc, const int8_t* vc,
                     const int32_t* table, int64_t L, int64_t rowb, int64_t bs, int64_t kh,
                     float scale, float* scores, float* od, bool tiles,
                     SequencePrefetch& next_seq) {
  static_assert(DH % 32 == 0, "32 int8 values per vector");
  constexpr int64_t kHead = DH + kQ8ScaleBytes;
  const int8_t* zero = reinterpret_cast<const int8_t*>(kZeroRow);
  const int64_t nblk = (L + bs - 1) / bs, bstride = bs * rowb;
  // Block b's first row of head kh.
  auto rows_of = [&](const int8_t* half, int64_t b) {
    return half + table[b] * bstride + kh * kHead;
  };
  auto prefetch_block = [&](const int8_t* half, int64_t b) {
    const int8_t* r = rows_of(half, b);
    for (int64_t j = 0, n = std::min(bs, L - b * bs); j < n; ++j)
      prefetch_row(r + j * rowb, kHead);
  };
  prefetch_block(kc, 0);  // one block ahead
  const __m128 sc = _mm_set1_ps(scale);
#ifdef ROSEINFER_AMX
  if constexpr (DH % 64 == 0) {
    if (tiles) q8_query_tiles<DH, GB>(qq);
  }
#endif
  for (int64_t b = 0; b < nblk; ++b) {
    if (b + 1 < nblk) prefetch_block(kc, b + 1);
    next_seq.step();
    const int64_t t1 = std::min(bs, L - b * bs);
    const int8_t* base = rows_of(kc, b);
#ifdef ROSEINFER_AMX
    if constexpr (DH % 64 == 0) {
      if (tiles) {
        q8_block_scores_amx<DH, GB>(base, t1, rowb, qs, scale, scores + b * bs, L);
        continue;
      }
    }
#endif
    for (int64_t r = 0; r < t1; r += 4) {
      const int64_t n = std::min<int64_t>(4, t1 - r), t0 = b * bs + r;
      const int8_t* k[4];
      alignas(16) float ks[4];
      for (int64_t j = 0; j < 4; ++j) {
        k[j] = j < n ? base + (r + j) * rowb : zero;
        ks[j] = q8_scale(k[j], DH);
      }
      __m128i d[GB];
      dots4<DH, GB>(qq, k, d);
      const __m128 sk = _mm_load_ps(ks);
      for (int g = 0; g < GB; ++g) {
        const __m128 s = _mm_mul_ps(_mm_cvtepi32_ps(d[g]), _mm_mul_ps(_mm_set1_ps(qs[g]), sk));
        if (n == 4) {
          _mm_storeu_ps(scores + g * L + t0, _mm_mul_ps(s, sc));
        } else {
          alignas(16) float tmp[4];
          _mm_store_ps(tmp, _mm_mul_ps(s, sc));
          for (int64_t j = 0; j < n; ++j) scores[g * L + t0 + j] = tmp[j];
        }
      }
    }
  }
  prefetch_block(vc, 0);
  float inv[GB];  // softmax_row's last multiply, done below with the V scale's
  for (int g = 0; g < GB; ++g) inv[g] = softmax_exp(scores + g * L, L);
  for (int64_t b = 0; b < nblk; ++b) {  // p_t = e_t * inv, then p_t * vscale_t; the V rows into cache
    if (b + 1 < nblk) prefetch_block(vc, b + 1);
    const int8_t* base = rows_of(vc, b);
    for (int64_t r = 0, t1 = std::min(bs, L - b * bs); r < t1; ++r) {
      const float sv = q8_scale(base + r * rowb, DH);
      for (int g = 0; g < GB; ++g) {
        float& w = scores[g * L + b * bs + r];
        w = (w * inv[g]) * sv;
      }
    }
  }
#ifdef ROSEINFER_AVX512
  // 16 output dims per register (the same FMA chain per lane: the same bits).
  constexpr int kChunkZ = DH / 16 < 4 ? DH / 16 : 4;  // 16-dim vectors per pass
  for (int ch = 0; ch < DH / 16; ch += kChunkZ) {
    __m512 acc[GB][kChunkZ];
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < kChunkZ; ++u) acc[g][u] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; ++b) {
      if (ch == 0) next_seq.step();
      const int8_t* base = rows_of(vc, b) + 16 * ch;
      const float* pb = scores + b * bs;
      for (int64_t r = 0, t1 = std::min(bs, L - b * bs); r < t1; ++r) {
        const int8_t* vr = base + r * rowb;
        __m512 p[GB];
        for (int g = 0; g < GB; ++g) p[g] = _mm512_set1_ps(pb[g * L + r]);
        for (int u = 0; u < kChunkZ; ++u) {
          const __m512 vv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(vr + 16 * u))));
          for (int g = 0; g < GB; ++g) acc[g][u] = _mm512_fmadd_ps(p[g], vv, acc[g][u]);
        }
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < kChunkZ; ++u) _mm512_storeu_ps(od + g * DH + 16 * (ch + u), acc[g][u]);
  }
#else
  constexpr int kChunk = DH / 8 < 4 ? DH / 8 : 4;  // vectors per pass
  for (int ch = 0; ch < DH / 8; ch += kChunk) {
    __m256 acc[GB][kChunk];
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < kChunk; ++u) acc[g][u] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblk; ++b) {
      if (ch == 0) next_seq.step();
      const int8_t* base = rows_of(vc, b) + 8 * ch;
      const float* pb = scores + b * bs;
      for (int64_t r = 0, t1 = std::min(bs, L - b * bs); r < t1; ++r) {
        const int8_t* vr = base + r * rowb;
        __m256 p[GB];
        for (int g = 0; g < GB; ++g) p[g] = _mm256_broadcast_ss(pb + g * L + r);
        for (int u = 0; u < kChunk; ++u) {
          const __m256 vv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(vr + 8 * u))));
          for (int g = 0; g < GB; ++g) acc[g][u] = _mm256_fmadd_ps(p[g], vv, acc[g][u]);
        }
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < kChunk; ++u) _mm256_storeu_ps(od + g * DH + 8 * (ch + u), acc[g][u]);
  }
#endif  // ROSEINFER_AVX512
}

// One item's G heads in passes of up to 3 (accumulators in registers; passes only group
// memory traffic, never change a value's arithmetic).
template <int DH>
static void q8_item(const int8_t* qq, const float* qs, const int8_t* kc, const int8_t* vc,
                    const int32_t* table, int64_t L, int64_t G, int64_t rowb, int64_t bs,
                    int64_t kh, float scale, float* scores, float* od, bool tiles,
                    SequencePrefetch& next_seq) {
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t gb = std::min<int64_t>(3, G - g0);
    const int8_t* q = qq + g0 * (DH + kQ8ScaleBytes);
    float* o = od + g0 * DH;
    if (gb == 3) q8_heads<DH, 3>(q, qs + g0, kc, vc, table, L, rowb, bs, kh, scale, scores, o, tiles, next_seq);
    else if (gb == 2) q8_heads<DH, 2>(q, qs + g0, kc, vc, table, L, rowb, bs, kh, scale, scores, o, tiles, next_seq);
    else q8_heads<DH, 1>(q, qs + g0, kc, vc, table, L, rowb, bs, kh, scale, scores, o, tiles, next_seq);
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
  bool simd = false;
#ifdef ROSEINFER_AVX2
  simd = !portable && (Dh == 32 || Dh == 64 || Dh == 128 || Dh == 256);
#endif
#ifdef ROSEINFER_AMX
  // Decode rows only (no two neighbours of one sequence: a prefill chunk's rows reuse one
  // head's K/V from cache as items, measured 10-25% faster that way) and enough of them
  // for every thread (two each at least): one row's every KV head at a time.
  bool decode_rows = D >= 2 * at::get_num_threads();
  for (int64_t d = 1; d < D && decode_rows; ++d) decode_rows = seq_of[d] != seq_of[d - 1];
  if (simd && Dh % 64 == 0 && bs % 16 == 0 && decode_rows && amx_permitted())
    return q8_rows_amx(q, kc, vc, bt, bt_stride, seq_of, lens, D, H, Hkv, Dh, bs, scale, out);
#endif
  const std::vector<int64_t> order = item_order(seq_of, D, Hkv);
  [[maybe_unused]] const int64_t l2_bytes = l2_cache_bytes();
  parallel_items(order, lens, Hkv, [&](int64_t b0, int64_t e0) {
    bool tiles = false;  // the Q.K pass on AMX tiles (q8_block_scores_amx)
#ifdef ROSEINFER_AMX
    std::unique_ptr<TileScope> tiles_on;
    if (simd && Dh % 64 == 0 && bs % 16 == 0 && amx_permitted()) {  // whole 16-row loads
      tiles_on = std::make_unique<TileScope>(q8_attention_tiles());
      tiles = true;
    }
#endif
    std::vector<float> scores, qs(G);
    std::vector<int8_t> qq(G * q8_row_bytes(Dh));  // the item's query heads, quantized
#ifdef ROSEINFER_AVX2
    SequencePrefetch next_seq;
    const int64_t steps_per_block = 2 * ((G + 2) / 3);  // q8_heads' K and P.V block loops
#endif
    for (int64_t i = b0; i < e0; ++i) {
      const int64_t item = order[i], d = item / Hkv, kh = item % Hkv;
#ifdef ROSEINFER_AVX2
      if (simd)
        aim_at_next_sequence(next_seq, order, i, b0, e0, seq_of, lens, Hkv, bt, bt_stride, kc, vc,
                             bs, bs * rowb, steps_per_block, l2_bytes);
#endif
      const int64_t L = lens[d];
      scores.resize(G * L);
      const float* qd = q + (d * H + kh * G) * Dh;
      for (int64_t g = 0; g < G; ++g) {
        int8_t* row = qq.data() + g * q8_row_bytes(Dh);
        q8_store_head(row, qd + g * Dh, Dh);
        qs[g] = q8_scale(row, Dh);
      }
      const int32_t* table = bt + (int64_t)seq_of[d] * bt_stride;
      float* od = out + (d * H + kh * G) * Dh;
#ifdef ROSEINFER_AVX2
      if (simd) {
        auto run = Dh == 32 ? q8_item<32> : Dh == 64 ? q8_item<64>
                 : Dh == 128 ? q8_item<128> : q8_item<256>;
        run(qq.data(), qs.data(), kc, vc, table, L, G, rowb, bs, kh, scale, scores.data(), od,
            tiles, next_seq);
        continue;
      }
#endif
      q8_item_portable(qq.data(), qs.data(), kc, vc, table, L, G, rowb, bs, kh, Dh, scale,
                       scores.data(), od);
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
