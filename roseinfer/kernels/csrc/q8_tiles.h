// Small helpers shared by the int8-weight GEMMs (q8_gemm.cpp, q4_act8.cpp): fp16 scale
// reads, storing a register tile's accumulators, and balanced row tiles.
#pragma once

#include <cstring>

#include "q8_gemm.h"

namespace roseinfer {

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// y rows [0, mr) x columns [n0, n0 + nc) from the accumulators: y = acc + b (or acc).
inline void store_tile(const float* acc, int64_t mr, int64_t n0, int64_t nc, const float* bias,
                       float* y, int64_t N) {
  for (int64_t m = 0; m < mr; ++m) {
    float* yr = y + m * N + n0;
    const float* ar = acc + m * kQ8Panel;
    for (int64_t c = 0; c < nc; ++c) yr[c] = bias ? ar[c] + bias[n0 + c] : ar[c];
  }
}

// Row tiles of at most mr_max rows over [m0, m1), sizes balanced (16 rows -> 4 x 4).
template <typename F>
inline void for_row_tiles(int64_t m0, int64_t m1, int64_t mr_max, F&& f) {
  const int64_t n = m1 - m0;
  if (n <= 0) return;
  const int64_t tiles = (n + mr_max - 1) / mr_max, base = n / tiles, extra = n % tiles;
  for (int64_t t = 0, m = m0; t < tiles; ++t) {
    const int64_t mr = base + (t < extra ? 1 : 0);
    f(m, mr);
    m += mr;
  }
}

}  // namespace roseinfer
