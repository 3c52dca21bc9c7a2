// The int8 peak chains in plain C++: one scalar multiply-add.
#pragma once

#include "../../peak_shared.h"

namespace specdecode {
namespace {

// PRODUCTS, chains (peak_shared.h).
constexpr int64_t PRODUCTS = 1;  // one scalar multiply-add

// Each chain multiplies its own low byte, so no product is known before the loop runs.
int64_t chains(int64_t iterations, int32_t seed) {
  int32_t acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = seed + c;
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < CHAINS; ++c) acc[c] += int32_t(int8_t(acc[c])) * int8_t(seed + 1);
  int64_t total = 0;
  for (int c = 0; c < CHAINS; ++c) total += acc[c];
  return total;
}

}  // namespace
}  // namespace specdecode
