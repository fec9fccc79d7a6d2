// Does a core overlap streaming the next data into L2 with computing on data already in
// L2?  The int8 KV attention kernel's question (docs/kv-cache.md, "Where the rest goes"),
// without the kernel: each of 2 threads walks 400 MB in regions of one sequence's int8
// K/V (418 KB), reading each region's 204-byte rows three times (the three KV heads'
// items: one 16-byte load and FMAS fp32 FMAs a row) while `prefetcht1` fetches the next
// region, QUOTA lines every 16 rows (attention_parts.h's SequencePrefetch).  Three runs:
//   compute  the same two regions again and again (the rows in L2, the prefetches hit L2)
//   stream   the prefetches alone
//   both     compute on region i while region i + 1 streams in
// Overlap would make `both` about max(compute, stream); adding up, compute + stream.
//
//   g++ -O2 -march=native -fopenmp benchmarks/prefetch_overlap.cpp -o /tmp/prefetch_overlap
//   /tmp/prefetch_overlap [FMAS=4] [QUOTA=18]
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr size_t kPerThread = 400ull << 20, kRegion = 418 << 10, kRow = 204;

enum Mode { kCompute, kStream, kBoth };

double run(Mode mode, char* const (&buf)[2], int fmas, int quota) {
  const size_t regions = kPerThread / kRegion - 1, rows = kRegion / kRow, lines = kRegion / 64;
  const auto t0 = std::chrono::steady_clock::now();
  float sink = 0;
#pragma omp parallel num_threads(2) reduction(+ : sink)
  {
    const char* base = buf[omp_get_thread_num()];
    __m512 acc[8];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (size_t g = 0; g < regions; ++g) {
      const char* cur = base + (mode == kCompute ? 0 : g * kRegion);
      const char* next = base + (mode == kCompute ? kRegion : (g + 1) * kRegion);
      size_t line = 0;
      for (int item = 0; item < 3; ++item)
        for (size_t r = 0; r < rows; ++r) {
          if (r % 16 == 0)
            for (int k = 0; k < quota && line < lines; ++k, ++line)
              _mm_prefetch(next + line * 64, _MM_HINT_T1);
          if (mode == kStream) continue;
          const __m128i* p = reinterpret_cast<const __m128i*>(cur + r * kRow + 68 * item);
          const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
          for (int f = 0; f < fmas; ++f) acc[f & 7] = _mm512_fmadd_ps(v, v, acc[f & 7]);
        }
    }
    for (int i = 1; i < 8; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
    sink += _mm512_reduce_add_ps(acc[0]);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (sink == 1.2345f) std::puts("");  // keep the compute
  return s * 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  const int fmas = argc > 1 ? std::atoi(argv[1]) : 4, quota = argc > 2 ? std::atoi(argv[2]) : 18;
  char* buf[2];
  for (auto& b : buf) {  // huge pages, as the KV pool
    b = static_cast<char*>(mmap(nullptr, kPerThread, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    madvise(b, kPerThread, MADV_HUGEPAGE);
    std::memset(b, 1, kPerThread);
  }
  const char* names[] = {"compute", "stream", "both"};
  double best[3] = {1e30, 1e30, 1e30};
  for (int round = 0; round < 3; ++round)
    for (int m = 0; m < 3; ++m) best[m] = std::min(best[m], run(Mode(m), buf, fmas, quota));
  for (int m = 0; m < 3; ++m) std::printf("%-8s %7.1f ms (best of 3)\n", names[m], best[m]);
  std::printf("both / (compute + stream) = %.2f, both / max = %.2f\n",
              best[2] / (best[0] + best[1]), best[2] / std::max(best[0], best[1]));
}
