// Memory for packed weights: transparent huge pages where the OS offers them.
//
// A decode step streams every weight from DRAM once.  On 4 KiB pages that is a TLB miss
// per page and a hardware prefetcher that stops at every page boundary: 1-row GEMVs of a
// 1B model read ~18 GB/s of a 25 GB/s machine.  On 2 MiB pages they read ~23-26 GB/s
// (benchmarks/gemv_bandwidth.py).  Placement only: the bytes and every result are the same.
#pragma once

#include <ATen/ATen.h>

namespace roseinfer {

// Zeroed tensor of `sizes` x `dtype` for packed weights (never resized).  On Linux: placed
// after the previous one (page-aligned) in a 2 MiB-aligned anonymous chunk of 64 MiB or
// more, advised MADV_HUGEPAGE as a whole, so the small tensors of a small model and the
// tails of large ones are on huge pages too, at no more memory than their bytes (a
// chunk's untouched rest takes none); a chunk is unmapped when its last tensor is freed.
// Elsewhere, when the mapping fails, or built with -DROSEINFER_NO_HUGE_PAGES (A/B runs):
// at::zeros.
at::Tensor weight_zeros(at::IntArrayRef sizes, at::ScalarType dtype);

}  // namespace roseinfer
