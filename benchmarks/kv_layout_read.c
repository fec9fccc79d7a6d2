// The KV cache's read pattern from DRAM, by layout (docs/kv-cache.md, "Batch 1"): each of
// 3 KV heads' items walks one 4,096-position sequence (K only, 1.5 MB), reading its 128
// bytes of every 384-byte slot (the slot-major cache, [slots, Hkv, Dh], the default
// model's heads) or 128-byte rows one after another (a head-major layout), each
// sequence at a new place of a 1 GB pool, one thread; prints GB/s of bytes used.
//   gcc -O2 -mavx512f benchmarks/kv_layout_read.c -o /tmp/kv_layout_read && /tmp/kv_layout_read
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>
static double now(){struct timespec a; clock_gettime(CLOCK_MONOTONIC,&a); return a.tv_sec+a.tv_nsec/1e9;}
int main(){
  size_t pool = 1ull<<30; char* p = aligned_alloc(4096, pool); memset(p, 1, pool);
  const size_t slots = 4096, row = 384, seq = slots*row;  // one sequence's K: 1.5 MB
  __m512 acc = _mm512_setzero_ps();
  for (int mode = 0; mode < 2; ++mode) {
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      size_t base = 0; double t = now(); size_t useful = 0;
      while (base + seq <= pool) {
        const char* s = p + base;
        for (int head = 0; head < 3; ++head) {
          for (size_t i = 0; i < slots; ++i) {
            const char* r = mode == 0 ? s + i*row + head*128          // slot-major
                                      : s + head*(slots*128) + i*128; // head-major
            _mm_prefetch(r + 32*(mode==0?row:128), _MM_HINT_T0);
            acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float*)r));
            acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float*)(r+64)));
          }
          useful += slots*128;
        }
        base += seq;
      }
      double dt = now()-t; if (dt < best) best = dt;
      printf("%s: %.1f GB/s\n", mode==0 ? "slot-major 128B/384B" : "head-major contiguous", useful/dt/1e9);
    }
  }
  float o[16]; _mm512_storeu_ps(o, acc); return o[0] == 12345;
}
