// Paged decode attention (see attention.h) over an fp32 or fp16 cache, AVX2/FMA with a
// scalar fallback.
#include "attention.h"
#include "attention_parts.h"
#include "attention_tile.h"
#include "attention_scores.h"
#include "attention_one_row.h"

namespace roseinfer {

#ifdef ROSEINFER_AVX2
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

// Query heads [0, GB) of one item: scores, softmax, then out[g] = sum_t p[g][t] v[t],
// 32 output dims at a time (each V vector widened once for the GB heads), every lane an
// FMA chain over the positions in order.  Both passes walk the context a block at a time
// (a row is the block's first plus a multiple of `row`: no slot arithmetic per
// position) and prefetch the item's rows kAhead positions on (the block that many on, at
// the same offset); with AVX-512 the scores take eight K rows at a time.  Steps of two
// rows and more (docs/kv-cache.md: the op 20-25% faster than attend_heads_walk on Zen 4);
// a one-row step takes attend_heads_walk, which measured faster with its cache from
// DRAM.  The same bits as attend_heads_walk.
template <int DH, int GB, typename KV>
static void attend_heads(const float* qd, const KV* kc, const KV* vc, const int32_t* table,
                         int64_t L, int64_t row, int64_t bs, int64_t kh, float scale,
                         float* scores, float* od, SequencePrefetch* next_seq) {
  constexpr int64_t pf_bytes = DH * sizeof(KV);  // the item's own rows
  const int64_t nblk = (L + bs - 1) / bs;
  const int64_t ahead = std::max<int64_t>(1, kAhead / bs);  // blocks
  const int64_t block_values = bs * row;
  auto rows_in = [&](int64_t b) { return std::min(bs, L - b * bs); };
  auto prefetch_block = [&](const KV* base, int64_t b) {
    const KV* p = base + (int64_t)table[b] * block_values;
    for (int64_t j = 0, n = rows_in(b); j < n; ++j) prefetch_bytes(p + j * row, pf_bytes);
  };
  const KV* kbase = kc + kh * DH;
  const KV* vbase = vc + kh * DH;
  for (int64_t b = 0; b < std::min(ahead, nblk); ++b) prefetch_block(kbase, b);
  const KV* const zero = reinterpret_cast<const KV*>(kZeroRow);
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t t0 = b * bs, n = rows_in(b);
    const KV* kb = kbase + (int64_t)table[b] * block_values;
    const bool pf = b + ahead < nblk;
    const KV* pb = pf ? kbase + (int64_t)table[b + ahead] * block_values : nullptr;
    const int64_t pn = pf ? rows_in(b + ahead) : 0;
    if (next_seq) next_seq->step();
#ifdef ROSEINFER_AVX512
    constexpr int kGroup = 8;
#else
    constexpr int kGroup = 4;
#endif
    for (int64_t j = 0; j < n; j += kGroup) {
      const int64_t m = std::min<int64_t>(kGroup, n - j);
      const KV* k[kGroup];
      for (int i = 0; i < kGroup; ++i) k[i] = i < m ? kb + (j + i) * row : zero;
      for (int64_t i = j; i < std::min(j + kGroup, pn); ++i) prefetch_bytes(pb + i * row, pf_bytes);
#ifdef ROSEINFER_AVX512
      scores8_zmm<DH, GB>(qd, k, m, scale, scores + t0 + j, L);
#else
      scores4<DH, GB>(qd, k, m, scale, scores + t0 + j, L);
#endif
    }
  }
  for (int64_t b = 0; b < std::min(ahead, nblk); ++b) prefetch_block(vbase, b);
  softmax_rows<GB>(scores, L, L);
  constexpr int kW = kPvW, kChunk = kPvChunk<DH>;
  for (int ch = 0; ch < DH / kW; ch += kChunk) {
    PvVec acc[GB][kChunk];
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < kChunk; ++u) acc[g][u] = vzero<PvVec>();
    for (int64_t b = 0; b < nblk; ++b) {
      const int64_t t0 = b * bs, n = rows_in(b);
      const KV* vb = vbase + (int64_t)table[b] * block_values + kW * ch;
      const bool pf = ch == 0 && b + ahead < nblk;
      const KV* pb = pf ? vbase + (int64_t)table[b + ahead] * block_values : nullptr;
      const int64_t pn = pf ? rows_in(b + ahead) : 0;
      if (ch == 0 && next_seq) next_seq->step();
      for (int64_t j = 0; j < n; ++j) {
        if (j < pn) prefetch_bytes(pb + j * row, pf_bytes);
        pv_step(scores, L, t0 + j, vb + j * row, acc);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < kChunk; ++u) vstore(od + g * DH + kW * (ch + u), acc[g][u]);
  }
}

// attend_heads for a one-row step (batch 1): the positions walked one at a time through
// the block table (KeyWalk4, RowsAhead), each row prefetched kAhead positions on.  From
// DRAM, as a decode step at batch 1 reads its cache, this form measured 5-15% faster on
// Zen 4 than attend_heads' block walk (which is faster once the cache is in L2/L3: why,
// unexplained); the same bits.
template <int DH, int GB, typename KV, bool WIDE = false>
static void attend_heads_walk(const float* qd, const KV* kc, const KV* vc, const int32_t* table,
                         int64_t L, int64_t row, int64_t bs, int64_t kh, float scale,
                         float* scores, float* od, SequencePrefetch* next_seq,
                         int64_t pf_heads) {
  constexpr int64_t kRowBytes = DH * sizeof(KV);
  // WIDE: prefetch the rows of pf_heads KV heads from kh on (the thread's next items of
  // this row read them from cache); else the item's own (a compile-time size: the
  // prefetch loop unrolled).
  const int64_t pf_bytes = WIDE ? pf_heads * kRowBytes : kRowBytes;
  KeyWalk4<KV> keys(table, bs, kc + kh * DH, row, L, pf_bytes);
  for (int64_t t0 = 0; t0 < L; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, L - t0);
    const KV* k[4];
    keys.next(t0, n, k);
    if (next_seq && t0 % bs < 4) next_seq->step();  // once a block (bs a multiple of 4)
#ifdef ROSEINFER_AVX512
    scores4_zmm<DH, GB>(qd, k, n, scale, scores + t0, L);
#else
    scores4<DH, GB>(qd, k, n, scale, scores + t0, L);
#endif
  }
  RowsAhead<KV> va(table, bs, vc + kh * DH, row, L, pf_bytes);
  softmax_rows<GB>(scores, L, L);
  constexpr int kW = kPvW, kChunk = kPvChunk<DH>;
  for (int ch = 0; ch < DH / kW; ch += kChunk) {
    PvVec acc[GB][kChunk];
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < kChunk; ++u) acc[g][u] = vzero<PvVec>();
    SlotCursor v(table, bs, 0);
    for (int64_t t = 0; t < L; ++t, v.next()) {
      if (ch == 0) {
        va.step(t);
        if (next_seq && t % bs == 0) next_seq->step();
      }
      pv_step(scores, L, t, vc + v.slot() * row + kh * DH + kW * ch, acc);
    }
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < kChunk; ++u) vstore(od + g * DH + kW * (ch + u), acc[g][u]);
  }
}

// One (sequence, KV head) work item with the head dim known at compile time: its G
// query heads in passes of up to 3 (the accumulators stay in registers).  The passes
// only group memory traffic: every value's arithmetic is fixed by the row's query,
// context and length.  one_row (a one-row step): attend_heads_walk, its first pass
// prefetching pf_heads KV heads' rows; else attend_heads.
template <int DH, typename KV>
static void attend_item(const float* qd, const KV* kc, const KV* vc, const int32_t* table,
                        int64_t L, int64_t G, int64_t row, int64_t bs, int64_t kh, float scale,
                        float* scores, float* od, SequencePrefetch* next_seq, bool one_row,
                        int64_t pf_heads) {
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t gb = std::min<int64_t>(3, G - g0);
    const float* q = qd + g0 * DH;
    float* o = od + g0 * DH;
    if (!one_row) {
      (gb == 3   ? attend_heads<DH, 3, KV>
       : gb == 2 ? attend_heads<DH, 2, KV>
                 : attend_heads<DH, 1, KV>)(q, kc, vc, table, L, row, bs, kh, scale, scores, o,
                                            next_seq);
    } else if (pf_heads > 1 && g0 == 0) {  // the first pass prefetches pf_heads KV heads' rows
      (gb == 3   ? attend_heads_walk<DH, 3, KV, true>
       : gb == 2 ? attend_heads_walk<DH, 2, KV, true>
                 : attend_heads_walk<DH, 1, KV, true>)(q, kc, vc, table, L, row, bs, kh, scale,
                                                       scores, o, next_seq, pf_heads);
    } else {
      (gb == 3   ? attend_heads_walk<DH, 3, KV>
       : gb == 2 ? attend_heads_walk<DH, 2, KV>
                 : attend_heads_walk<DH, 1, KV>)(q, kc, vc, table, L, row, bs, kh, scale, scores,
                                                 o, next_seq, 1);
    }
    g0 += gb;
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
static inline float dot_any(const float* a, const at::Half* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}
static inline void axpy_any(float* acc, float p, const float* v, int64_t n) {
  if (kVecDot && n % 8 == 0) return axpy(acc, p, v, n);
  for (int64_t i = 0; i < n; ++i) acc[i] += p * v[i];
}
static inline void axpy_any(float* acc, float p, const at::Half* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += p * static_cast<float>(v[i]);
}

// Every query row attends to the first lens[d] positions of its sequence in the paged
// cache.  Work item = (row, KV head): each K/V row is read once for the G query heads
// that share it.  Items run in the order (run of consecutive rows of one sequence, KV
// head, row): ``item_order``.  q [D, H, Dh]; out [D, H, Dh].
template <typename KV>
void attend_rows(const float* q, const KV* kc, const KV* vc, const int32_t* bt,
                      int64_t bt_stride, const int32_t* seq_of, const int32_t* lens, int64_t D,
                      int64_t H, int64_t Hkv, int64_t Dh, int64_t bs, float scale, float* out) {
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * Dh;  // floats between consecutive slots
  [[maybe_unused]] const bool vec_dh = Dh == 32 || Dh == 64 || Dh == 128 || Dh == 256;
#ifdef ROSEINFER_AVX2
  const int64_t nt = at::get_num_threads();
  if (D == 1 && vec_dh && nt > 1 && !at::in_parallel_region()) {  // attention_one_row.h
    auto one = Dh == 32 ? attend_one_row<32, KV> : Dh == 64 ? attend_one_row<64, KV>
             : Dh == 128 ? attend_one_row<128, KV> : attend_one_row<256, KV>;
    one(q, kc, vc, bt + (int64_t)seq_of[0] * bt_stride, lens[0], H, Hkv, row, bs, scale, out, nt);
    return;
  }
#endif
  const std::vector<int64_t> order = item_order(seq_of, D, Hkv);
#ifdef ROSEINFER_AVX2
  const bool stream_next = float_sequence_prefetch();
  const int64_t l2_bytes = l2_cache_bytes();
  // One row on one thread: its first item prefetches the rows of every KV head
  // (wide_prefetch_permitted; at batch 2 it measured no gain); many rows: the
  // next-sequence stream.
  const bool wide_first = D == 1 && wide_prefetch_permitted();
#endif
  parallel_items(order, lens, Hkv, [&](int64_t b0, int64_t e0) {
    std::vector<float> scores;
#ifdef ROSEINFER_AVX512
    KeysT keys_t;  // the tiles' transposed K rows
#endif
#ifdef ROSEINFER_AVX2
    SequencePrefetch next_seq;  // stream_next: the range's next sequence into L2
    SequencePrefetch* const ns = stream_next ? &next_seq : nullptr;
#endif
    for (int64_t i = b0; i < e0; ++i) {
      const int64_t item = order[i], d = item / Hkv, kh = item % Hkv;
      const int64_t L = lens[d];
#ifdef ROSEINFER_AVX2
      if (ns)  // a K and a P.V step per block in each pass of up to 3 query heads
        aim_at_next_sequence(next_seq, order, i, b0, e0, seq_of, lens, Hkv, bt, bt_stride, kc,
                             vc, bs, bs * row * (int64_t)sizeof(KV), 2 * ((G + 2) / 3), l2_bytes);
#endif
      const float* qd = q + (d * H + kh * G) * Dh;
      const int32_t* table = bt + (int64_t)seq_of[d] * bt_stride;
      float* od = out + (d * H + kh * G) * Dh;
#ifdef ROSEINFER_AVX512
      if (vec_dh && tile_rows_at(order, i, e0, seq_of, Hkv)) {
        int64_t Lt[kTileRows];
        for (int r = 0; r < kTileRows; ++r) Lt[r] = lens[d + r];
        scores.resize(kTileRows * std::min<int64_t>(3, G) * *std::max_element(Lt, Lt + kTileRows));
        auto tile = Dh == 32 ? attend_item_tile<32, KV> : Dh == 64 ? attend_item_tile<64, KV>
                  : Dh == 128 ? attend_item_tile<128, KV> : attend_item_tile<256, KV>;
        tile(qd, H * Dh, kc, vc, table, Lt, G, row, bs, kh, scale, scores.data(), od, H * Dh,
             keys_t);
        i += kTileRows - 1;
        continue;
      }
#endif
      scores.resize(G * L);
#ifdef ROSEINFER_AVX2
      if (vec_dh) {
        auto item = Dh == 32 ? attend_item<32, KV> : Dh == 64 ? attend_item<64, KV>
                  : Dh == 128 ? attend_item<128, KV> : attend_item<256, KV>;
        // One row: the range is its KV heads b0 .. e0 - 1 in order; the first fetches all.
        const int64_t pf_heads = wide_first && i == b0 ? e0 - b0 : 1;
        item(qd, kc, vc, table, L, G, row, bs, kh, scale, scores.data(), od, ns, D == 1, pf_heads);
        continue;
      }
#endif
      for (int64_t t0 = 0; t0 < L; t0 += bs) {  // one KV block at a time
        const KV* kb = kc + ((int64_t)table[t0 / bs] * bs * Hkv + kh) * Dh;
        const int64_t n = std::min(bs, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const KV* k = kb + j * row;
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
        const KV* vb = vc + ((int64_t)table[t0 / bs] * bs * Hkv + kh) * Dh;
        const int64_t n = std::min(bs, L - t0);
        for (int64_t g = 0; g < G; ++g) {
          const float* sg = scores.data() + g * L + t0;
          for (int64_t j = 0; j < n; ++j) axpy_any(od + g * Dh, sg[j], vb + j * row, Dh);
        }
      }
    }
  });
}

template void attend_rows<float>(const float*, const float*, const float*, const int32_t*,
                                      int64_t, const int32_t*, const int32_t*, int64_t, int64_t,
                                      int64_t, int64_t, int64_t, float, float*);
template void attend_rows<at::Half>(const float*, const at::Half*, const at::Half*,
                                         const int32_t*, int64_t, const int32_t*, const int32_t*,
                                         int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                         float*);

void check_decode_args(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                              const at::Tensor& context_lens) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf ||
                   kv_cache.scalar_type() == at::kChar),
              "kv_cache must be contiguous float32 or float16 [2, slots, Hkv, Dh] or int8 "
              "[2, slots, Hkv, Dh + 4]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1,
              "block_tables must be int32 [D, W] with unit column stride");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(),
              "context_lens must be contiguous int32 [D]");
}

void check_token_seq(const at::Tensor& token_seq, const at::Tensor& block_tables, int64_t T) {
  TORCH_CHECK(token_seq.scalar_type() == at::kInt && token_seq.is_contiguous() &&
                  token_seq.numel() == T,
              "token_seq must be contiguous int32 [T]");
  const int32_t* s = token_seq.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < block_tables.size(0), "token_seq out of range");
}

at::Tensor paged_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                           at::Tensor token_seq, at::Tensor token_lens, int64_t block_size,
                           double scale) {
  return paged_attention_impl(q, kv_cache, block_tables, token_seq, token_lens, block_size,
                              scale, false);
}

at::Tensor paged_attention_impl(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                at::Tensor token_seq, at::Tensor token_lens, int64_t block_size,
                                double scale, bool portable) {
  check_decode_args(kv_cache, block_tables, token_lens);
  auto qc = q.contiguous();
  TORCH_CHECK(qc.dim() == 3 && qc.scalar_type() == at::kFloat, "q must be float32 [T, H, Dh]");
  const int64_t T = qc.size(0), H = qc.size(1), Dh = qc.size(2);
  const int64_t Hkv = kv_cache.size(2);
  TORCH_CHECK(cache_head_dim(kv_cache) == Dh && H % Hkv == 0,
              "head shapes do not match the cache");
  TORCH_CHECK(token_lens.numel() == T, "token_lens must have one entry per query row");
  check_token_seq(token_seq, block_tables, T);
  auto out = at::empty_like(qc);
  if (kv_cache.scalar_type() == at::kChar) {
    const int8_t* k = kv_cache.data_ptr<int8_t>();
    attend_rows_q8(qc.data_ptr<float>(), k, k + kv_cache.numel() / 2,
                   block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                   token_seq.data_ptr<int32_t>(), token_lens.data_ptr<int32_t>(), T, H, Hkv, Dh,
                   block_size, (float)scale, out.data_ptr<float>(), portable);
    return out;
  }
  with_kv_halves(kv_cache, [&](auto* kc, auto* vc) {
    attend_rows(qc.data_ptr<float>(), kc, vc, block_tables.data_ptr<int32_t>(),
                     block_tables.stride(0), token_seq.data_ptr<int32_t>(),
                     token_lens.data_ptr<int32_t>(), T, H, Hkv, Dh, block_size, (float)scale,
                     out.data_ptr<float>());
  });
  return out;
}

}  // namespace roseinfer
