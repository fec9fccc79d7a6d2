// The packed block layouts of q4_act8.h (bytes and nibbles), shared by its vector
// loops (q4_act8.cpp) and its AMX tiles (q4_act8_amx.h).
#pragma once

#include "q8_gemm.h"

namespace roseinfer {
namespace act8 {

constexpr int64_t kStepBytes = 64;                              // 16 columns x 4 k
constexpr int64_t kBytesScale = 8 * kStepBytes;                 // fp32 d, then fp32 m
constexpr int64_t kBytesBlock = kBytesScale + 8 * kQ8Panel;     // 640 (Q4_0: 576, no m)
constexpr int64_t kNibStep = 32;                                // 64 nibbles
constexpr int64_t kNibScale = 8 * kNibStep;                     // fp16 d, then fp16 m
constexpr int64_t kNibBlock = kNibScale + 4 * kQ8Panel;         // 320 (Q4_0: 288, no m)

// Bytes of one packed block: Q4_0 (offset 8) stores no minimums.
constexpr int64_t block_bytes(bool nib, bool mins) {
  return nib ? kNibBlock - (mins ? 0 : 2 * kQ8Panel) : kBytesBlock - (mins ? 0 : 4 * kQ8Panel);
}

}  // namespace act8
}  // namespace roseinfer
