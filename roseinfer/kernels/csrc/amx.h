// AMX (Intel Sapphire Rapids and later): the tile registers' configuration and the
// operating system's permission to use them, for the GEMMs' 16-row tiles (q4_act8.cpp,
// gguf_gemm.cpp).  A tile product (tdpb[su][su]d) adds the exact int32 sums of four
// byte products per lane, like vpdpbusd: the same integers as the vector loops, so a
// row's result is the same bits whichever path ran it.
// ROSEINFER_NO_AMX (a build flag) keeps the vector loops on an AMX machine (tests).
#pragma once

#include "common.h"

#if defined(ROSEINFER_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
    defined(__AVX512VBMI__) && !defined(ROSEINFER_NO_AMX)
#define ROSEINFER_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace roseinfer {

constexpr int64_t kAmxRows = 16;     // rows of a tile product
// Rows a step needs before its whole 16-row tiles run on the tiles: one tile, for act8
// (gate/up) and GGUF panels alike (docs/performance.md, "AMX from 16 rows" and
// "Tile-ordered activations": with the activations laid out a tile's block at a time,
// the tiles beat the vector loops from 16 rows at every K measured, 576 to 8192).
constexpr int64_t kAmxMinRows = 16;

#ifdef ROSEINFER_AMX
// Whether this process may use the tiles: Linux hands out the tile data state on
// request (arch_prctl ARCH_REQ_XCOMP_PERM, once per process); false where it refuses
// (an old kernel), and the vector loops run instead.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return ok;
}

// The tile registers' shapes (palette 1): rows x bytes per row of each register.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig& tile(int t, int r, int bytes) {
    rows[t] = static_cast<uint8_t>(r);
    colsb[t] = static_cast<uint16_t>(bytes);
    return *this;
  }
};

// Loads cfg on this thread for the scope's lifetime, then releases the tiles (other
// code, oneDNN's, configures its own).  An inline ldtilecfg: GCC 12's _tile_loadconfig
// declares an 8-byte read, so the stores of the struct's other fields may be dropped.
class TileScope {
 public:
  explicit TileScope(const TileConfig& cfg) { asm volatile("ldtilecfg %0" ::"m"(cfg)); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// A panel's bytes are read once per chunk, by the decode / widening in front of the
// tiles; at 16 rows they come from DRAM, and while the tiles run nothing would be read:
// so the first tile's loop prefetches the next panel, a block's share per block (at
// 16 rows from DRAM the act8 GEMM went from 0.85x the vector loops to 1.0x; prefetching
// in the decode as well measured the same; prefetch_bytes, common.h).

// Tile instructions on literal register numbers (GCC's intrinsics stringify them too).
// A tile load reads memory the compiler does not see: whoever writes what tiles read
// issues tile_barrier() before (a compiler barrier: it orders memory accesses and
// leaves registers alone, so the tile loops that decode as they go issue one a block).
// A tile store names its 16 x 16 int32 destination array as its output, so the loads
// of it after are ordered after it (RI_TILE_STORE_AT: rows `stride` bytes apart, not 64).
// RI_TDP(op, c, a, b): tile c += a . b (tdpbssd / tdpbsud / tdpbusd / tdpbuud: a's and
// b's bytes signed (s) or unsigned (u), four products per int32 lane).
#define RI_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::)
#define RI_TILE_LOAD(t, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<long>(stride)))
#define RI_TILE_STORE(t, arr) \
  asm volatile("tilestored %%tmm" #t ", (%1,%2,1)" : "=m"(arr) : "r"(arr), "r"(64L))
#define RI_TILE_STORE_AT(t, arr, stride) \
  asm volatile("tilestored %%tmm" #t ", (%1,%2,1)" : "=m"(arr) : "r"(arr), "r"(static_cast<long>(stride)))
#define RI_TDP(op, c, a, b) asm volatile(#op " %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
inline void tile_barrier() { asm volatile("" ::: "memory"); }
#endif  // ROSEINFER_AMX

}  // namespace roseinfer
