// The matmuls' epilogues on AVX-512 (epilogue_shared.h says what each folder defines): 16 lanes
// at a time, masked at a row's end; the same values as the scalar ones.
#pragma once

#include "../../tiles.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace specdecode {
namespace {

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

// absmax_lanes, code_lanes (epilogue_shared.h).
template <typename scalar_t>
inline int64_t absmax_lanes(const scalar_t* x, int64_t K, float& absmax) {
  int64_t k = 0;
  __m512 top = _mm512_setzero_ps();
  for (; k < K; k += LANES) top = _mm512_max_ps(top, _mm512_abs_ps(load16(x + k, first(K - k))));
  absmax = _mm512_reduce_max_ps(top);
  return k;
}

template <typename scalar_t>
inline int64_t code_lanes(const scalar_t* x, int64_t K, float inv, uint8_t* codes) {
  int64_t k = 0;
  const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  for (; k < K; k += LANES) {
    const __mmask16 mask = first(K - k);
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(load16(x + k, mask), vinv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i code = _mm512_add_epi32(
        _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, q))), _mm512_set1_epi32(128));
    _mm_mask_storeu_epi8(codes + k, mask, _mm512_cvtepi32_epi8(code));
  }
  return k;
}

// y[t][n0 + l] = out_t(acc[t][l] (+ b[n0 + l])) for the rows n0 .. n0 + 15 (those < N) of T
// tokens; acc [T, LANES], y rows at stride ldy.
template <typename out_t>
void store_rows(const float* acc, int64_t T, int64_t n0, int64_t N, const float* b, out_t* y,
                int64_t ldy) {
  const int64_t count = std::min(LANES, N - n0);
  const __mmask16 mask = first(count);
  const __m512 bias = b == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, b + n0);
  for (int64_t t = 0; t < T; ++t) {
    __m512 v = _mm512_loadu_ps(acc + t * LANES);
    if (b != nullptr) v = _mm512_add_ps(v, bias);
    store16(y + t * ldy + n0, v, mask);
  }
}

// y[t][n] = out_t(float(acc[t][n] - CODE_ZERO * wsum[n]) * (x_scale[t] * ws[n]) (+ b[n])) for
// the 16 rows n0 .. n0 + 15 (those < N) of T tokens: acc [T, LANES] int32 at stride LANES,
// y [T, N].
template <int32_t CODE_ZERO, typename out_t>
void int8_epilogue(const int32_t* acc, int64_t T, int64_t n0, int64_t N, const int32_t* wsum,
                   const float* ws, const float* b, const float* x_scale, out_t* y) {
  const int64_t count = std::min(LANES, N - n0);
  const __mmask16 mask = first(count);
  const __m512i zero_point = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(mask, wsum + n0),
                                                _mm512_set1_epi32(CODE_ZERO));
  const __m512 w_scale = _mm512_maskz_loadu_ps(mask, ws + n0);
  const __m512 bias = b == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, b + n0);
  for (int64_t t = 0; t < T; ++t) {
    const __m512i dot = _mm512_sub_epi32(_mm512_loadu_si512(acc + t * LANES), zero_point);
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(dot),
                             _mm512_mul_ps(_mm512_set1_ps(x_scale[t]), w_scale));
    if (b != nullptr) v = _mm512_add_ps(v, bias);
    store16(y + t * N + n0, v, mask);
  }
}

}  // namespace
}  // namespace specdecode
