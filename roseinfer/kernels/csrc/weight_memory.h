// Memory for packed weights: transparent huge pages where the OS offers them.
//
// A decode step streams every weight from DRAM once.  On 4 KiB pages that is a TLB miss
// per page and a hardware prefetcher that stops at every page boundary: 1-row GEMVs of a
// 1B model read ~18 GB/s of a 25 GB/s machine.  On 2 MiB pages they read ~23-26 GB/s
// (benchmarks/gemv_bandwidth.py).  Placement only: the bytes and every result are the same.
#pragma once

#include <ATen/ATen.h>

namespace roseinfer {

// Zeroed tensor of `sizes` x `dtype` for packed weights (never resized).  From 2 MiB on,
// on Linux: its own 2 MiB-aligned anonymous mapping, the whole 2 MiB pages inside it
// advised MADV_HUGEPAGE (the tail stays on small pages, so RSS is the bytes, not more).
// Elsewhere, when the mapping fails, or built with -DROSEINFER_NO_HUGE_PAGES (A/B runs):
// at::zeros.
at::Tensor weight_zeros(at::IntArrayRef sizes, at::ScalarType dtype);

}  // namespace roseinfer
