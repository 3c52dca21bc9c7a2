// The attention paths in plain C++: no vector parts (attention_rows.h sums every value), no
// routine of its own.
#pragma once

#include "../../attention_shared.h"

#include <vector>

namespace specdecode {
namespace {

// dot_lanes, axpy_lanes, exp_lanes (attention_shared.h): no vectors, nothing summed.
template <typename scalar_t>
inline int64_t dot_lanes(const float*, const scalar_t*, int64_t, float&) {
  return 0;
}

template <typename scalar_t>
inline int64_t axpy_lanes(float, const scalar_t*, float*, int64_t) {
  return 0;
}

inline int64_t exp_lanes(float*, int64_t, float, float&) { return 0; }

// fast_attend (attention_shared.h): no routine of its own here.
template <typename scalar_t, typename Slots>
bool fast_attend(const scalar_t*, const scalar_t*, const scalar_t*, const Slots&, int64_t, float,
                 float, scalar_t*, std::vector<float>&) {
  return false;
}

// grouped_attention (attention_shared.h): none here.
template <typename T, class QueryOffsets>
bool grouped_attention(const T*, const T*, const T*, const AttentionShape&, float, float,
                       const QueryOffsets&, T*) {
  return false;
}

}  // namespace
}  // namespace specdecode

#include "../../attention_rows.h"
