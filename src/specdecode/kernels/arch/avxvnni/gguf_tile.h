// The GGUF tile (gguf_shared.h) on AVX-VNNI: the 8-lane tile with vpdpbusd.
#pragma once

#include "../avx2/gguf_tile8.h"

namespace specdecode {
namespace {

// tokens per tile, at most: 4. With 16 vector registers more tokens' int32 sums do not fit.
template <int BITS>
constexpr int GGUF_TOKENS = 4;

// The fewest tokens a tile computes for which it prefetches the next tile (gguf.cpp: `next`):
// every count (not measured without it on an AVX-VNNI CPU).
constexpr int PREFETCH_FROM_TOKENS = 1;

template <int BITS, int S, int SUBS, int OFF, int MINS, int T>
void gguf_tile(const uint8_t* blk, int64_t nsb, const GgufActs& a, const uint8_t* next,
               float acc[T][LANES]) {
  gguf_tile8<true, 1, BITS, S, SUBS, OFF, MINS, T>(blk, nsb, a, next, acc);
}

}  // namespace
}  // namespace specdecode
