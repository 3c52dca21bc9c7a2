// The int8 and bf16 matmuls' micro-kernels on AVX2: the 8-lane ones, vpmaddubsw + vpmaddwd.
#pragma once

#include "matmul_dot8.h"

namespace specdecode {
namespace {

// CODE_ZERO, INT8_DOT, BF16_DOT: matmul_shared.h. Sums the signed values (codes - 128):
// vpmaddubsw would saturate on the codes.
constexpr int32_t CODE_ZERO = 0;
constexpr const char* INT8_DOT = "avx2";
constexpr const char* BF16_DOT = "avx2";

template <int T>
void dot_u8s8(const uint8_t* a, int64_t lda, const int8_t* b, int64_t Kp,
              int32_t acc[GROUPS][T][LANES]) {
  dot_u8s8_8<false, T>(a, lda, b, Kp, acc);
}

template <int T>
void dot_bf16(const BFloat16* a, int64_t lda, const BFloat16* b, int64_t Kp,
              float acc[GROUPS][T][LANES]) {
  dot_bf16_8<T>(a, lda, b, Kp, acc);
}

}  // namespace
}  // namespace specdecode
