// What every instruction set's attention paths share (arch/<folder>/attention_paths.h; the
// arithmetic is attention.cpp's header): widening, the slots a query reads.
//
// Each arch folder's attention_paths.h defines, for its instruction sets:
//   dot_lanes(q, k, D, sum), axpy_lanes(p, v, out, D), exp_lanes(scores, n, top, total): the
//   vector part of dot, axpy and exp_shifted (attention_rows.h): each covers a prefix of its
//   span in whole vectors and returns its length (0 where there are no vectors), the rest is
//   summed one value at a time after it;
//   fast_attend(q, keys, values, slots, D, scale, cap, out, scores): one query by a routine of
//   its own for its dtype and D, returning false where it has none (attend_one then runs);
//   grouped_attention(q, k, v, shape, scale, cap, query_offsets, out): every query at once
//   with the query heads of a KV head together (attention_group_tasks.h's loop over the
//   folder's routine: attention_grouped.h's for AVX2 and NEON, AVX-512's own for bf16),
//   returning false where the folder has no such path or D or the dtype does not suit it. A
//   folder without one of these two paths includes attention_fast_absent.h or
//   attention_grouped_absent.h.
// Every path of a folder gives a query the same bits, whatever the pass.
#pragma once

#include "core.h"
#include "isa.h"

#include <cstdint>

namespace specdecode {
namespace {

inline float widen(float x) { return x; }
inline float widen(BFloat16 x) { return float(x); }

// The slots one query reads, in order, as element offsets into its KV head's blocks (the
// block table already applied: see `attention`).
struct Offsets {
  const int64_t* at;
  int64_t n;
  int64_t size() const { return n; }
  int64_t operator[](int64_t i) const { return at[i]; }
};

}  // namespace
}  // namespace specdecode
