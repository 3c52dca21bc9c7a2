// The int8 peak chains on AVX-512 VNNI: vpdpbusd on 512 bits.
#pragma once

#include "../../peak_shared.h"

#include <immintrin.h>

namespace specdecode {
namespace {

// PRODUCTS, chains (peak_shared.h).
constexpr int64_t PRODUCTS = 64;  // per vpdpbusd on 512 bits: 16 lanes x 4 bytes

int64_t chains(int64_t iterations, int32_t seed) {
  const __m512i a = _mm512_set1_epi32(seed), b = _mm512_set1_epi32(seed + 1);
  __m512i acc[CHAINS];
  UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_epi32(c);
  for (int64_t i = 0; i < iterations; ++i)
    UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  __m512i total = acc[0];
  UNROLL for (int c = 1; c < CHAINS; ++c) total = _mm512_add_epi32(total, acc[c]);
  return _mm512_reduce_add_epi32(total);
}

}  // namespace
}  // namespace specdecode
