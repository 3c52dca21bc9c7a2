// The task loop of grouped attention (attention_shared.h's grouped_attention): the query heads
// that share a KV head attend together, through the arch folder's routine. The folder defines,
// before including this:
//   heads_at_once<T>(D): the most query heads its routine takes at once for dtype T and head
//   size D, 0 where it serves neither (then false is returned and each query runs alone);
//   attend_heads(nh, q, k, v, slots, D, scale, cap, out, qf, scores, acc): the attention of nh
//   (<= heads_at_once) query heads q[i] that share the KV head at k, v into out[i], each with
//   the bits it gets alone (nh = 1), as attention.cpp's header says; qf, scores, acc: the
//   caller's buffers.
#pragma once

#include "attention_shared.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace specdecode {
namespace {

// How many blocks to split each KV head's `group` query heads into, at least `fewest`: the
// fewest whose (unit, block) tasks spread over `threads` within 15% of even (the pool deals
// them out in equal runs), else the most even. E.g. SmolLM2's 3 KV heads of 3 heads, one token,
// 2 threads: 1 block gives 3 tasks (2 against 1), 2 blocks 6 (of 1 and 2 heads: 4 heads
// against 5): 2.
inline int64_t head_blocks(int64_t units, int64_t group, int64_t fewest, int64_t threads) {
  int64_t best = group;
  double best_spread = 1e30;
  for (int64_t blocks = std::min(fewest, group); blocks <= group; ++blocks) {
    const int64_t tasks = units * blocks;
    const double spread = double((tasks + threads - 1) / threads * threads) / double(tasks);
    if (spread <= 1.15) return blocks;
    if (spread < best_spread) best = blocks, best_spread = spread;
  }
  return best;
}

// grouped_attention (attention_shared.h): where the folder's heads_at_once is not 0.
template <typename T, class QueryOffsets>
bool grouped_attention(const T* q, const T* k, const T* v, const AttentionShape& shape,
                       float scale, float cap, const QueryOffsets& query_offsets, T* out) {
  const int64_t H = shape.H, Tq = shape.T, D = shape.D, group = shape.H / shape.Hkv;
  const int64_t most = heads_at_once<T>(D);
  if (most > 0) {
    // Tasks run (row, query, KV head, block of the KV head's query heads), blocks fastest: at
    // most `most` heads a block (head_blocks). A head's bits do not depend on its block.
    const int64_t units = shape.B * Tq * shape.Hkv;
    const int64_t blocks = head_blocks(units, group, (group + most - 1) / most, max_threads());
    parallel_for(0, units * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf, scores, acc;  // per thread, see attend_heads
      std::vector<int64_t> offsets;
      int64_t query = -1;  // the (row, token) whose offsets `offsets` holds
      std::vector<const T*> qs(most);  // a block's queries and outputs
      std::vector<T*> outs(most);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t unit = task / blocks, block = task % blocks;
        if (unit / shape.Hkv != query) {
          query = unit / shape.Hkv;
          query_offsets(query, offsets);
        }
        const int64_t b = query / Tq, t = query % Tq, kv = unit % shape.Hkv;
        const int64_t h0 = kv * group + block * group / blocks;
        const int64_t h1 = kv * group + (block + 1) * group / blocks;
        for (int64_t h = h0; h < h1; ++h) {
          const int64_t at = ((b * H + h) * Tq + t) * D;  // q and out are [B, H, T, D]
          qs[h - h0] = q + at;
          outs[h - h0] = out + at;
        }
        const int64_t head = kv * shape.head_stride;
        const Offsets slots{offsets.data(), int64_t(offsets.size())};
        attend_heads(h1 - h0, qs.data(), k + head, v + head, slots, D, scale, cap, outs.data(), qf,
                     scores, acc);
      }
    });
    return true;
  }
  return false;
}

}  // namespace
}  // namespace specdecode
