// The int8 and bf16 matmuls' micro-kernels on ARM64 NEON: sdot on the signed values, bf16 widened
// and summed in fp32, 4 lanes at a time.
#pragma once

#include "../../matmul_shared.h"

#include <arm_neon.h>

#include <cstring>

namespace specdecode {
namespace {

// CODE_ZERO, INT8_DOT, BF16_DOT (matmul_shared.h): sums the signed values (codes - 128)
constexpr int32_t CODE_ZERO = 0;
constexpr const char* INT8_DOT = "neon-dotprod";
constexpr const char* BF16_DOT = "neon";

// dot_u8s8 (matmul_shared.h).
template <int T>
void dot_u8s8(const uint8_t* a, int64_t lda, const int8_t* b, int64_t Kp,
              int32_t acc[GROUPS][T][LANES]) {
  // sdot (s8 x s8, 4 products into each int32 lane) on the signed values (codes - 128), a row
  // group (four 4-lane quarters) at a time so that T tokens' sums stay in registers.
  for (int g = 0; g < GROUPS; ++g) {
    int32x4_t sum[4][T];
    UNROLL for (int r = 0; r < 4; ++r)
      UNROLL for (int t = 0; t < T; ++t) sum[r][t] = vdupq_n_s32(0);
    const int8_t* bg = b + g * LANES * I8_PACK;
    for (int64_t k = 0; k < Kp; k += I8_PACK, bg += ROWS * I8_PACK) {
      int8x16_t av[T];  // 4 signed values of token t, in every lane
      UNROLL for (int t = 0; t < T; ++t) {
        uint32_t four;
        std::memcpy(&four, a + t * lda + k, sizeof(four));
        av[t] = vreinterpretq_s8_u32(vdupq_n_u32(four ^ 0x80808080u));
      }
      UNROLL for (int r = 0; r < 4; ++r) {
        const int8x16_t bv = vld1q_s8(bg + r * 16);
        UNROLL for (int t = 0; t < T; ++t) sum[r][t] = vdotq_s32(sum[r][t], bv, av[t]);
      }
    }
    UNROLL for (int r = 0; r < 4; ++r)
      UNROLL for (int t = 0; t < T; ++t) vst1q_s32(acc[g][t] + r * 4, sum[r][t]);
  }
}

// dot_bf16 (matmul_shared.h).
template <int T>
void dot_bf16(const BFloat16* a, int64_t lda, const BFloat16* b, int64_t Kp,
              float acc[GROUPS][T][LANES]) {
  // The AVX2 path's steps on 4 lanes (a row group's four quarters at a time): the same bits.
  const uint32x4_t high = vdupq_n_u32(0xFFFF0000u);
  for (int g = 0; g < GROUPS; ++g) {
    float32x4_t sum[4][T];
    UNROLL for (int r = 0; r < 4; ++r)
      UNROLL for (int t = 0; t < T; ++t) sum[r][t] = vdupq_n_f32(0.f);
    const BFloat16* bg = b + g * LANES * BF16_PACK;
    for (int64_t k = 0; k < Kp; k += BF16_PACK, bg += ROWS * BF16_PACK) {
      float32x4_t even[T], odd[T];  // value k and k + 1 of token t, in every lane
      UNROLL for (int t = 0; t < T; ++t) {
        uint32_t two;
        std::memcpy(&two, a + t * lda + k, sizeof(two));
        const uint32x4_t pair = vdupq_n_u32(two);
        even[t] = vreinterpretq_f32_u32(vshlq_n_u32(pair, 16));
        odd[t] = vreinterpretq_f32_u32(vandq_u32(pair, high));
      }
      UNROLL for (int r = 0; r < 4; ++r) {
        const uint32x4_t bv = vld1q_u32(reinterpret_cast<const uint32_t*>(bg + r * 8));
        const float32x4_t b_even = vreinterpretq_f32_u32(vshlq_n_u32(bv, 16));
        const float32x4_t b_odd = vreinterpretq_f32_u32(vandq_u32(bv, high));
        UNROLL for (int t = 0; t < T; ++t) {
          sum[r][t] = vaddq_f32(sum[r][t], vmulq_f32(odd[t], b_odd));
          sum[r][t] = vaddq_f32(sum[r][t], vmulq_f32(even[t], b_even));
        }
      }
    }
    UNROLL for (int r = 0; r < 4; ++r)
      UNROLL for (int t = 0; t < T; ++t) vst1q_f32(acc[g][t] + r * 4, sum[r][t]);
  }
}

}  // namespace
}  // namespace specdecode
