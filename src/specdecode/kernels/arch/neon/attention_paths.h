// The attention paths on ARM64 NEON (4 fp32 lanes): the vector parts, and the grouped heads
// (attention_grouped.h).
#pragma once

#include "../../attention_shared.h"

#include <arm_neon.h>

namespace specdecode {
namespace {

constexpr int64_t V4 = 4;  // fp32 lanes per NEON vector
inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}

// exp16's polynomial on 4 lanes; 2^n is built in the exponent bits (n >= -126 after the clamp).
inline float32x4_t exp4(float32x4_t x) {
  x = vmaxq_f32(x, vdupq_n_f32(-87.f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145752f));
  r = vfmsq_f32(r, n, vdupq_n_f32(1.42860677e-6f));
  float32x4_t p = vdupq_n_f32(1.f / 720);
  p = vfmaq_f32(vdupq_n_f32(1.f / 120), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 24), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 6), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(bits));
}

// dot_lanes, axpy_lanes, exp_lanes (attention_shared.h).
template <typename scalar_t>
inline int64_t dot_lanes(const float* q, const scalar_t* k, int64_t D, float& sum) {
  int64_t d = 0;
  float32x4_t acc = vdupq_n_f32(0.f);
  for (; d + V4 <= D; d += V4) acc = vfmaq_f32(acc, vld1q_f32(q + d), load4(k + d));
  sum = vaddvq_f32(acc);
  return d;
}

template <typename scalar_t>
inline int64_t axpy_lanes(float p, const scalar_t* v, float* out, int64_t D) {
  int64_t d = 0;
  const float32x4_t pv = vdupq_n_f32(p);
  for (; d + V4 <= D; d += V4) vst1q_f32(out + d, vfmaq_f32(vld1q_f32(out + d), pv, load4(v + d)));
  return d;
}

inline int64_t exp_lanes(float* scores, int64_t n, float top, float& total) {
  int64_t s = 0;
  const float32x4_t shift = vdupq_n_f32(top);
  float32x4_t acc = vdupq_n_f32(0.f);
  for (; s + V4 <= n; s += V4) {
    const float32x4_t e = exp4(vsubq_f32(vld1q_f32(scores + s), shift));
    vst1q_f32(scores + s, e);
    acc = vaddq_f32(acc, e);
  }
  total = vaddvq_f32(acc);
  return s;
}

// the vector operations attention_grouped.h runs on
using Vec = float32x4_t;
constexpr int64_t W = V4;  // lanes
constexpr int SCORE_SUMS = 20;  // of the 32 registers
constexpr int VALUE_SUMS = 20;
inline Vec vzero() { return vdupq_n_f32(0.f); }
inline Vec vset(float x) { return vdupq_n_f32(x); }
inline Vec vload(const float* p) { return load4(p); }
inline Vec vload(const BFloat16* p) { return load4(p); }
inline Vec vfma(Vec a, Vec b, Vec acc) { return vfmaq_f32(acc, a, b); }
inline float vsum(Vec v) { return vaddvq_f32(v); }
inline void vstore(float* p, Vec v) { vst1q_f32(p, v); }

}  // namespace
}  // namespace specdecode

#include "../../attention_grouped.h"
#include "../../attention_fast_absent.h"  // no one-query routine of its own
