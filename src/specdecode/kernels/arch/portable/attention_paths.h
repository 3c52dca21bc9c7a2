// The attention paths in plain C++: no vector parts (attention_rows.h sums every value), no
// routine of its own.
#pragma once

#include "../../attention_shared.h"

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

}  // namespace
}  // namespace specdecode

#include "../../attention_rows.h"
#include "../../attention_fast_absent.h"
#include "../../attention_grouped_absent.h"
