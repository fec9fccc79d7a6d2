// The GGUF GEMM (gguf_gemm.h) on AMX tiles for 16-row tiles of steps of many rows: a
// panel's 32-blocks are decoded once (gguf_decode.h's int16 values v = q - offset, as
// int8 in the tiles' layout: row k/4, column c's four values at 4c), the int16
// activations split into bytes (x = 256 hi + lo, lo unsigned, hi signed; split_tiles),
// and per block two tile products give the exact int32 dots: dot = 256 * (hi . v) +
// (lo . v), the integers of the vector loops.  Then each block's fp32 steps, block_step
// (gguf_tiles.h) as in tile_blocks_zmm, in block order: the same bits.  Formats with one
// scale per 32-block (not Q6_K, whose 16-value halves stay on the vector loops).
#pragma once

#include "amx.h"
#include "gguf_decode.h"
#include "gguf_tiles.h"
#include "q8_tiles.h"

namespace roseinfer {

#ifdef ROSEINFER_AMX
// Tile registers: 0 / 1 a block's dots with the low / high bytes (16 rows x 16
// columns int32), 2 / 3 those bytes (16 rows x 32), 4 the block's values (8 x 64).
inline TileConfig gguf_tile_config() {
  TileConfig c;
  return c.tile(0, 16, 64).tile(1, 16, 64).tile(2, 16, 32).tile(3, 16, 32).tile(4, 8, 64);
}

// int16 activations as two byte planes (x = 256 * hi + lo, lo unsigned, hi signed), laid
// out for the tiles: the whole 16-row tiles of the M rows, per tile and 32-block
// kPlaneBlock bytes, row r at 64 r: its 32 lo bytes, then its 32 hi bytes.  A block's
// two A tiles then load 16 consecutive lines; loaded from rows K bytes apart (as the
// activations lie), the 16 lines of a tile fall into two L1 sets for K = 2048 and were
// read from L2 (docs/performance.md, "Tile-ordered activations").
constexpr int64_t kPlaneBlock = kAmxRows * 64;
inline void split_tiles(const int16_t* x, int64_t M, int64_t K, uint8_t* out) {
  const int64_t KB = K / 32;
  for (int64_t t = 0; t < M / kAmxRows; ++t)
    for (int64_t r = 0; r < kAmxRows; ++r) {
      const int16_t* row = x + (t * kAmxRows + r) * K;
      for (int64_t j = 0; j < KB; ++j) {
        const __m512i v = _mm512_loadu_si512(row + j * 32);
        uint8_t* o = out + (t * KB + j) * kPlaneBlock + r * 64;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi16_epi8(v));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
      }
    }
}

// One panel decoded for the tiles: per block 512 int8 values, the scales d0 and the
// minimum terms m (16 fp32 each).
struct AmxPanel {
  std::vector<int8_t> v;
  std::vector<float> d, m;
  void size_for(int64_t KB) {
    if (static_cast<int64_t>(v.size()) >= KB * 512) return;
    v.resize(KB * 512);
    d.resize(KB * 16);
    m.resize(KB * 16);
  }
};

// Tile byte 4c + i (k = 4r + i) from step 2r's bytes 2c, 2c + 1 (i < 2) and step
// 2r + 1's (i >= 2): bytes (in int16 lanes: words) of a and b.
struct TileOrder {
  alignas(64) uint8_t idx8[64] = {};
  alignas(64) uint8_t idx16[64] = {};
  constexpr TileOrder() {
    for (int c = 0; c < 16; ++c)
      for (int i = 0; i < 4; ++i) {
        idx8[4 * c + i] = static_cast<uint8_t>((i < 2 ? 0 : 32) + 2 * c + i % 2);
        idx16[4 * c + i] = static_cast<uint8_t>((i < 2 ? 0 : 64) + 4 * c + 2 * (i % 2));
      }
  }
};
inline constexpr TileOrder kTileOrder{};

// A panel's blocks [j0, j1) decoded into v, d, m (an AmxPanel's arrays; blk: scratch).
// 4- and 8-bit values straight from the panel (two steps of the I8 order,
// gguf_formats.h, are 64 bytes: one permutation makes them a tile row); 5 bits from
// decode_avx2's int16 values (lane 2c + k % 2 of steps of two k: one two-source
// permutation per row).
template <class F>
void decode_blocks_amx(const uint8_t* panel, int64_t j0, int64_t j1, int8_t* v, float* d,
                       float* m, DBlock& blk) {
  constexpr int64_t BPS = F::E / 32;
  const __m512i perm8 = _mm512_load_si512(kTileOrder.idx8);
  const __m512i perm16 = _mm512_load_si512(kTileOrder.idx16);
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m512i off = _mm512_set1_epi8(static_cast<char>(F::OFFSET));
  for (int64_t j = j0; j < j1; ++j) {
    constexpr bool kRaw = F::BITS == 4 || F::BITS == 8;
    decode_avx2<F>(panel + (j / BPS) * F::kPanel, static_cast<int>(j % BPS), blk, !kRaw);
    int8_t* o = v + j * 512;
    for (int r = 0; r < 8; ++r) {  // steps 2r and 2r + 1: k = 4r .. 4r + 3
      __m512i row;
      if constexpr (F::BITS == 8) {
        row = _mm512_permutexvar_epi8(perm8, _mm512_loadu_si512(blk.qp + 64 * r));
      } else if constexpr (F::BITS == 4) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qp + 32 * r));
        const __m512i both = join256(_mm256_and_si256(q, low4), _mm256_and_si256(_mm256_srli_epi16(q, 4), low4));
        row = _mm512_sub_epi8(_mm512_permutexvar_epi8(perm8, both), off);
      } else {
        row = _mm512_permutex2var_epi8(_mm512_load_si512(blk.w + 64 * r), perm16,
                                       _mm512_load_si512(blk.w + 64 * r + 32));
      }
      _mm512_storeu_si512(o + 64 * r, row);
    }
    std::memcpy(d + j * 16, blk.d0, sizeof blk.d0);
    std::memcpy(m + j * 16, blk.m, sizeof blk.m);
  }
}

// Rows [0, 16) (ab: their byte planes, split_tiles) x one decoded panel into y (+ bias),
// prefetching pf_step bytes a block of the panel at pf (or none): software-pipelined as
// q4_act8's tile_amx (the next block's products run while this one is scaled, stored
// after).  decode (or null): the panel whose blocks are decoded into w as the loop goes,
// kDecodeAhead blocks before their tile loads: a tile load waits for the stores of what
// it reads to drain, so with the whole panel decoded first each panel's first products
// waited for its 32 KB (K = 2048) to 128 KB of stores (docs/performance.md, "Decoded as
// the loop goes").
template <class F>
void tile_amx(const uint8_t* ab, const float* dx, const float* sx, int64_t K, AmxPanel& w,
              int64_t n0, int64_t nc, const float* bias, float* y, int64_t ldy,
              const uint8_t* pf, int64_t pf_step, const uint8_t* decode) {
  constexpr bool MIN = F::kMin;
  constexpr int64_t kDecodeAhead = 3;
  const int64_t KB = K / 32;
  // The panel's arrays as plain pointers: w is a thread_local of the caller, and its
  // address looked up in the loop is a call that spills the accumulators.
  int8_t* wv = w.v.data();
  float *wd = w.d.data(), *wm = w.m.data();
  DBlock blk;  // decode's scratch (a thread_local here would be such a call)
  if (decode) decode_blocks_amx<F>(decode, 0, std::min(kDecodeAhead, KB), wv, wd, wm, blk);
  alignas(64) int32_t cb[2][256];  // the dots with lo, with hi
  const auto dots = [&](int64_t j) {
    RI_TILE_ZERO(0);
    RI_TILE_ZERO(1);
    RI_TILE_LOAD(2, ab + j * kPlaneBlock, 64);
    RI_TILE_LOAD(3, ab + j * kPlaneBlock + 32, 64);
    RI_TILE_LOAD(4, wv + j * 512, 64);
    RI_TDP(tdpbusd, 0, 2, 4);
    RI_TDP(tdpbssd, 1, 3, 4);
  };
  const auto store = [&] {
    RI_TILE_STORE(0, cb[0]);
    RI_TILE_STORE(1, cb[1]);
  };
  tile_barrier();  // the values and bytes the tiles load are written
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (auto& a : acc) a = _mm512_setzero_ps();
  dots(0);
  store();
  for (int64_t j = 0; j < KB; ++j) {
    const __m512 d = _mm512_loadu_ps(wd + j * 16);
    const __m512 mn = MIN ? _mm512_loadu_ps(wm + j * 16) : d;
    if (j + 1 < KB) dots(j + 1);
    if (decode && j + kDecodeAhead < KB) {
      decode_blocks_amx<F>(decode, j + kDecodeAhead, j + kDecodeAhead + 1, wv, wd, wm, blk);
      tile_barrier();  // written before the tile loads of a later iteration
    }
    if (pf) prefetch_bytes(pf + j * pf_step, pf_step);
#pragma GCC unroll 16
    for (int m = 0; m < kAmxRows; ++m) {  // unrolled: acc stays in registers
      const __m512i z = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cb[1] + 16 * m), 8),
                                         _mm512_load_si512(cb[0] + 16 * m));
      acc[m] = block_step<MIN>(acc[m], z, dx[m * KB + j], MIN ? sx[m * KB + j] : 0.f, d, mn);
    }
    if (j + 1 < KB) store();
  }
  alignas(64) float out[kAmxRows * 16];
#pragma GCC unroll 16
  for (int m = 0; m < kAmxRows; ++m) _mm512_store_ps(out + m * 16, acc[m]);
  store_tile(out, kAmxRows, n0, nc, bias, y, ldy);
}

// Rows [0, 16 * tiles) x panel p: decoded once, by the first 16-row tile's loop (which
// also prefetches the next panel), then read by the other tiles.
template <class F>
void panel_amx(const uint8_t* panel, int64_t tiles, const uint8_t* ab,
               const float* dx, const float* sx, int64_t K, int64_t n0, int64_t nc,
               const float* bias, float* y, int64_t ldy) {
  thread_local AmxPanel w;
  const int64_t KB = K / 32;
  w.size_for(KB);
  constexpr int64_t kShare = F::kPanel / (F::E / 32);  // a 32-block's bytes
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m = t * kAmxRows;
    tile_amx<F>(ab + t * KB * kPlaneBlock, dx + m * KB, sx + m * KB, K, w, n0, nc, bias,
                y + m * ldy, ldy, t == 0 ? panel + KB * kShare : nullptr, kShare,
                t == 0 ? panel : nullptr);
  }
}
#endif  // ROSEINFER_AMX

}  // namespace roseinfer
