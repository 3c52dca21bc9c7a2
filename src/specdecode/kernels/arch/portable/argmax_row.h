// argmax_row (argmax_shared.h): the scalar scans.
#pragma once

#include "../../argmax_shared.h"

namespace specdecode {
namespace {

template <typename T>
int64_t argmax_row(const T* x, int64_t N) {
  return argmax_scalar(x, N);
}

}  // namespace
}  // namespace specdecode
