// What every instruction set's argmax_row shares (arch/<folder>/argmax_row.h; pointwise.cpp
// runs it per row): the scalar scans.
//
// Each arch folder's argmax_row.h defines argmax_row(x, N): the first NaN's index of x [N], else
// the first largest value's (torch.argmax over one row).
#pragma once

#include "core.h"
#include "isa.h"

#include <cmath>
#include <cstdint>

namespace specdecode {
namespace {

inline float value(float x) { return x; }
inline float value(BFloat16 x) { return float(x); }

// The first index of a NaN in x [N], or -1.
template <typename T>
int64_t first_nan(const T* x, int64_t N) {
  for (int64_t i = 0; i < N; ++i)
    if (std::isnan(value(x[i]))) return i;
  return -1;
}

// The first index of the largest of x [from, N) given the largest of x [0, from) at `best`
// (none when best < 0); no NaN in x.
template <typename T>
int64_t first_max(const T* x, int64_t N, int64_t from, int64_t best) {
  float top = best < 0 ? 0.0f : value(x[best]);
  for (int64_t i = from; i < N; ++i)
    if (best < 0 || value(x[i]) > top) top = value(x[i]), best = i;
  return best;
}

// The first NaN's index, else the first largest value's: torch.argmax over one row.
template <typename T>
int64_t argmax_scalar(const T* x, int64_t N) {
  const int64_t nan = first_nan(x, N);
  return nan >= 0 ? nan : first_max(x, N, 0, -1);
}

}  // namespace
}  // namespace specdecode
