// The float / fp16 decode attention of a one-row step (batch 1) on several threads
// (attend_rows, attention.cpp).  A row has only Hkv work items (one per KV head): with 3
// KV heads on 2 threads one thread took two and the other one, and each item reads one
// head's 128 bytes of every slot, a stride DRAM serves slowly.  Here the work is cut
// where no value depends on the cut:
//  1. scores: the context's blocks shared out, each thread computing every head's scores
//     of its positions (a slot's K rows of all heads one contiguous read), and fetching
//     the same positions' V rows on the way;
//  2. softmax and P.V: items (KV head, a part of the head dim), each thread its own copy
//     of its heads' softmax (the scores read-only), every output lane the FMA chain over
//     the positions in order; a thread's first walk fetches the rows of all its items.
// Each score and each output lane is computed by the operations of attend_heads_walk,
// so the same bits (tests/test_attention_op.py).  Measured on Zen 4 (2 threads, default
// model, docs/performance.md): context ~1,000 attention 1.74 -> 1.32 ms a step; ~200,
// 0.48 -> 0.46 ms.
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention_parts.h"
#include "attention_scores.h"

namespace roseinfer {

#ifdef ROSEINFER_AVX2
// Parts of the head dim per KV head in the P.V pass: 1 when the heads share out evenly
// over nt threads, else 2 or 4 (of kPvW lanes each, when the head dim has them).
inline int64_t one_row_dim_parts(int64_t Hkv, int64_t DH, int64_t nt) {
  int64_t parts = 1;
  while ((Hkv * parts) % nt != 0 && parts < 4 && (DH / kPvW) % (2 * parts) == 0) parts *= 2;
  return parts;
}

// Phase 1 for positions [p0, p1): scores[h * L + t] for every query head h = kh * G + g.
template <int DH, typename KV>
static void one_row_scores(const float* q, const KV* kc, const int32_t* table, int64_t L,
                           int64_t Hkv, int64_t G, int64_t row, int64_t bs, float scale,
                           int64_t p0, int64_t p1, float* scores, const KV* vc) {
  const KV* const zero = reinterpret_cast<const KV*>(kZeroRow);
  const int64_t slot_bytes = Hkv * DH * (int64_t)sizeof(KV);
  // The K rows ahead of use, and the V rows of the same positions on their way to cache
  // for phase 2 (from DRAM at ~1,000 positions, a step measured 7% slower without them).
  RowsAhead<KV> ahead(table, bs, kc, row, p1, slot_bytes, p0);
  RowsAhead<KV> vahead(table, bs, vc, row, p1, slot_bytes, p0);
  SlotCursor c(table, bs, p0);
  for (int64_t t0 = p0; t0 < p1; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, p1 - t0);
    const KV* slot[4];
    for (int64_t j = 0; j < 4; ++j) {
      slot[j] = j < n ? kc + c.slot() * row : nullptr;
      if (j < n) c.next();
      ahead.step(t0 + j);
      vahead.step(t0 + j);
    }
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const KV* k[4];
      for (int64_t j = 0; j < 4; ++j) k[j] = slot[j] ? slot[j] + kh * DH : zero;
      for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int64_t gb = std::min<int64_t>(3, G - g0);
        const float* qh = q + (kh * G + g0) * DH;
        float* out = scores + (kh * G + g0) * L + t0;
#ifdef ROSEINFER_AVX512
        (gb == 3 ? scores4_zmm<DH, 3, KV> : gb == 2 ? scores4_zmm<DH, 2, KV>
                                                     : scores4_zmm<DH, 1, KV>)(qh, k, n, scale,
                                                                               out, L);
#else
        (gb == 3 ? scores4<DH, 3, KV> : gb == 2 ? scores4<DH, 2, KV>
                                                 : scores4<DH, 1, KV>)(qh, k, n, scale, out, L);
#endif
      }
    }
  }
}

// P.V of GB query heads (probabilities p, stride L) over CH register widths of a slot's
// row from column col on, every position in order; each row's pf_bytes from col fetched
// kAhead positions before its use.
template <int GB, int CH, typename KV>
static void one_row_pv(const float* p, const KV* vc, const int32_t* table, int64_t L,
                       int64_t row, int64_t bs, int64_t col, float* od, int64_t DH,
                       int64_t pf_bytes) {
  PvVec acc[GB][CH];
  for (int g = 0; g < GB; ++g)
    for (int u = 0; u < CH; ++u) acc[g][u] = vzero<PvVec>();
  RowsAhead<KV> ahead(table, bs, vc + col, row, L, pf_bytes);
  SlotCursor v(table, bs, 0);
  for (int64_t t = 0; t < L; ++t, v.next()) {
    ahead.step(t);
    pv_step(p, L, t, vc + v.slot() * row + col, acc);
  }
  for (int g = 0; g < GB; ++g)
    for (int u = 0; u < CH; ++u) vstore(od + g * DH + kPvW * u, acc[g][u]);
}

// Phase 2, item (KV head kh, dim part `part` of `parts`): its G heads' softmax from
// scores (copied: the other parts of kh read the same rows), then their outputs' dims.
template <int DH, typename KV>
static void one_row_item(const float* scores, const KV* vc, const int32_t* table, int64_t L,
                         int64_t G, int64_t row, int64_t bs, int64_t kh, int64_t part,
                         int64_t parts, std::vector<float>& p, float* out, int64_t pf_span) {
  p.resize(G * L);
  std::memcpy(p.data(), scores + kh * G * L, G * L * sizeof(float));
  for (int64_t g = 0; g < G; ++g) softmax_row(p.data() + g * L, L);
  constexpr int64_t kVecs = DH / kPvW;  // register widths of a head
  const int64_t per = kVecs / parts;    // of this part
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const int64_t gb = std::min<int64_t>(3, G - g0);
    for (int64_t u0 = part * per; u0 < (part + 1) * per; u0 += kPvChunk<DH>) {
      const int64_t ch = std::min<int64_t>(kPvChunk<DH>, (part + 1) * per - u0);
      const int64_t col = kh * DH + kPvW * u0;
      float* od = out + (kh * G + g0) * DH + kPvW * u0;
      const float* pg = p.data() + g0 * L;
      // ch is 1, 2 or 4 (kPvChunk is at most 4; per a power of two or kVecs)
      const int64_t own = ch * kPvW * (int64_t)sizeof(KV);
      const int64_t pf = g0 == 0 && u0 == part * per ? std::max(own, pf_span) : own;
      auto run = [&](auto gbc, auto chc) {
        one_row_pv<decltype(gbc)::value, decltype(chc)::value, KV>(pg, vc, table, L, row, bs,
                                                                   col, od, DH, pf);
      };
      using I1 = std::integral_constant<int, 1>;
      using I2 = std::integral_constant<int, 2>;
      using I3 = std::integral_constant<int, 3>;
      using I4 = std::integral_constant<int, 4>;
      auto by_ch = [&](auto gbc) {
        if (ch == 4) run(gbc, I4{});
        else if (ch == 2) run(gbc, I2{});
        else run(gbc, I1{});
      };
      if (gb == 3) by_ch(I3{});
      else if (gb == 2) by_ch(I2{});
      else by_ch(I1{});
    }
  }
}

// The one-row step on nt > 1 threads: q [H, DH], out [H, DH].
template <int DH, typename KV>
static void attend_one_row(const float* q, const KV* kc, const KV* vc, const int32_t* table,
                           int64_t L, int64_t H, int64_t Hkv, int64_t row, int64_t bs,
                           float scale, float* out, int64_t nt) {
  const int64_t G = H / Hkv;
  std::unique_ptr<float[]> scores(new float[H * L]);  // every value written by phase 1
  const int64_t nblk = (L + bs - 1) / bs;
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    one_row_scores<DH, KV>(q, kc, table, L, Hkv, G, row, bs, scale, b0 * bs,
                           std::min(b1 * bs, L), scores.get(), vc);
  });
  const int64_t parts = one_row_dim_parts(Hkv, DH, nt);
  at::parallel_for(0, Hkv * parts, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p;
    // the range's first walk fetches the rows of all its items (contiguous in a slot)
    const int64_t span = (i1 - i0) * (DH / parts) * (int64_t)sizeof(KV);
    for (int64_t i = i0; i < i1; ++i)
      one_row_item<DH, KV>(scores.get(), vc, table, L, G, row, bs, i / parts, i % parts,
                           parts, p, out, i == i0 ? span : 0);
  });
}
#endif  // ROSEINFER_AVX2

}  // namespace roseinfer
