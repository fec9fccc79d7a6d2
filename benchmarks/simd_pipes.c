// Throughput of the instructions the GEMM loops are made of, one core, 512-bit registers:
// vpdpwssd (int16 pairs: the int16-activation loops, 32 multiply-adds), vpdpbusd (u8 x s8
// quads: act8's, 64), vfmadd231ps (fp32: the block scaling, 16), each in 8 independent
// chains, and 8 vpdpwssd + 4 vfmadd231ps an iteration: whether the FMAs issue beside the
// dot products (the mix then costs about max(8, 4) instructions' time) or on the same
// pipes (about 8 + 4).  ns an instruction; the core clock is 1 / that where it is 1 a cycle.
// docs/performance.md, "Zen 4: where the rest of #25 goes".
//
//   gcc -O2 -mavx512f -mavx512bw -mavx512vnni benchmarks/simd_pipes.c -o /tmp/simd_pipes
//   /tmp/simd_pipes
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ITERS 25000000L  // iterations of 8 (or 8 + 4) instructions

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Eight named registers per kind (an array would live in memory at -O2); the asm barrier
// keeps each chain's value live (no folding) without a memory round trip.
#define EACH8(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define KEEP8(p) __asm__ volatile("" : "+v"(p##0), "+v"(p##1), "+v"(p##2), "+v"(p##3), \
                                  "+v"(p##4), "+v"(p##5), "+v"(p##6), "+v"(p##7))
#define KEEP4(p) __asm__ volatile("" : "+v"(p##0), "+v"(p##1), "+v"(p##2), "+v"(p##3))
#define WSSD(i) a##i = _mm512_dpwssd_epi32(a##i, b, c);
#define BUSD(i) a##i = _mm512_dpbusd_epi32(a##i, b, c);
#define FMA(i) f##i = _mm512_fmadd_ps(f##i, x, y);

int main(void) {
  const __m512i b = _mm512_set1_epi16(3), c = _mm512_set1_epi16(5);
  const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.999999f);
  __m512i a0, a1, a2, a3, a4, a5, a6, a7;
  __m512 f0, f1, f2, f3, f4, f5, f6, f7;
  a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _mm512_set1_epi32(1);
  f0 = f1 = f2 = f3 = f4 = f5 = f6 = f7 = _mm512_set1_ps(1.f);

  double t0 = now();
  for (long n = 0; n < ITERS; ++n) {
    EACH8(WSSD)
    KEEP8(a);
  }
  const double wssd = (now() - t0) / (8.0 * ITERS);

  t0 = now();
  for (long n = 0; n < ITERS; ++n) {
    EACH8(BUSD)
    KEEP8(a);
  }
  const double busd = (now() - t0) / (8.0 * ITERS);

  t0 = now();
  for (long n = 0; n < ITERS; ++n) {
    EACH8(FMA)
    KEEP8(f);
  }
  const double fma = (now() - t0) / (8.0 * ITERS);

  t0 = now();
  for (long n = 0; n < ITERS; ++n) {
    EACH8(WSSD)
    FMA(0) FMA(1) FMA(2) FMA(3)
    KEEP8(a);
    KEEP4(f);
  }
  const double mix = (now() - t0) / ITERS;

  const __m512i s = _mm512_add_epi32(_mm512_add_epi32(a0, a7), _mm512_add_epi32(a3, a4));
  const __m512 g = _mm512_add_ps(_mm512_add_ps(f0, f7), _mm512_add_ps(f3, f4));
  printf("ns an instruction: vpdpwssd %.3f, vpdpbusd %.3f, vfmadd231ps %.3f\n", wssd * 1e9,
         busd * 1e9, fma * 1e9);
  printf("8 vpdpwssd + 4 vfmadd231ps: %.3f ns an iteration (%.2f vpdpwssd times: 8 if the "
         "FMAs issue beside, 12 if on the same pipes)\n", mix * 1e9, mix / wssd);
  printf("(checksums %d %g)\n", _mm512_reduce_add_epi32(s) & 1, (double)_mm512_reduce_add_ps(g));
  return 0;
}
