// grouped_attention (attention_shared.h) for an arch folder without the grouped heads of
// attention_grouped.h: none, so each query runs alone.
#pragma once

#include "attention_shared.h"

namespace specdecode {
namespace {

template <typename T, class QueryOffsets>
bool grouped_attention(const T*, const T*, const T*, const AttentionShape&, float, float,
                       const QueryOffsets&, T*) {
  return false;
}

}  // namespace
}  // namespace specdecode
