// The int8 and bf16 matmuls' micro-kernels on AVX-512: vpdpbusd (VNNI) and vdpbf16ps (BF16)
// over a whole tile (4 row groups of 16 lanes) per token.
#pragma once

#include "../../matmul_shared.h"

#include <immintrin.h>

#include <cstring>

namespace specdecode {
namespace {

// CODE_ZERO, INT8_DOT, BF16_DOT (matmul_shared.h): sums the codes as they are
constexpr int32_t CODE_ZERO = 128;
constexpr const char* INT8_DOT = "avx512-vnni";
constexpr const char* BF16_DOT = "avx512-bf16";

// dot_u8s8 (matmul_shared.h).
template <int T>
void dot_u8s8(const uint8_t* a, int64_t lda, const int8_t* b, int64_t Kp,
              int32_t acc[GROUPS][T][LANES]) {
  __m512i sum[GROUPS][T];
  UNROLL for (int g = 0; g < GROUPS; ++g)
    UNROLL for (int t = 0; t < T; ++t) sum[g][t] = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += I8_PACK, b += ROWS * I8_PACK) {
    __m512i av[T];  // 4 codes of token t, repeated in every lane
    UNROLL for (int t = 0; t < T; ++t) {
      int32_t four;
      std::memcpy(&four, a + t * lda + k, sizeof(four));
      av[t] = _mm512_set1_epi32(four);
    }
    UNROLL for (int g = 0; g < GROUPS; ++g) {
      const __m512i bv = _mm512_loadu_si512(b + g * LANES * I8_PACK);
      UNROLL for (int t = 0; t < T; ++t) sum[g][t] = _mm512_dpbusd_epi32(sum[g][t], av[t], bv);
    }
  }
  UNROLL for (int g = 0; g < GROUPS; ++g)
    UNROLL for (int t = 0; t < T; ++t) _mm512_storeu_si512(acc[g][t], sum[g][t]);
}

// dot_bf16 (matmul_shared.h).
template <int T>
void dot_bf16(const BFloat16* a, int64_t lda, const BFloat16* b, int64_t Kp,
              float acc[GROUPS][T][LANES]) {
  __m512 sum[GROUPS][T];
  UNROLL for (int g = 0; g < GROUPS; ++g)
    UNROLL for (int t = 0; t < T; ++t) sum[g][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += BF16_PACK, b += ROWS * BF16_PACK) {
    __m512bh av[T];  // 2 values of token t, repeated in every lane
    UNROLL for (int t = 0; t < T; ++t) {
      int32_t two;
      std::memcpy(&two, a + t * lda + k, sizeof(two));
      av[t] = (__m512bh)_mm512_set1_epi32(two);
    }
    UNROLL for (int g = 0; g < GROUPS; ++g) {
      const __m512bh bv = (__m512bh)_mm512_loadu_si512(b + g * LANES * BF16_PACK);
      UNROLL for (int t = 0; t < T; ++t) sum[g][t] = _mm512_dpbf16_ps(sum[g][t], av[t], bv);
    }
  }
  UNROLL for (int g = 0; g < GROUPS; ++g)
    UNROLL for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc[g][t], sum[g][t]);
}

}  // namespace
}  // namespace specdecode
