// Minimal stand-in for asmjit's headers, which torch's wheel does not ship but
// fbgemm/SimdUtils.h includes.  Only the register type names are referenced (as
// aliases, never instantiated) by the fbgemm headers cpu_kernels.cpp uses.
#pragma once
#define ASMJIT_LIBRARY_MAKE_VERSION(major, minor, patch) (((major) << 16) | ((minor) << 8) | (patch))
#define ASMJIT_LIBRARY_VERSION ASMJIT_LIBRARY_MAKE_VERSION(1, 0, 0)
namespace asmjit {
namespace x86 {
struct Xmm {};
struct Ymm {};
struct Zmm {};
}  // namespace x86
}  // namespace asmjit
