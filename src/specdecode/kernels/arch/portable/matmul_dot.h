// The int8 and bf16 matmuls' micro-kernels in plain C++, one product at a time in the vector
// paths' order (the same bits).
#pragma once

#include "../../matmul_shared.h"

#include <cstring>

namespace specdecode {
namespace {

// CODE_ZERO, INT8_DOT, BF16_DOT (matmul_shared.h): sums the codes as they are
constexpr int32_t CODE_ZERO = 128;
constexpr const char* INT8_DOT = "portable";
constexpr const char* BF16_DOT = "portable";

// dot_u8s8 (matmul_shared.h).
template <int T>
void dot_u8s8(const uint8_t* a, int64_t lda, const int8_t* b, int64_t Kp,
              int32_t acc[GROUPS][T][LANES]) {
  std::memset(acc, 0, sizeof(int32_t) * GROUPS * T * LANES);
  for (int64_t k = 0; k < Kp; k += I8_PACK, b += ROWS * I8_PACK)
    for (int g = 0; g < GROUPS; ++g)
      for (int t = 0; t < T; ++t)
        for (int64_t l = 0; l < LANES; ++l)
          for (int64_t p = 0; p < I8_PACK; ++p)
            acc[g][t][l] += int32_t(a[t * lda + k + p]) *
                            int32_t(b[(g * LANES + l) * I8_PACK + p]);
}

// dot_bf16 (matmul_shared.h).
template <int T>
void dot_bf16(const BFloat16* a, int64_t lda, const BFloat16* b, int64_t Kp,
              float acc[GROUPS][T][LANES]) {
  std::memset(acc, 0, sizeof(float) * GROUPS * T * LANES);
  for (int64_t k = 0; k < Kp; k += BF16_PACK, b += ROWS * BF16_PACK)
    for (int g = 0; g < GROUPS; ++g)
      for (int t = 0; t < T; ++t)
        for (int64_t l = 0; l < LANES; ++l)
          for (int64_t p = BF16_PACK - 1; p >= 0; --p)
            acc[g][t][l] += float(a[t * lda + k + p]) *
                            float(b[(g * LANES + l) * BF16_PACK + p]);
}

}  // namespace
}  // namespace specdecode
