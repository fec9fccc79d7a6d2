// weight_zeros (weight_memory.h): anonymous mappings advised for transparent huge pages.
#include "weight_memory.h"

#include <c10/util/accumulate.h>

#include <cstdint>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace roseinfer {

at::Tensor weight_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
#if defined(__linux__) && defined(MADV_HUGEPAGE) && !defined(ROSEINFER_NO_HUGE_PAGES)
  constexpr size_t kHuge = size_t(2) << 20, kPage = 4096;
  const size_t bytes =
      static_cast<size_t>(c10::multiply_integers(sizes)) * at::elementSize(dtype);
  if (bytes >= kHuge) {
    const size_t len = (bytes + kPage - 1) / kPage * kPage;
    void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (raw != MAP_FAILED) {
      // Keep a 2 MiB-aligned window of len bytes; give the rest back.
      const auto base = reinterpret_cast<uintptr_t>(raw);
      const uintptr_t start = (base + kHuge - 1) / kHuge * kHuge;
      if (start > base) munmap(raw, start - base);
      const uintptr_t end = base + len + kHuge;
      if (end > start + len) munmap(reinterpret_cast<void*>(start + len), end - (start + len));
      void* p = reinterpret_cast<void*>(start);
      madvise(p, bytes / kHuge * kHuge, MADV_HUGEPAGE);  // advice: ignored where THP is off
      return at::from_blob(p, sizes, [len](void* q) { munmap(q, len); }, options);
    }
  }
#endif
  return at::zeros(sizes, options);
}

}  // namespace roseinfer
