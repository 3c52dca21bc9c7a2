// The int8 and bf16 matmuls' micro-kernels on AVX-VNNI: the 8-lane ones, vpdpbusd.
#pragma once

#include "../avx2/matmul_dot8.h"

namespace specdecode {
namespace {

// CODE_ZERO, INT8_DOT, BF16_DOT (matmul_shared.h): sums the codes as they are
constexpr int32_t CODE_ZERO = 128;
constexpr const char* INT8_DOT = "avx-vnni";
constexpr const char* BF16_DOT = "avx2";

template <int T>
void dot_u8s8(const uint8_t* a, int64_t lda, const int8_t* b, int64_t Kp,
              int32_t acc[GROUPS][T][LANES]) {
  dot_u8s8_8<true, T>(a, lda, b, Kp, acc);
}

template <int T>
void dot_bf16(const BFloat16* a, int64_t lda, const BFloat16* b, int64_t Kp,
              float acc[GROUPS][T][LANES]) {
  dot_bf16_8<T>(a, lda, b, Kp, acc);
}

}  // namespace
}  // namespace specdecode
