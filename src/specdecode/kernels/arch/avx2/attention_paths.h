// The attention paths on AVX2 (8 fp32 lanes): the vector parts, and the grouped heads
// (attention_grouped.h).
#pragma once

#include "../../attention_shared.h"

#include <immintrin.h>

namespace specdecode {
namespace {

constexpr int64_t V8 = 8;  // fp32 lanes per AVX2 vector
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float sum8(__m256 v) {  // the 8 lanes in a fixed order
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// exp16's polynomial on 8 lanes; 2^n is built in the exponent bits (n >= -126 after the clamp).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// dot_lanes, axpy_lanes, exp_lanes (attention_shared.h).
template <typename scalar_t>
inline int64_t dot_lanes(const float* q, const scalar_t* k, int64_t D, float& sum) {
  int64_t d = 0;
  __m256 acc = _mm256_setzero_ps();
  for (; d + V8 <= D; d += V8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  sum = sum8(acc);
  return d;
}

template <typename scalar_t>
inline int64_t axpy_lanes(float p, const scalar_t* v, float* out, int64_t D) {
  int64_t d = 0;
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + V8 <= D; d += V8)
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(out + d)));
  return d;
}

inline int64_t exp_lanes(float* scores, int64_t n, float top, float& total) {
  int64_t s = 0;
  const __m256 shift = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  for (; s + V8 <= n; s += V8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), shift));
    _mm256_storeu_ps(scores + s, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = sum8(acc);
  return s;
}

// the vector operations attention_grouped.h runs on
using Vec = __m256;
constexpr int64_t W = V8;  // lanes
constexpr int SCORE_SUMS = 9;  // score sums in registers (of 16: also the queries, a key)
constexpr int VALUE_SUMS = 9;  // output sums in registers (also the weights, a value)
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return load8(p); }
inline Vec vload(const BFloat16* p) { return load8(p); }
inline Vec vfma(Vec a, Vec b, Vec acc) { return _mm256_fmadd_ps(a, b, acc); }
inline float vsum(Vec v) { return sum8(v); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }

}  // namespace
}  // namespace specdecode

#include "../../attention_grouped.h"
#include "../../attention_fast_absent.h"  // no one-query routine of its own
