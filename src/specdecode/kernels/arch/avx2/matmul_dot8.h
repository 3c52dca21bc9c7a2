// The int8 and bf16 matmuls' micro-kernels on 8 lanes (AVX2, AVX-VNNI); the arch folders avx2
// and avxvnni each instantiate them.
#pragma once

#include "../../matmul_shared.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace specdecode {
namespace {

// The 256-bit paths (AVX2, AVX-VNNI) cannot hold a whole tile's sums in their 16 registers
// once a tile has 2 or more tokens, so they run GROUPS_AT_ONCE<T> of its row groups at a time
// (two 8-lane sum vectors per group and token, at most 8 in all). Were those groups to run
// over all of K before the next ones, each would read a part of every 256-byte k step, a
// strided stream that came from memory at about half the bandwidth of a sequential one
// (measured on AVX2: 7-9 against 14-18 GB/s at 1 token). So the groups take turns over chunks
// of CHUNK_STEPS k steps (a k step is ROWS x 4 bytes of either format: 16 KB, inside L1),
// their sums kept in acc between chunks, and the first groups' pass asks for each whole k step
// AHEAD_STEPS steps ahead (a prefetch past the block's end is harmless); a lane still sums its
// products in k order (the same bits).
template <int T>
constexpr int GROUPS_AT_ONCE = T == 1 ? GROUPS : T == 2 ? 2 : 1;
constexpr int64_t CHUNK_STEPS = 64;
constexpr int64_t AHEAD_STEPS = 8;

inline void prefetch_step(const void* step) {  // the k step AHEAD_STEPS on (ROWS * 4 bytes)
  const char* p = static_cast<const char*>(step) + AHEAD_STEPS * ROWS * 4;
  UNROLL for (int line = 0; line < 4; ++line) __builtin_prefetch(p + line * 64);
}
inline __m256i load8(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
inline void store8(int32_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

// dot_u8s8 (matmul_shared.h) on 8 lanes: with vpdpbusd (VNNI, the codes as they are) or
// without (the signed values).
template <bool VNNI, int T>
void dot_u8s8_8(const uint8_t* a, int64_t lda, const int8_t* b, int64_t Kp,
                int32_t acc[GROUPS][T][LANES]) {
  // With AVX-VNNI, the AVX-512 path's vpdpbusd on 8 lanes. Without it, vpmaddubsw multiplies u8 by
  // s8 but saturates its pair sums at int16, which the codes (up to 255) could reach; the
  // signed values (codes - 128, |q| <= 127) cannot: |w| times q with w's sign, pairs summed
  // (vpmaddubsw), then pairs of pairs (vpmaddwd by ones).
  // GROUPS_AT_ONCE<T> row groups at a time (two 8-lane halves each), so that their T tokens'
  // sums stay in registers, over chunks of CHUNK_STEPS k steps (see CHUNK_STEPS).
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // without AVX-VNNI
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  constexpr int G = GROUPS_AT_ONCE<T>;
  for (int64_t k0 = 0; k0 < Kp; k0 += CHUNK_STEPS * I8_PACK) {
    const int64_t k1 = std::min(Kp, k0 + CHUNK_STEPS * I8_PACK);
    for (int g0 = 0; g0 < GROUPS; g0 += G) {
      __m256i sum[G][2][T];
      UNROLL for (int g = 0; g < G; ++g)
        UNROLL for (int h = 0; h < 2; ++h)
          UNROLL for (int t = 0; t < T; ++t)
            sum[g][h][t] = k0 == 0 ? _mm256_setzero_si256() : load8(acc[g0 + g][t] + h * 8);
      const int8_t* bk = b + k0 * ROWS;
      for (int64_t k = k0; k < k1; k += I8_PACK, bk += ROWS * I8_PACK) {
        if (G < GROUPS && g0 == 0) prefetch_step(bk);
        __m256i av[T];  // 4 codes (AVX-VNNI) or signed values of token t, in every lane
        UNROLL for (int t = 0; t < T; ++t) {
          int32_t four;
          std::memcpy(&four, a + t * lda + k, sizeof(four));
          av[t] = _mm256_set1_epi32(four);
          if constexpr (!VNNI) av[t] = _mm256_xor_si256(av[t], flip);
        }
        UNROLL for (int g = 0; g < G; ++g)
          UNROLL for (int h = 0; h < 2; ++h) {
            const __m256i bv = load8(bk + (g0 + g) * LANES * I8_PACK + h * 32);
            if constexpr (VNNI) {
              UNROLL for (int t = 0; t < T; ++t)
                sum[g][h][t] = _mm256_dpbusd_avx_epi32(sum[g][h][t], av[t], bv);
            } else {
              const __m256i magnitude = _mm256_abs_epi8(bv);
              UNROLL for (int t = 0; t < T; ++t) {
                const __m256i pairs =
                    _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(av[t], bv));
                sum[g][h][t] = _mm256_add_epi32(sum[g][h][t], _mm256_madd_epi16(pairs, ones));
              }
            }
          }
      }
      UNROLL for (int g = 0; g < G; ++g)
        UNROLL for (int h = 0; h < 2; ++h)
          UNROLL for (int t = 0; t < T; ++t) store8(acc[g0 + g][t] + h * 8, sum[g][h][t]);
    }
  }
}

// dot_bf16 (matmul_shared.h) on 8 lanes.
template <int T>
void dot_bf16_8(const BFloat16* a, int64_t lda, const BFloat16* b, int64_t Kp,
                float acc[GROUPS][T][LANES]) {
  // The portable sums below, 8 lanes at a time: per pair, the odd value's product is added
  // first, each product rounded before its addition (so the same bits as the portable path).
  // GROUPS_AT_ONCE<T> row groups at a time over chunks of k steps, as in dot_u8s8.
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  constexpr int G = GROUPS_AT_ONCE<T>;
  for (int64_t k0 = 0; k0 < Kp; k0 += CHUNK_STEPS * BF16_PACK) {
    const int64_t k1 = std::min(Kp, k0 + CHUNK_STEPS * BF16_PACK);
    for (int g0 = 0; g0 < GROUPS; g0 += G) {
      __m256 sum[G][2][T];
      UNROLL for (int g = 0; g < G; ++g)
        UNROLL for (int h = 0; h < 2; ++h)
          UNROLL for (int t = 0; t < T; ++t)
            sum[g][h][t] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc[g0 + g][t] + h * 8);
      const BFloat16* bk = b + k0 * ROWS;
      for (int64_t k = k0; k < k1; k += BF16_PACK, bk += ROWS * BF16_PACK) {
        if (G < GROUPS && g0 == 0) prefetch_step(bk);
        __m256 even[T], odd[T];  // value k and k + 1 of token t, in every lane
        UNROLL for (int t = 0; t < T; ++t) {
          int32_t two;
          std::memcpy(&two, a + t * lda + k, sizeof(two));
          const __m256i pair = _mm256_set1_epi32(two);
          even[t] = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
          odd[t] = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
        }
        UNROLL for (int g = 0; g < G; ++g)
          UNROLL for (int h = 0; h < 2; ++h) {
            const __m256i bv = load8(bk + (g0 + g) * LANES * BF16_PACK + h * 16);
            const __m256 b_even = _mm256_castsi256_ps(_mm256_slli_epi32(bv, 16));
            const __m256 b_odd = _mm256_castsi256_ps(_mm256_and_si256(bv, high));
            UNROLL for (int t = 0; t < T; ++t) {
              sum[g][h][t] = _mm256_add_ps(sum[g][h][t], _mm256_mul_ps(odd[t], b_odd));
              sum[g][h][t] = _mm256_add_ps(sum[g][h][t], _mm256_mul_ps(even[t], b_even));
            }
          }
      }
      UNROLL for (int g = 0; g < G; ++g)
        UNROLL for (int h = 0; h < 2; ++h)
          UNROLL for (int t = 0; t < T; ++t) _mm256_storeu_ps(acc[g0 + g][t] + h * 8, sum[g][h][t]);
    }
  }
}

}  // namespace
}  // namespace specdecode
