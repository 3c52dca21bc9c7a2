// The GGUF tile (gguf_shared.h) on AVX2: the 8-lane tile with vpmaddubsw runs (no VNNI).
#pragma once

#include "gguf_tile8.h"

namespace specdecode {
namespace {

// tokens per tile, at most: 10. Only the int16 run sums need to stay in registers (the
// rarer int32 and fp32 sums spill), and a 9-token verification pass is then one group, not 3
// (each group decodes the tile's codes again, and after the first group its compute no longer
// overlaps the weights' stream from memory).
constexpr int GGUF_TOKENS = 10;

template <int BITS, int S, int SUBS, int OFF, int MINS, int T>
void gguf_tile(const uint8_t* blk, int64_t nsb, const GgufActs& a, const uint8_t* next,
               float acc[T][LANES]) {
  gguf_tile8<false, BITS, S, SUBS, OFF, MINS, T>(blk, nsb, a, next, acc);
}

}  // namespace
}  // namespace specdecode
