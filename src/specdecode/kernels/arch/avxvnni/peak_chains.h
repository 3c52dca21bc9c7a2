// The int8 peak chains on AVX-VNNI: vpdpbusd on 256 bits.
#pragma once

#include "../../peak_shared.h"

#include <immintrin.h>

namespace specdecode {
namespace {

// PRODUCTS, chains (peak_shared.h).
constexpr int64_t PRODUCTS = 32;  // per vpdpbusd on 256 bits

int64_t chains(int64_t iterations, int32_t seed) {
  const __m256i a = _mm256_set1_epi32(seed), b = _mm256_set1_epi32(seed + 1);
  __m256i acc[CHAINS];
  UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_set1_epi32(c);
  for (int64_t i = 0; i < iterations; ++i)
    UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_dpbusd_avx_epi32(acc[c], a, b);
  __m256i total = acc[0];
  UNROLL for (int c = 1; c < CHAINS; ++c) total = _mm256_add_epi32(total, acc[c]);
  return _mm256_extract_epi32(total, 0) + _mm256_extract_epi32(total, 7);
}

}  // namespace
}  // namespace specdecode
