// Pieces shared by the paged-attention kernels of every cache type (attention.cpp:
// float / fp16; attention_q8.cpp: int8): the order work items run in, the block-table
// cursor, prefetching and, with AVX2, the 4-row score reduction and the softmax.
#pragma once

#include "common.h"

#include <cstdlib>
#ifdef ROSEINFER_AVX2
#include <cpuid.h>
#endif

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

// at::parallel_for over the items of `order` (item_order), each thread's range of about
// equal work rather than of equal count: an item costs its row's context length plus
// kItemCost positions (its fixed part).  A prefill chunk's rows grow in length, so equal
// counts left the thread holding the chunk's last rows working longest.  Ranges decide
// only which thread runs an item, never a value.
constexpr int64_t kItemCost = 16;
template <typename F>
inline void parallel_items(const std::vector<int64_t>& order, const int32_t* lens, int64_t Hkv,
                           const F& f) {
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  if (nt <= 1 || at::in_parallel_region()) {
    if (n > 0) f(0, n);
    return;
  }
  std::vector<int64_t> cum(n + 1, 0);  // strictly increasing: every item costs > 0
  for (int64_t i = 0; i < n; ++i) cum[i + 1] = cum[i] + lens[order[i] / Hkv] + kItemCost;
  auto bound = [&](int64_t t) {  // the first item of thread t's range
    return std::lower_bound(cum.begin(), cum.end(), cum[n] * t / nt) - cum.begin();
  };
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = bound(t), e = bound(t + 1);  // bound(nt) = n
      if (b < e) f(b, e);
    }
  });
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
// The next sequence's K and V blocks, fetched into L2 while the current one is computed.
// At large batch every sequence's cache comes from DRAM once per step; a block one ahead
// (prefetch_row) covers the latency, not the stream: a core then waits on memory, then
// computes.  start() at a sequence's first item names the next sequence's blocks (up to
// max_bytes of them, from its first: the lines a thread reads next); each step() issues
// the next share of their lines, spread evenly over the `steps` calls the current sequence
// makes (bunched, the prefetches stall on the core's fill buffers: measured slower).
// Only when data arrives changes, never a value.
class SequencePrefetch {
 public:
  void start(const void* kc, const void* vc, const int32_t* table, int64_t nblk,
             int64_t bstride, int64_t steps, int64_t max_bytes) {
    half_[0] = static_cast<const char*>(kc);
    half_[1] = static_cast<const char*>(vc);
    table_ = table;
    bstride_ = bstride;
    lines_ = (bstride + 63) / 64;
    nblk_ = std::max<int64_t>(1, std::min(nblk, max_bytes / (2 * bstride)));
    h_ = b_ = ln_ = 0;
    quota_ = std::max<int64_t>(1, (2 * nblk_ * lines_ + steps - 1) / std::max<int64_t>(1, steps));
  }
  void stop() { h_ = 2; }
  inline void step() {
    for (int64_t n = quota_; n > 0 && h_ < 2;) {  // a run of one block's lines at a time
      const char* p = half_[h_] + table_[b_] * bstride_ + ln_ * 64;
      const int64_t m = std::min(n, lines_ - ln_);
      for (int64_t k = 0; k < m; ++k) _mm_prefetch(p + 64 * k, _MM_HINT_T1);
      n -= m;
      ln_ += m;
      if (ln_ == lines_) {
        ln_ = 0;
        if (++b_ == nblk_) b_ = 0, ++h_;  // K's blocks, then V's
      }
    }
  }

 private:
  const char* half_[2] = {nullptr, nullptr};
  const int32_t* table_ = nullptr;
  int64_t bstride_ = 0, lines_ = 0, nblk_ = 0, quota_ = 0;
  int64_t h_ = 2, b_ = 0, ln_ = 0;  // the next line: half h_, block b_, line ln_
};

// Whether the float / fp16 kernel streams the next sequence into L2 as the int8 one does:
// on AMD CPUs (measured on Zen 4: the fp16 op 10-25% faster at batch 16-64,
// docs/kv-cache.md), not on Intel ones (Sapphire Rapids: slower at context 128).
// ROSEINFER_F16_SEQ_PREFETCH=1 / 0 overrides, for an A/B on another CPU.  Only when data
// arrives changes, never a value.
inline bool float_sequence_prefetch() {
  static const bool on = [] {
    const char* env = std::getenv("ROSEINFER_F16_SEQ_PREFETCH");
    if (env && (env[0] == '0' || env[0] == '1')) return env[0] == '1';
    unsigned a = 0, vendor[3] = {0, 0, 0};
    __get_cpuid(0, &a, &vendor[0], &vendor[2], &vendor[1]);  // ebx, edx, ecx: the name
    return std::memcmp(vendor, "AuthenticAMD", 12) == 0;
  }();
  return on;
}

// Whether, with one row (batch 1), a thread's first item prefetches the rows of every
// KV head it takes of the row (the slot-major cache puts one head's 128 bytes at a
// 384-byte stride, which DRAM serves at about half the rate of whole runs; the thread's
// next heads then read from cache).
// ROSEINFER_ATTN_WIDE_PF=0 turns it off, for an A/B.  Only when data arrives changes.
inline bool wide_prefetch_permitted() {
  static const bool on = [] {
    const char* env = std::getenv("ROSEINFER_ATTN_WIDE_PF");
    return !(env && env[0] == '0');
  }();
  return on;
}

// Called at each item i of a thread's range [b, e) of `order`: at a sequence's first item,
// aims `ahead` at the range's next sequence, its share spread over the step() calls of
// this sequence's items (steps_per_block per block of context each).  At most a quarter
// of L2 ahead: this sequence's rows stay.
inline void aim_at_next_sequence(SequencePrefetch& ahead, const std::vector<int64_t>& order,
                                 int64_t i, int64_t b, int64_t e, const int32_t* seq_of,
                                 const int32_t* lens, int64_t Hkv, const int32_t* bt,
                                 int64_t bt_stride, const void* kc, const void* vc, int64_t bs,
                                 int64_t bstride, int64_t steps_per_block, int64_t l2_bytes) {
  const int32_t seq = seq_of[order[i] / Hkv];
  if (i > b && seq_of[order[i - 1] / Hkv] == seq) return;  // not the sequence's first item
  int64_t j = i, steps = 0;
  for (; j < e && seq_of[order[j] / Hkv] == seq; ++j)
    steps += steps_per_block * ((lens[order[j] / Hkv] + bs - 1) / bs);
  if (j == e) return ahead.stop();
  const int64_t d = order[j] / Hkv, nblk = (lens[d] + bs - 1) / bs;
  ahead.start(kc, vc, bt + (int64_t)seq_of[d] * bt_stride, nblk, bstride, steps, l2_bytes / 4);
}

// One KV head's rows of a context (K or V) fetched kAhead positions before their use:
// the first kAhead from t0 at construction, then one more as each position t (>= t0) is
// used (step); none at or past L.  base: the head's first value in the cache half (half +
// kh * Dh); row: values between slots.
template <typename KV>
class RowsAhead {
 public:
  RowsAhead(const int32_t* table, int64_t bs, const KV* base, int64_t row, int64_t L,
            int64_t row_bytes, int64_t t0 = 0)
      : ahead_(table, bs, t0), base_(base), row_(row), L_(L), bytes_(row_bytes) {
    for (int64_t t = t0; t < std::min(t0 + kAhead, L); ++t, ahead_.next())
      prefetch_bytes(base_ + ahead_.slot() * row_, bytes_);
  }
  void step(int64_t t) {
    if (t + kAhead < L_) {
      prefetch_bytes(base_ + ahead_.slot() * row_, bytes_);
      ahead_.next();
    }
  }

 private:
  SlotCursor ahead_;
  const KV* base_;
  int64_t row_, L_, bytes_;
};

// One KV head's K rows of a context, 4 positions at a time (positions past the context
// given the zero row), prefetched as RowsAhead does (row_bytes from each row's start:
// more than the head's own bytes take the slot's next heads too).
template <typename KV>
class KeyWalk4 {
 public:
  KeyWalk4(const int32_t* table, int64_t bs, const KV* base, int64_t row, int64_t L,
           int64_t row_bytes)
      : c_(table, bs, 0), ahead_(table, bs, base, row, L, row_bytes), base_(base), row_(row) {}
  // The rows of positions t0 .. t0 + 3 (those below the context's end: n) into k.
  void next(int64_t t0, int64_t n, const KV* (&k)[4]) {
    for (int64_t j = 0; j < 4; ++j) {
      k[j] = j < n ? base_ + c_.slot() * row_ : reinterpret_cast<const KV*>(kZeroRow);
      if (j < n) c_.next();
      ahead_.step(t0 + j);
    }
  }

 private:
  SlotCursor c_;
  RowsAhead<KV> ahead_;
  const KV* base_;
  int64_t row_;
};

#ifdef ROSEINFER_AVX512
// exp8 on 16 lanes: the same operations lane by lane, so the same bits.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                    _mm512_set1_ps(-88.3762626647949f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}
#endif

// max over sg[0 .. L).  Exact: any order gives the same (scores with a NaN give NaN
// outputs in any order), so four independent chains instead of one.
static inline float row_max(const float* sg, int64_t L) {
  __m256 vm = _mm256_set1_ps(-INFINITY), vm1 = vm, vm2 = vm, vm3 = vm;
  int64_t t = 0;
  for (; t + 32 <= L; t += 32) {
    vm = _mm256_max_ps(vm, _mm256_loadu_ps(sg + t));
    vm1 = _mm256_max_ps(vm1, _mm256_loadu_ps(sg + t + 8));
    vm2 = _mm256_max_ps(vm2, _mm256_loadu_ps(sg + t + 16));
    vm3 = _mm256_max_ps(vm3, _mm256_loadu_ps(sg + t + 24));
  }
  vm = _mm256_max_ps(_mm256_max_ps(vm, vm1), _mm256_max_ps(vm2, vm3));
  for (; t + 8 <= L; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sg + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  float mx = -INFINITY;
  for (float v : lanes) mx = std::max(mx, v);
  for (; t < L; ++t) mx = std::max(mx, sg[t]);
  return mx;
}

// For N rows of one length (sg + i * ld): row[t] = exp(row[t] - max) over t < L, inv[i] =
// 1 / their sum (softmax without its last multiply).  With AVX-512 the exps run 16 at a
// time, each half added into the row's 8-lane sum in turn, the rows side by side (their
// sum chains interleaved); then 8 at a time and a scalar tail, row by row.  A row's
// operations and their order never depend on N: the same bits.
template <int N>
static inline void softmax_exps(float* sg, int64_t ld, int64_t L, float (&inv)[N]) {
  float mx[N];
  __m256 vsum[N];
  for (int i = 0; i < N; ++i) mx[i] = row_max(sg + i * ld, L), vsum[i] = _mm256_setzero_ps();
  int64_t t = 0;
#ifdef ROSEINFER_AVX512
  for (; t + 16 <= L; t += 16)
    for (int i = 0; i < N; ++i) {
      float* r = sg + i * ld;
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(r + t), _mm512_set1_ps(mx[i])));
      _mm512_storeu_ps(r + t, e);
      vsum[i] = _mm256_add_ps(vsum[i], _mm512_castps512_ps256(e));
      vsum[i] = _mm256_add_ps(vsum[i], _mm512_extractf32x8_ps(e, 1));
    }
#endif
  for (int i = 0; i < N; ++i) {
    float* r = sg + i * ld;
    int64_t u = t;
    for (; u + 8 <= L; u += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(r + u), _mm256_set1_ps(mx[i])));
      _mm256_storeu_ps(r + u, e);
      vsum[i] = _mm256_add_ps(vsum[i], e);
    }
    float sum = hsum8(vsum[i]);
    for (; u < L; ++u) {
      r[u] = std::exp(r[u] - mx[i]);
      sum += r[u];
    }
    inv[i] = 1.f / sum;
  }
}

// One row's softmax_exps: returns 1 / the sum (the caller applies it, possibly fused).
static inline float softmax_exp(float* sg, int64_t L) {
  float inv[1];
  softmax_exps<1>(sg, L, L, inv);
  return inv[0];
}

// softmax over N rows of one length (sg + i * ld): row[t] = exp(row[t] - max) / sum, as
// e_t * (1 / sum); softmax_exps' rows side by side.
template <int N>
static inline void softmax_rows(float* sg, int64_t ld, int64_t L) {
  float inv[N];
  softmax_exps<N>(sg, ld, L, inv);
  for (int i = 0; i < N; ++i) {
    float* r = sg + i * ld;
    const __m256 v = _mm256_set1_ps(inv[i]);
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) _mm256_storeu_ps(r + t, _mm256_mul_ps(_mm256_loadu_ps(r + t), v));
    for (; t < L; ++t) r[t] *= inv[i];
  }
}

static inline void softmax_row(float* sg, int64_t L) { softmax_rows<1>(sg, L, L); }

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
