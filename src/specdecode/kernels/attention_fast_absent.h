// fast_attend (attention_shared.h) for an arch folder with no one-query routine of its own:
// none, so attend_one runs.
#pragma once

#include "attention_shared.h"

#include <cstdint>
#include <vector>

namespace specdecode {
namespace {

template <typename scalar_t, typename Slots>
bool fast_attend(const scalar_t*, const scalar_t*, const scalar_t*, const Slots&, int64_t, float,
                 float, scalar_t*, std::vector<float>&) {
  return false;
}

}  // namespace
}  // namespace specdecode
