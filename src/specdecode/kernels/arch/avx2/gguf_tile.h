// The GGUF tile (gguf_shared.h) on AVX2: the 8-lane tile with vpmaddubsw runs (no VNNI).
#pragma once

#include "gguf_tile8.h"

namespace specdecode {
namespace {

// Per code width: HALVES, the halves of the tile (8 rows each) a pass over the codes computes at
// once, and GGUF_TOKENS, the most tokens a tile computes at once. 4-bit codes decode in one or
// two instructions: both halves at once (HALVES = 2, so each activation broadcast serves 16 rows),
// 5 tokens (their int16 run sums in 10 of the 16 registers). Wider codes cost more to decode
// (the 5- and 6-bit fields: 8 instructions a vector), so one half at a time over up to 10
// tokens: only their int16 run sums stay in registers (the rarer int32 and fp32 sums spill),
// and a 9-token verification pass decodes each vector of codes once. Measured against one half
// at a time for every width (benchmarks/gguf_ab.py, AMD EPYC Zen 4, one thread, 2026-11-28):
// Q4_0 1.13-1.18x at 4-16 tokens and 1.20x at 1, Q4_K 1.00-1.05x and 1.21x; both halves for
// Q6_K measured 0.85-0.92x at 8-16 tokens (separate runs), so it keeps one.
template <int BITS>
constexpr int HALVES = BITS == 4 ? 2 : 1;
template <int BITS>
constexpr int GGUF_TOKENS = BITS == 4 ? 5 : 10;

template <int BITS, int S, int SUBS, int OFF, int MINS, int T>
void gguf_tile(const uint8_t* blk, int64_t nsb, const GgufActs& a, const uint8_t* next,
               float acc[T][LANES]) {
  gguf_tile8<false, HALVES<BITS>, BITS, S, SUBS, OFF, MINS, T>(blk, nsb, a, next, acc);
}

}  // namespace
}  // namespace specdecode
