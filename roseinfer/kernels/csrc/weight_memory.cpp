// weight_zeros (weight_memory.h): packed weights placed one after another in 2 MiB-aligned
// anonymous chunks advised for transparent huge pages.
#include "weight_memory.h"

#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace roseinfer {

#if defined(__linux__) && defined(MADV_HUGEPAGE) && !defined(ROSEINFER_NO_HUGE_PAGES)
namespace {

constexpr size_t kHuge = size_t(2) << 20;   // a transparent huge page
constexpr size_t kAlign = 4096;             // each tensor starts on its own page
constexpr size_t kChunk = size_t(64) << 20;  // the usual chunk: many layers' weights

// One mapping: tensors [base, base + used) placed in order; unmapped when the last of
// them is freed.  Bytes past `used` are never touched, so they take no memory.
struct Chunk {
  uint8_t* base;
  size_t len;
  size_t used = 0;
  int64_t live = 0;  // tensors in it not yet freed
};

// The chunk new tensors go into, process-wide like malloc's arenas (packing may run on
// any thread), and the mutex that guards it and every chunk's counts.
struct Arena {
  std::mutex mu;
  Chunk* current = nullptr;
};

Arena& arena() {
  static Arena* a = new Arena;  // never destroyed: tensors may be freed during exit
  return *a;
}

// A 2 MiB-aligned anonymous mapping of len bytes (a multiple of 2 MiB), all advised
// MADV_HUGEPAGE (ignored where THP is off); nullptr where mmap fails.
Chunk* map_chunk(size_t len) {
  void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto b = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (b + kHuge - 1) / kHuge * kHuge, end = b + len + kHuge;
  if (start > b) munmap(raw, start - b);
  if (end > start + len) munmap(reinterpret_cast<void*>(start + len), end - (start + len));
  madvise(reinterpret_cast<void*>(start), len, MADV_HUGEPAGE);
  return new Chunk{reinterpret_cast<uint8_t*>(start), len};
}

void release(Chunk* c) {
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  if (--c->live > 0) return;
  if (a.current == c) a.current = nullptr;
  munmap(c->base, c->len);
  delete c;
}

// Where `bytes` (a multiple of kAlign) go: the current chunk when they fit, otherwise a
// new chunk (at least kChunk), which becomes current when it has more room left.
// nullptr (chunk untouched) where mmap fails.
uint8_t* place(size_t bytes, Chunk*& owner) {
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  Chunk* c = a.current;
  if (c == nullptr || c->len - c->used < bytes) {
    c = map_chunk(std::max(kChunk, (bytes + kHuge - 1) / kHuge * kHuge));
    if (c == nullptr) return nullptr;
    const size_t room = a.current ? a.current->len - a.current->used : 0;
    if (c->len - bytes > room) a.current = c;
  }
  uint8_t* p = c->base + c->used;
  c->used += bytes;
  ++c->live;
  owner = c;
  return p;
}

}  // namespace
#endif

at::Tensor weight_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
#if defined(__linux__) && defined(MADV_HUGEPAGE) && !defined(ROSEINFER_NO_HUGE_PAGES)
  const size_t bytes =
      static_cast<size_t>(c10::multiply_integers(sizes)) * at::elementSize(dtype);
  Chunk* owner = nullptr;
  if (bytes > 0) {
    if (uint8_t* p = place((bytes + kAlign - 1) / kAlign * kAlign, owner))
      return at::from_blob(p, sizes, [owner](void*) { release(owner); }, options);
  }
#endif
  return at::zeros(sizes, options);
}

}  // namespace roseinfer
