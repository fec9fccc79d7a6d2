// q4_act8.h's GEMM on AMX tiles for 16-row tiles of steps of many rows: per block one
// tile product (tdpbsud: the int8 activations against the unsigned weights in the
// bytes layout, which is the tiles' layout; nibble panels widened once per chunk, by
// its first tile's loop) gives the block's exact int32 dots, the integers of the vector
// loops; then each block's fp32 steps as tile_zmm's (q4_act8.cpp), in block order: the
// same bits.
#pragma once

#include <cstring>
#include <vector>

#include "amx.h"
#include "q4_act8_layout.h"
#include "q8_tiles.h"

namespace roseinfer {
namespace act8 {

#ifdef ROSEINFER_AMX
// AMX: 16 rows x one panel per tile product.  Registers: 0 / 1 the int32 dots of an
// even / odd block (16 rows x 16 columns), 2 / 3 its activations (16 rows x 32 int8),
// 4 / 5 its weights (8 steps x the bytes layout's 64 bytes: 16 columns x 4 unsigned).
inline TileConfig act8_tiles() {
  TileConfig c;
  return c.tile(0, 16, 64).tile(1, 16, 64).tile(2, 16, 32).tile(3, 16, 32).tile(4, 8, 64).tile(5, 8, 64);
}

// The int8 activations of the M rows' whole 16-row tiles in tile order: per tile and
// block kTileBlock bytes (16 rows x 32), so a block's A tile loads 8 consecutive lines;
// from rows K bytes apart (as quantize_rows leaves them) a tile's lines fall into a few
// L1 sets for K = 2048 and were read from L2 (docs/performance.md, "Tile-ordered
// activations").
constexpr int64_t kTileBlock = kAmxRows * kQ8Block;
inline void tile_order(const int8_t* xq, int64_t M, int64_t K, int8_t* out) {
  const int64_t KB = K / kQ8Block;
  for (int64_t t = 0; t < M / kAmxRows; ++t)
    for (int64_t r = 0; r < kAmxRows; ++r)
      for (int64_t j = 0; j < KB; ++j)
        std::memcpy(out + (t * KB + j) * kTileBlock + r * kQ8Block,
                    xq + (t * kAmxRows + r) * K + j * kQ8Block, kQ8Block);
}

// Blocks [j0, j1) of a nibble panel's weights in the bytes layout (512 bytes per block,
// block_int_zmm's regrouping) at out.
template <bool OFF>
void widen_blocks(const uint8_t* panel, int64_t j0, int64_t j1, uint8_t* out) {
  const __m512i nib = _mm512_set1_epi8(15);
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* blk = panel + j * block_bytes(true, !OFF);
    for (int s = 0; s < 8; s += 2) {
      const __m512i v = _mm512_loadu_si512(blk + kNibStep * s);
      const __m512i lo = _mm512_and_si512(v, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      _mm512_storeu_si512(out + j * 512 + kStepBytes * s, _mm512_shuffle_i64x2(lo, hi, 0x44));
      _mm512_storeu_si512(out + j * 512 + kStepBytes * s + kStepBytes, _mm512_shuffle_i64x2(lo, hi, 0xEE));
    }
  }
}

// tile_zmm's fp32 steps for 16 rows, the block's dots at cb (16 x 16 int32); dw / mw:
// the block's weight scales.
template <bool OFF>
inline void scale16(const int32_t* cb, __m512 dw, __m512 mw, const float* dx, const float* sx,
                    const int32_t* xs, int64_t KB, int64_t j, __m512 (&acc)[kAmxRows]) {
#pragma GCC unroll 16
  for (int m = 0; m < kAmxRows; ++m)  // unrolled: acc stays in registers
    acc[m] = block_step<OFF>(acc[m], _mm512_load_si512(cb + 16 * m), dx[m * KB + j],
                             sx[m * KB + j], OFF ? xs[m * KB + j] : 0, dw, mw);
}

// Rows [0, 16) (xt: their activations, tile_order) x one panel (w: its first block; wt:
// its weights as tiles, 512 bytes a block at stride wts) into y (+ bias), prefetching
// the panel at pf (or none): each block's exact dots from one tile product, then
// tile_zmm's fp32 steps.
// Software-pipelined by pairs of blocks: the next pair's products run while this pair
// is scaled, and are stored after that (a tile store holds back the loads after it).
// widen (or null): the nibble panel whose blocks are widened into `widened` (= wt,
// stride 512) as the loop goes, kWidenAhead blocks before their tile loads: a tile load
// waits for the stores of what it reads to drain, so with the whole panel widened
// first each panel's first products waited for its 32 KB of stores (K = 2048;
// docs/performance.md, "Decoded as the loop goes").
template <bool NIB, bool OFF>
void tile_amx(const int8_t* xt, const float* dx, const float* sx, const int32_t* xs, int64_t K,
              const uint8_t* w, const uint8_t* wt, int64_t wts, int64_t n0, const float* bias,
              float* y, int64_t N, const uint8_t* pf, const uint8_t* widen, uint8_t* widened) {
  constexpr int64_t kWidenAhead = 4;  // two pairs
  const int64_t KB = K / kQ8Block, bb = block_bytes(NIB, !OFF);
  if (widen) widen_blocks<OFF>(widen, 0, std::min(kWidenAhead, KB), widened);
  alignas(64) int32_t cb[2][256];
  const auto dots = [&](int64_t j) {  // blocks j, j + 1 (if any) into tiles 0, 1
    RI_TILE_ZERO(0);
    RI_TILE_LOAD(2, xt + j * kTileBlock, kQ8Block);
    RI_TILE_LOAD(4, wt + j * wts, 64);
    RI_TDP(tdpbsud, 0, 2, 4);
    if (j + 1 < KB) {
      RI_TILE_ZERO(1);
      RI_TILE_LOAD(3, xt + (j + 1) * kTileBlock, kQ8Block);
      RI_TILE_LOAD(5, wt + (j + 1) * wts, 64);
      RI_TDP(tdpbsud, 1, 3, 5);
    }
  };
  const auto store = [&](int64_t j) {
    RI_TILE_STORE(0, cb[0]);
    if (j + 1 < KB) RI_TILE_STORE(1, cb[1]);
  };
  tile_barrier();  // the weights and activations the tiles load are written
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (auto& a : acc) a = _mm512_setzero_ps();
  dots(0);
  store(0);
  for (int64_t j = 0; j < KB; j += 2) {
    __m512 dw[2], mw[2];
    block_scales<NIB, OFF>(w + j * bb, dw[0], mw[0]);
    if (j + 1 < KB) block_scales<NIB, OFF>(w + (j + 1) * bb, dw[1], mw[1]);
    if (j + 2 < KB) dots(j + 2);
    if (widen && j + kWidenAhead < KB) {
      widen_blocks<OFF>(widen, j + kWidenAhead, std::min(j + kWidenAhead + 2, KB), widened);
      tile_barrier();  // written before the tile loads of a later iteration
    }
    if (pf) prefetch_bytes(pf + j * bb, 2 * bb);
    scale16<OFF>(cb[0], dw[0], mw[0], dx, sx, xs, KB, j, acc);
    if (j + 1 < KB) scale16<OFF>(cb[1], dw[1], mw[1], dx, sx, xs, KB, j + 1, acc);
    if (j + 2 < KB) store(j + 2);
  }
  alignas(64) float out[kAmxRows * kQ8Panel];
#pragma GCC unroll 16
  for (int m = 0; m < kAmxRows; ++m) _mm512_store_ps(out + m * kQ8Panel, acc[m]);
  store_tile(out, kAmxRows, n0, std::min<int64_t>(kQ8Panel, N - n0), bias, y, N);
}

// Rows [0, 16 * tiles) of a chunk (xt: their activations, tile_order) x panel p (see
// gemm_q4_act8) on the tiles; nibble panels widened once into this thread's buffer for
// all of them.
template <bool OFF>
void panel_amx(bool nib, int64_t tiles, const int8_t* xt, const float* dx, const float* sx,
               const int32_t* xs, int64_t K, const uint8_t* panel, int64_t n0,
               const float* bias, float* y, int64_t N) {
  const int64_t KB = K / kQ8Block;
  const uint8_t* wt = panel;
  int64_t wts = block_bytes(false, !OFF);
  uint8_t* widened = nullptr;
  if (nib) {  // widened by the first tile's loop, read by the others
    thread_local std::vector<uint8_t> buf;
    if (static_cast<int64_t>(buf.size()) < KB * 512) buf.resize(KB * 512);
    widened = buf.data();
    wt = widened, wts = 512;
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m = t * kAmxRows;
    const int32_t* xsm = OFF ? xs + m * KB : nullptr;
    const auto run = nib ? tile_amx<true, OFF> : tile_amx<false, OFF>;
    run(xt + t * KB * kTileBlock, dx + m * KB, sx + m * KB, xsm, K, panel, wt, wts, n0, bias,
        y + m * N, N, t == 0 ? panel + KB * block_bytes(nib, !OFF) : nullptr,  // the next panel
        nib && t == 0 ? panel : nullptr, widened);
  }
}
#endif  // ROSEINFER_AMX

}  // namespace act8
}  // namespace roseinfer
