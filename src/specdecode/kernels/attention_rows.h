// One query's attention one slot at a time, over an arch folder's vector parts (dot_lanes,
// axpy_lanes, exp_lanes: attention_shared.h): every folder's attention_paths.h includes it
// after defining them.
#pragma once

#include "attention_shared.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace specdecode {
namespace {

// q . k over D values in fp32 (q already fp32).
template <typename scalar_t>
float dot(const float* q, const scalar_t* k, int64_t D) {
  float sum = 0.f;
  int64_t d = dot_lanes(q, k, D, sum);
  for (; d < D; ++d) sum += q[d] * widen(k[d]);
  return sum;
}

// out[0:D] += p * v[0:D] (fp32 out).
template <typename scalar_t>
void axpy(float p, const scalar_t* v, float* out, int64_t D) {
  int64_t d = axpy_lanes(p, v, out, D);
  for (; d < D; ++d) out[d] += p * widen(v[d]);
}

// The largest of n >= 1 scores (NaN left out, as std::max(top, NaN) leaves top) as the integer
// max of keys that order the floats as their values (a negative value's magnitude bits
// flipped; NaN keys, past infinity's, masked out), in a loop the compiler vectorizes: a scalar
// max waits ~4 cycles a score on the one before. Exact, so its order changes no bit.
inline float largest(const float* scores, int64_t n) {
  typedef int32_t alias_i32 __attribute__((may_alias));
  const auto* bits = reinterpret_cast<const alias_i32*>(scores);
  constexpr int32_t INF = 0x7F800000, MAGNITUDE = 0x7FFFFFFF;
  int32_t top = -INF - 1;  // the key of -infinity
  for (int64_t s = 0; s < n; ++s) {
    const int32_t b = bits[s];
    const int32_t key = b ^ ((b >> 31) & MAGNITUDE);
    const bool nan = (b & MAGNITUDE) > INF;
    top = std::max(top, nan ? -INF - 1 : key);
  }
  const int32_t b = top ^ ((top >> 31) & MAGNITUDE);
  float value;
  std::memcpy(&value, &b, sizeof value);
  return value;
}

// scores[0:n] -> exp(scores - max), returns their sum; cap > 0 first soft-caps each score to
// cap * tanh(score / cap) (Gemma 2's attention; one scalar tanh per score, in every variant).
inline float exp_shifted(float* scores, int64_t n, float cap) {
  if (cap > 0.f)
    for (int64_t s = 0; s < n; ++s) scores[s] = cap * std::tanh(scores[s] / cap);
  const float top = largest(scores, n);
  float total = 0.f;
  int64_t s = exp_lanes(scores, n, top, total);
  for (; s < n; ++s) {
    scores[s] = std::exp(scores[s] - top);
    total += scores[s];
  }
  return total;
}

// One query q [D] over `slots`: scores, softmax and the weighted sum of the values in fp32,
// out rounded once to q's dtype; qf, scores, acc: the caller's buffers.
template <typename scalar_t, typename Slots>
void attend_one(const scalar_t* q, const scalar_t* k, const scalar_t* v, const Slots& slots,
                int64_t D, float scale, float cap, scalar_t* out,
                std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t span = slots.size();
  qf.resize(D);
  for (int64_t d = 0; d < D; ++d) qf[d] = widen(q[d]) * scale;
  scores.resize(span);
  for (int64_t s = 0; s < span; ++s) scores[s] = dot(qf.data(), k + slots[s], D);
  const float total = exp_shifted(scores.data(), span, cap);
  acc.assign(D, 0.f);
  for (int64_t s = 0; s < span; ++s) axpy(scores[s], v + slots[s], acc.data(), D);
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = scalar_t(acc[d] * inv);
}

}  // namespace
}  // namespace specdecode
