// The GGUF tile (gguf_shared.h) on AVX2: the 8-lane tile with vpmaddubsw runs (no VNNI).
#pragma once

#include "gguf_tile8.h"

namespace specdecode {
namespace {

// Per code width and tokens: HALVES, the halves of the tile (8 rows each) a pass over the codes
// computes at once, and GGUF_TOKENS, the most tokens a tile computes at once. 4-bit codes: both
// halves at once (each activation broadcast serves 16 rows), 5 tokens (their int16 run sums in
// 10 of the 16 registers). Wider codes (5, 6 bits: a 4-bit decode plus a shift, a mask and an
// or; Q8_0: signed sums) run short int16 runs (Q6_K: two quads), whose int32 sums then take
// registers too: one half at a time over up to 10 tokens (a 9-token verification pass decodes
// each vector once), both halves for a token alone. Measured (benchmarks/gguf_ab.py, AMD EPYC
// Zen 4, one thread, 2026-11-28): both halves for Q4_0 1.13-1.18x at 4-16 tokens and 1.20x at
// 1, for Q4_K 1.00-1.05x and 1.21x, over one half; for Q6_K (its bit planes) 1.26x at 1 token
// but 0.89-0.93x at 4-16.
template <int BITS, int T>
constexpr int HALVES = BITS == 4 || (BITS < 8 && T == 1) ? 2 : 1;
template <int BITS>
constexpr int GGUF_TOKENS = BITS == 4 ? 5 : 10;

// The fewest tokens a tile computes for which it prefetches the next tile (gguf.cpp: `next`):
// every count. Without it for one token, whole 1-token passes of Qwen2.5-1.5B (gguf) were
// 1.007x as fast (median of 1,536 interleaved pairs; AMD EPYC Zen 4, 2 threads, 2026-11-29):
// no gain, unlike AVX-512's.
constexpr int PREFETCH_FROM_TOKENS = 1;

template <int BITS, int S, int SUBS, int OFF, int MINS, int T>
void gguf_tile(const uint8_t* blk, int64_t nsb, const GgufActs& a, const uint8_t* next,
               float acc[T][LANES]) {
  gguf_tile8<false, HALVES<BITS, T>, BITS, S, SUBS, OFF, MINS, T>(blk, nsb, a, next, acc);
}

}  // namespace
}  // namespace specdecode
