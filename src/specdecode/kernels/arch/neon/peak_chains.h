// The int8 peak chains on ARM64 NEON: sdot.
#pragma once

#include "../../peak_shared.h"

#include <arm_neon.h>

namespace specdecode {
namespace {

// PRODUCTS, chains (peak_shared.h).
constexpr int64_t PRODUCTS = 16;  // per sdot: 4 lanes x 4 bytes

int64_t chains(int64_t iterations, int32_t seed) {
  const int8x16_t a = vreinterpretq_s8_s32(vdupq_n_s32(seed));
  const int8x16_t b = vreinterpretq_s8_s32(vdupq_n_s32(seed + 1));
  int32x4_t acc[CHAINS];
  UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = vdupq_n_s32(c);
  for (int64_t i = 0; i < iterations; ++i)
    UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = vdotq_s32(acc[c], a, b);
  int32x4_t total = acc[0];
  UNROLL for (int c = 1; c < CHAINS; ++c) total = vaddq_s32(total, acc[c]);
  return vaddvq_s32(total);
}

}  // namespace
}  // namespace specdecode
