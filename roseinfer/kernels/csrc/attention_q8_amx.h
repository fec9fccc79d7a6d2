// The int8 KV attention's AMX pieces (attention_q8.cpp; Sapphire Rapids on): the Q.K
// pass on tiles (exact int32 dots, tdpbssd) and, for batches of decode rows enough for
// every thread, the kernel that takes one row's every KV head block by block.  The same scores,
// softmax and FMA chains as the AVX2 loops and the portable implementation: the same bits.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "attention_parts.h"
#include "kv_q8.h"

namespace roseinfer {

#ifdef ROSEINFER_AMX
// The Q.K pass on AMX tiles (head dims of 64 bytes' multiples, blocks of 16-slot
// multiples): the item's query heads as the tiles' B operand (tiles 2..: row r, column g:
// qq bytes 4r..4r+3 of head g, one tile per 64 dims), loaded once; then per 16 slots of
// a block one strided tile load of head kh's K rows (tile 1) gives the 16 x GB exact
// int32 dots (tile 0), the integers of dots4, and each score is made as the vector loop
// makes it: (float(dot) * (qs * ks)) * scale.  Rows of a last, partial block past the
// context are loaded (the block is the pool's) but their scores are not stored.  The
// dots and query tiles are kQ8TileHeads columns wide (a pass's heads, q8_item), not 16:
// their store is 12 bytes a slot, read back by two permutes a head instead of a gather
// (the op alone at batch 64, context 1,024: ~9% less compute, docs/kv-cache.md).
constexpr int kQ8TileHeads = 3;
inline TileConfig q8_attention_tiles() {
  constexpr int kW = 4 * kQ8TileHeads;  // bytes a row: one int32 / 4 int8 per head
  TileConfig c;
  return c.tile(0, 16, kW).tile(1, 16, 64).tile(2, 16, kW).tile(3, 16, kW).tile(4, 16, kW)
      .tile(5, 16, kW);
}

// The B tiles' bytes of a pass's GB query heads (qq: their quantized rows): [chunk][r][4g + i].
template <int DH, int GB>
static void q8_pack_query(const int8_t* qq, int8_t (*qb)[16 * 64]) {
  static_assert(DH % 64 == 0 && DH <= 256, "64-dim chunks, at most 4 B tiles");
  constexpr int64_t kHead = DH + kQ8ScaleBytes, kChunks = DH / 64;
  for (int64_t c = 0; c < kChunks; ++c) {
    std::fill(qb[c], qb[c] + 16 * 64, int8_t{0});
    for (int r = 0; r < 16; ++r)
      for (int g = 0; g < GB; ++g)
        for (int i = 0; i < 4; ++i) qb[c][r * 64 + 4 * g + i] = qq[g * kHead + 64 * c + 4 * r + i];
  }
}

template <int DH>
static inline void q8_load_query(const int8_t (*qb)[16 * 64]) {
  constexpr int64_t kChunks = DH / 64;
  tile_barrier();  // qb is written
  RI_TILE_LOAD(2, qb[0], 64);
  if constexpr (kChunks > 1) RI_TILE_LOAD(3, qb[1], 64);
  if constexpr (kChunks > 2) RI_TILE_LOAD(4, qb[2], 64);
  if constexpr (kChunks > 3) RI_TILE_LOAD(5, qb[3], 64);
}

template <int DH, int GB>
static void q8_query_tiles(const int8_t* qq) {
  alignas(64) int8_t qb[DH / 64][16 * 64];
  q8_pack_query<DH, GB>(qq, qb);
  q8_load_query<DH>(qb);
}

// The scales of up to 16 rows of one head (rows: the first row's values, rowb apart;
// offs = q8_row_offsets(rowb)) by one gather, lanes past the mask m zero (16 scalar
// stores and a vector load of them stall on store forwarding).
inline __m512i q8_row_offsets(int64_t rowb) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(static_cast<int32_t>(rowb)));
}
template <int DH>
inline __m512 q8_scales16(const int8_t* rows, __m512i offs, __mmask16 m) {
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, offs, rows + DH, 1);
}

// The scores of a block's first t1 slots (rows at base, rowb apart) into scores[g * L + t]
// (scores: the block's first position).
template <int DH, int GB>
static void q8_block_scores_amx(const int8_t* base, int64_t t1, int64_t rowb, const float* qs,
                                float scale, float* scores, int64_t L) {
  constexpr int64_t kChunks = DH / 64;
  // Head g's dot of slot j at cb[kQ8TileHeads * j + g] (slots 12 bytes apart): lane j of
  // z0 / z1 / z2 (cb's 48 values) picked by index 3j + g; the lanes where 3j + g >= 32
  // from z2 (its low 4 bits index z2's lanes).
  static_assert(kQ8TileHeads == 3 && GB <= kQ8TileHeads, "the index tables below; q8_item's passes");
  alignas(64) static const int32_t kIdx[3][16] = {
      {0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36, 39, 42, 45},
      {1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 37, 40, 43, 46},
      {2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 44, 47}};
  constexpr __mmask16 kFromZ2[3] = {0xF800, 0xF800, 0xFC00};
  alignas(64) int32_t cb[16 * kQ8TileHeads];
  const __m512 sc = _mm512_set1_ps(scale);
  const __m512i offs = q8_row_offsets(rowb);
  for (int64_t r0 = 0; r0 < t1; r0 += 16) {
    const int64_t n = std::min<int64_t>(16, t1 - r0);
    const int8_t* rows = base + r0 * rowb;
    RI_TILE_ZERO(0);
    RI_TILE_LOAD(1, rows, rowb);
    RI_TDP(tdpbssd, 0, 1, 2);
    if constexpr (kChunks > 1) { RI_TILE_LOAD(1, rows + 64, rowb); RI_TDP(tdpbssd, 0, 1, 3); }
    if constexpr (kChunks > 2) { RI_TILE_LOAD(1, rows + 128, rowb); RI_TDP(tdpbssd, 0, 1, 4); }
    if constexpr (kChunks > 3) { RI_TILE_LOAD(1, rows + 192, rowb); RI_TDP(tdpbssd, 0, 1, 5); }
    RI_TILE_STORE_AT(0, cb, 4 * kQ8TileHeads);
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
    const __m512 kv = q8_scales16<DH>(rows, offs, m);
    const __m512i z0 = _mm512_load_si512(cb), z1 = _mm512_load_si512(cb + 16),
                  z2 = _mm512_load_si512(cb + 32);
    for (int g = 0; g < GB; ++g) {  // column g of cb: the 16 slots' dots with head g
      const __m512i idx = _mm512_load_si512(kIdx[g]);
      const __m512i d =
          _mm512_mask_permutexvar_epi32(_mm512_permutex2var_epi32(z0, idx, z1), kFromZ2[g], idx, z2);
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_set1_ps(qs[g]), kv));
      _mm512_mask_storeu_ps(scores + g * L + r0, m, _mm512_mul_ps(s, sc));
    }
  }
}

// One row's every KV head, block by block (decode at large batch): each block's K bytes,
// then its V bytes, come into L1 once (prefetched a block ahead, straight into L1) and
// serve every KV head's query heads before the next block: a core then computes from L1
// while the next block streams in, where per-(row, KV head) items read a block's lines
// from L2 once per head, and a core does not overlap those L2 reads with its own stream
// from DRAM (benchmarks/prefetch_overlap.cpp).  The same scores, softmax, weights and
// FMA chains as q8_heads (the P.V accumulators kept in od between blocks, exact): the
// same bits.  qq / qs: the row's H query heads quantized; scores [H, L]; od [H, DH];
// qb: (Hkv * passes) x DH / 64 B tiles' bytes.
template <int DH>
static void q8_row_amx(const int8_t* qq, const float* qs, const int8_t* kc, const int8_t* vc,
                       const int32_t* table, int64_t L, int64_t G, int64_t Hkv, int64_t rowb,
                       int64_t bs, float scale, float* scores, float* od, float* inv,
                       int8_t (*qb)[16 * 64]) {
  constexpr int64_t kHead = DH + kQ8ScaleBytes, kChunks = DH / 64;
  const int64_t npass = (G + 2) / 3, nblk = (L + bs - 1) / bs, bstride = bs * rowb;
  const int64_t lines = (bstride + 63) / 64;
  for (int64_t kh = 0; kh < Hkv; ++kh)
    for (int64_t p = 0; p < npass; ++p) {
      const int64_t g0 = 3 * p, gb = std::min<int64_t>(3, G - g0);
      const int8_t* q = qq + (kh * G + g0) * kHead;
      int8_t (*dst)[16 * 64] = qb + (kh * npass + p) * kChunks;
      if (gb == 3) q8_pack_query<DH, 3>(q, dst);
      else if (gb == 2) q8_pack_query<DH, 2>(q, dst);
      else q8_pack_query<DH, 1>(q, dst);
    }
  // Block b's lines [l0, l1) of half into L1.
  auto fetch = [&](const int8_t* half, int64_t b, int64_t l0, int64_t l1) {
    const char* base = reinterpret_cast<const char*>(half + table[b] * bstride);
    for (int64_t l = l0; l < l1; ++l) _mm_prefetch(base + 64 * l, _MM_HINT_T0);
  };
  constexpr int64_t kA = 1;  // blocks ahead (2 or 3: slower, benchmarks/kv_int8.py)
  for (int64_t b = 0; b < std::min(kA, nblk); ++b) fetch(kc, b, 0, lines);
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t t1 = std::min(bs, L - b * bs);
    const int8_t* blk = kc + table[b] * bstride;
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const int64_t l0 = kh * lines / Hkv, l1 = (kh + 1) * lines / Hkv;
      if (b + kA < nblk) fetch(kc, b + kA, l0, l1);
      else if (b + kA - nblk < nblk) fetch(vc, b + kA - nblk, l0, l1);  // V's first blocks
      for (int64_t p = 0; p < npass; ++p) {
        const int64_t g0 = 3 * p, gb = std::min<int64_t>(3, G - g0), h0 = kh * G + g0;
        q8_load_query<DH>(qb + (kh * npass + p) * kChunks);
        const int8_t* rows = blk + kh * kHead;
        float* sc = scores + h0 * L + b * bs;
        if (gb == 3) q8_block_scores_amx<DH, 3>(rows, t1, rowb, qs + h0, scale, sc, L);
        else if (gb == 2) q8_block_scores_amx<DH, 2>(rows, t1, rowb, qs + h0, scale, sc, L);
        else q8_block_scores_amx<DH, 1>(rows, t1, rowb, qs + h0, scale, sc, L);
      }
    }
  }
  const int64_t H = G * Hkv;
  for (int64_t h = 0; h < H; ++h) inv[h] = softmax_exp(scores + h * L, L);
  const __m512i offs = q8_row_offsets(rowb);
  constexpr int kChunkZ = DH / 16 < 4 ? DH / 16 : 4;  // 16-dim vectors per pass
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t t1 = std::min(bs, L - b * bs);
    const int8_t* blk = vc + table[b] * bstride;
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      if (b + kA < nblk) fetch(vc, b + kA, kh * lines / Hkv, (kh + 1) * lines / Hkv);
      const int8_t* rows = blk + kh * kHead;
      for (int64_t r0 = 0; r0 < t1; r0 += 16) {  // w_t = (e_t * inv) * vscale_t
        const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, t1 - r0)) - 1);
        const __m512 sv = q8_scales16<DH>(rows + r0 * rowb, offs, m);
        for (int64_t g = 0; g < G; ++g) {
          float* w = scores + (kh * G + g) * L + b * bs + r0;
          const __m512 pw = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w), _mm512_set1_ps(inv[kh * G + g]));
          _mm512_mask_storeu_ps(w, m, _mm512_mul_ps(pw, sv));
        }
      }
      for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int gb = static_cast<int>(std::min<int64_t>(3, G - g0));
        const int64_t h0 = kh * G + g0;
        for (int ch = 0; ch < DH / 16; ch += kChunkZ) {
          __m512 acc[3][kChunkZ];
          for (int g = 0; g < 3; ++g)
            for (int u = 0; u < kChunkZ; ++u)
              acc[g][u] = (b == 0 || g >= gb) ? _mm512_setzero_ps()
                                              : _mm512_loadu_ps(od + (h0 + g) * DH + 16 * (ch + u));
          const int8_t* base = rows + 16 * ch;
          const float* pb = scores + h0 * L + b * bs;
          for (int64_t r = 0; r < t1; ++r) {
            const int8_t* vr = base + r * rowb;
            __m512 pv[3];
            for (int g = 0; g < 3; ++g) pv[g] = _mm512_set1_ps(g < gb ? pb[g * L + r] : 0.f);
            for (int u = 0; u < kChunkZ; ++u) {
              const __m512 vv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(vr + 16 * u))));
              for (int g = 0; g < 3; ++g) acc[g][u] = _mm512_fmadd_ps(pv[g], vv, acc[g][u]);
            }
          }
          for (int g = 0; g < gb; ++g)
            for (int u = 0; u < kChunkZ; ++u) _mm512_storeu_ps(od + (h0 + g) * DH + 16 * (ch + u), acc[g][u]);
        }
      }
    }
  }
}

// attend_rows_q8 for D rows by q8_row_amx, rows split between the threads.
inline void q8_rows_amx(const float* q, const int8_t* kc, const int8_t* vc, const int32_t* bt,
                        int64_t bt_stride, const int32_t* seq_of, const int32_t* lens, int64_t D,
                        int64_t H, int64_t Hkv, int64_t Dh, int64_t bs, float scale, float* out) {
  const int64_t G = H / Hkv, rowb = Hkv * q8_row_bytes(Dh);
  at::parallel_for(0, D, 1, [&](int64_t d0, int64_t d1) {
    TileScope tiles_on(q8_attention_tiles());
    std::vector<float> scores, inv(H), qs(H);
    std::vector<int8_t> qq(H * q8_row_bytes(Dh));
    std::vector<int8_t> qbuf(  // the B tiles' bytes, 64-byte aligned
        Hkv * ((G + 2) / 3) * (Dh / 64) * 16 * 64 + 64);
    int8_t (*qb)[16 * 64] = reinterpret_cast<int8_t (*)[16 * 64]>(
        (reinterpret_cast<uintptr_t>(qbuf.data()) + 63) & ~uintptr_t{63});
    for (int64_t d = d0; d < d1; ++d) {
      const int64_t L = lens[d];
      scores.resize(H * L);
      for (int64_t h = 0; h < H; ++h) {
        int8_t* row = qq.data() + h * q8_row_bytes(Dh);
        q8_store_head(row, q + (d * H + h) * Dh, Dh);
        qs[h] = q8_scale(row, Dh);
      }
      const int32_t* table = bt + (int64_t)seq_of[d] * bt_stride;
      auto run = Dh == 64 ? q8_row_amx<64> : Dh == 128 ? q8_row_amx<128> : q8_row_amx<256>;
      run(qq.data(), qs.data(), kc, vc, table, L, G, Hkv, rowb, bs, scale, scores.data(),
          out + d * H * Dh, inv.data(), qb);
    }
  });
}
#endif  // ROSEINFER_AMX

}  // namespace roseinfer
