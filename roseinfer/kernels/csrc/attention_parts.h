// Pieces shared by the paged-attention kernels of every cache type (attention.cpp:
// float / fp16; attention_q8.cpp: int8): the order work items run in, the block-table
// cursor, prefetching and, with AVX2, the 4-row score reduction and the softmax.
#pragma once

#include "common.h"

namespace roseinfer {

// Work items (row d, KV head kh) as d * Hkv + kh, in the order (run of consecutive rows of
// one sequence, KV head, row): the rows of a prefill chunk or of a speculative
// verification then read one head's K/V one after another, from cache after the first.
inline std::vector<int64_t> item_order(const int32_t* seq_of, int64_t D, int64_t Hkv) {
  std::vector<int64_t> order;
  order.reserve(D * Hkv);
  for (int64_t r0 = 0; r0 < D;) {
    int64_t r1 = r0 + 1;
    while (r1 < D && seq_of[r1] == seq_of[r0]) ++r1;
    for (int64_t kh = 0; kh < Hkv; ++kh)
      for (int64_t d = r0; d < r1; ++d) order.push_back(d * Hkv + kh);
    r0 = r1;
  }
  return order;
}

// Position t of a context -> its cache slot, walking the block table without divisions.
struct SlotCursor {
  const int32_t* table;
  int64_t bs, blk, off;
  SlotCursor(const int32_t* t, int64_t block_size, int64_t t0)
      : table(t), bs(block_size), blk(t0 / block_size), off(t0 % block_size) {}
  int64_t slot() const { return (int64_t)table[blk] * bs + off; }
  void next() {
    if (++off == bs) off = 0, ++blk;
  }
};

// Positions between a prefetched row and its use: a position costs only tens of cycles,
// so 32 positions keep enough reads in flight to cover the memory latency (8: the fp16
// attention op at batch 64 measured 12-20% slower, benchmarks/kv_int8.py).
constexpr int64_t kAhead = 32;
alignas(64) static const float kZeroRow[256] = {};  // a padding K row (zero bits: fp32, fp16 or int8 with scale 0)

#ifdef ROSEINFER_AVX2
// sg[t] = exp(sg[t] - max) / sum over t < L.
static inline void softmax_row(float* sg, int64_t L) {
  __m256 vm = _mm256_set1_ps(-INFINITY);  // the max is exact: any order gives the same
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sg + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  float mx = -INFINITY;
  for (float v : lanes) mx = std::max(mx, v);
  for (; t < L; ++t) mx = std::max(mx, sg[t]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  t = 0;
  for (; t + 8 <= L; t += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vmx));
    _mm256_storeu_ps(sg + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum8(vsum);
  for (; t < L; ++t) {
    sg[t] = std::exp(sg[t] - mx);
    sum += sg[t];
  }
  const __m256 inv = _mm256_set1_ps(1.f / sum);
  t = 0;
  for (; t + 8 <= L; t += 8) _mm256_storeu_ps(sg + t, _mm256_mul_ps(_mm256_loadu_ps(sg + t), inv));
  for (; t < L; ++t) sg[t] *= 1.f / sum;
}

template <typename KV>
static inline void prefetch_row(const KV* p, int64_t bytes) {
  prefetch_bytes(p, bytes);
}

// Lane j (< 4) of the result = the sum of the 8 lanes of a[j], as ((l0+l1)+(l2+l3)) +
// ((l4+l5)+(l6+l7)) for every j: a score never depends on its slot in a group of 4.
static inline __m128 reduce4(const __m256 (&a)[4]) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#endif  // ROSEINFER_AVX2

}  // namespace roseinfer
