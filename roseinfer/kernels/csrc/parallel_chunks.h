// Work shared by the threads as they finish instead of split in equal parts up front:
// a GEMM's panels in chunks taken from a shared counter, each a share of what is left
// (OpenMP's "guided" schedule: large chunks first, single panels at the end), so a
// thread the machine slows (another process or VM on its core) takes fewer and its
// partner does not wait for it at the barrier.  Which thread runs a chunk never changes
// a value: each panel's arithmetic is its own.  Steps of 1-4 rows keep equal contiguous
// ranges (at::parallel_for): those GEMVs are bound by memory, and one long run of panels
// a thread keeps its prefetch streams going (chunks measured ~3% slower there).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace roseinfer {

// f(b, e) over [0, n): as many threads as at::parallel_for would start for this grain,
// each taking chunks of max(1, remaining / (2 x threads)) until none is left.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (nt <= 1 || at::in_parallel_region()) return f(0, n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    int64_t b = next.load(std::memory_order_relaxed);
    while (b < n) {
      const int64_t e = std::min(n, b + std::max<int64_t>(1, (n - b) / (2 * nt)));
      if (!next.compare_exchange_weak(b, e, std::memory_order_relaxed)) continue;  // b reloaded
      f(b, e);
      b = next.load(std::memory_order_relaxed);
    }
  });
}

// The GEMMs' split of NP panels: chunks (above) for steps of more than `few` rows,
// else at::parallel_for's equal ranges.
template <typename F>
inline void parallel_panels(int64_t NP, int64_t grain, int64_t M, int64_t few, const F& f) {
  if (M > few) return parallel_chunks(NP, grain, f);
  at::parallel_for(0, NP, grain, f);
}

}  // namespace roseinfer
