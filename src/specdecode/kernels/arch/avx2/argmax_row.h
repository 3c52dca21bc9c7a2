// argmax_row (argmax_shared.h) on 8 lanes (AVX2; the AVX-512 and AVX-VNNI folders use it too).
#pragma once

#include "../../argmax_shared.h"

#include <immintrin.h>

#include <cstdint>

namespace specdecode {
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {  // bf16 -> fp32: a 16-bit shift
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// argmax_row's loop over 8 lanes: each lane keeps its largest value and that value's first
// index (a strict > never moves it to a later equal value), then the lanes' largest value
// and, among the lanes holding it, the lowest index. A NaN anywhere: the first NaN.
template <typename T>
int64_t argmax_row(const T* x, int64_t N) {
  if (N < 8 || N > INT32_MAX) return argmax_scalar(x, N);  // the lanes keep int32 indices
  __m256 top = load8(x);
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i index = at;
  __m256 nan = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
  const __m256i step = _mm256_set1_epi32(8);
  const int64_t whole = N / 8 * 8;
  for (int64_t i = 8; i < whole; i += 8) {
    const __m256 v = load8(x + i);
    index = _mm256_add_epi32(index, step);
    const __m256 more = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
    top = _mm256_blendv_ps(top, v, more);
    at = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(index), more));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan) != 0) return first_nan(x, N);
  alignas(32) float tops[8];
  alignas(32) int32_t ats[8];
  _mm256_store_ps(tops, top);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ats), at);
  float best_value = tops[0];
  int64_t best = ats[0];
  for (int l = 1; l < 8; ++l)
    if (tops[l] > best_value || (tops[l] == best_value && ats[l] < best))
      best_value = tops[l], best = ats[l];
  const int64_t tail_nan = first_nan(x + whole, N - whole);
  if (tail_nan >= 0) return whole + tail_nan;
  return first_max(x, N, whole, best);
}

}  // namespace
}  // namespace specdecode
