// What the matmul kernels share (matmul.cpp, gguf.cpp): the tile shape, the loop over tiles,
// 16-lane loads and stores that round as torch does, and the store of a tile's fp32 sums.
#pragma once

#include "core.h"
#include "isa.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace specdecode {
namespace {

constexpr int64_t LANES = 16;             // fp32 / int32 lanes per vector: rows per group
constexpr int64_t GROUPS = 4;             // row groups per tile
constexpr int64_t ROWS = GROUPS * LANES;  // output rows per tile (MATMUL_ROWS)
constexpr int64_t TOKENS = 4;             // tokens per tile, at most
constexpr int64_t TASK_BYTES = 1 << 16;   // weight bytes per parallel task, at least

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SPECDECODE_VECTOR_EPILOGUE 1
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const BFloat16* p, __mmask16 mask) {  // bf16 -> fp32: a 16-bit shift
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
// Rounds to bf16 as c10::BFloat16 does (nearest even; NaN -> 0x7FC0), denormals included.
inline void store16(BFloat16* p, __m512 v, __mmask16 mask) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i top = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(top));
}
inline __mmask16 first(int64_t count) {  // the first min(count, 16) lanes
  return count >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}
#endif

// y[t][n0 + l] = out_t(acc[t][l] (+ b[n0 + l])) for the rows n0 .. n0 + 15 (those < N) of T
// tokens; acc [T, LANES], y rows at stride ldy.
template <typename out_t>
void store_rows(const float* acc, int64_t T, int64_t n0, int64_t N, const float* b, out_t* y,
                int64_t ldy) {
  const int64_t count = std::min(LANES, N - n0);
#if defined(SPECDECODE_VECTOR_EPILOGUE)
  const __mmask16 mask = first(count);
  const __m512 bias = b == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, b + n0);
  for (int64_t t = 0; t < T; ++t) {
    __m512 v = _mm512_loadu_ps(acc + t * LANES);
    if (b != nullptr) v = _mm512_add_ps(v, bias);
    store16(y + t * ldy + n0, v, mask);
  }
#else
  for (int64_t t = 0; t < T; ++t)
    for (int64_t l = 0; l < count; ++l) {
      const float v = acc[t * LANES + l];
      y[t * ldy + n0 + l] = out_t(b != nullptr ? v + b[n0 + l] : v);
    }
#endif
}

// Calls tile(Int<T>, block, m0) for every block (of a weight's rows) and every group of T
// tokens starting at m0: the fewest groups of at most MAX tokens, of sizes that differ by at
// most one (9 tokens of MAX 8: 5 + 4, not 8 + 1); blocks are split across threads, at least
// TASK_BYTES of weights per task.
template <int MAX, class Tile>
void for_each_tile(int64_t blocks, int64_t M, int64_t block_bytes, const Tile& tile) {
  const int64_t grain = std::max<int64_t>(1, TASK_BYTES / block_bytes);
  const int64_t groups = (M + MAX - 1) / MAX;
  parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      for (int64_t g = 0, m0 = 0; g < groups; ++g) {
        const int64_t count = M / groups + (g < M % groups ? 1 : 0);
        with_count<MAX>(count, [&](auto tokens) { tile(tokens, block, m0); });
        m0 += count;
      }
  });
}

}  // namespace
}  // namespace specdecode
