// Attention for decode and verification passes: every (row, head, new token) attends by itself
// over exactly the cache slots it may see, with the same arithmetic a 1-token step uses, so its
// output is bit for bit independent of how many tokens the pass holds (what exact verification
// needs), in one call instead of one Python-level attention per token.
//
// Keys and values live in blocks (a paged cache): row b's slot s is slot s % block_size of block
// table[b][s / block_size] (a rectangular cache is the case of one block per row). Query t of
// batch row b reads slots 0 .. starts[b] + t; in a tree pass it reads slots
// 0 .. tree_starts[b] - 1 and then the slots tree_starts[b] + r that its mask row allows (its
// ancestors and itself), in increasing order: the same keys in the same order as a chain pass
// over its own path, so the same bits. With a sliding window W a query at position p reads
// no slot before p - W + 1 (Mistral, Gemma's local layers), again in any pass shape alike.
// Scores q.k * scale (soft-capped to cap * tanh(score / cap) where a cap is given: Gemma 2),
// the softmax and the weighted sum of values are all in fp32 (bf16 inputs are widened, never
// rounded in between; bf16 scores of head size 64 / 128 are sums of exact bf16 products,
// scaled after the sum); the output is rounded once to q's dtype. Query head h reads KV head
// h / (H / Hkv). A query's arithmetic depends only on its own span, never on the other queries
// of the call. The AVX-512, AVX2 and NEON variants sum in vectors of 16, 8 and 4 lanes: their
// last bits may differ from each other's, never between the passes of one variant.

#include "attention_paths.h"  // this variant's: its arch folder (setup.py)
#include "core.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace specdecode {
namespace {

// One query: the attention over `slots` with the fastest exact routine for its dtype and D.
template <typename scalar_t, typename Slots>
void attend(const scalar_t* q, const scalar_t* keys, const scalar_t* values, const Slots& slots,
            int64_t D, float scale, float cap, scalar_t* out, std::vector<float>& qf,
            std::vector<float>& scores, std::vector<float>& acc) {
  if (fast_attend(q, keys, values, slots, D, scale, cap, out, scores)) return;
  attend_one(q, keys, values, slots, D, scale, cap, out, qf, scores, acc);
}

// The element offsets (from a KV head's base) of the slots query (b, t) reads, in order: the
// slots first .. prefix - 1, then prefix + extra[i] for the `count` tree offsets.
void slot_offsets(const AttentionShape& shape, int64_t b, int64_t first, int64_t prefix,
                  const int64_t* extra, int64_t count, std::vector<int64_t>& out) {
  const int64_t* table = shape.table + b * shape.max_blocks;
  const int64_t size = shape.block_size;
  out.resize(prefix - first + count);
  int64_t* at = out.data();
  for (int64_t slot = first; slot < prefix;) {  // block by block
    const int64_t within = slot % size, n = std::min(size - within, prefix - slot);
    const int64_t base = table[slot / size] * shape.block_stride + within * shape.slot_stride;
    for (int64_t o = 0; o < n; ++o) *at++ = base + o * shape.slot_stride;
    slot += n;
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t slot = prefix + extra[i];
    *at++ = table[slot / size] * shape.block_stride + slot % size * shape.slot_stride;
  }
}

// The first slot a query at `position` reads before its prefix ends (its window's start).
int64_t window_start(const AttentionShape& shape, int64_t position, int64_t prefix) {
  if (shape.window <= 0) return 0;
  return std::min(prefix, std::max<int64_t>(0, position - shape.window + 1));
}

}  // namespace

template <typename T>
void attention(const T* q, const T* k, const T* v, const AttentionShape& shape,
               const int64_t* starts, const int64_t* tree_starts, const int64_t* extra,
               const int64_t* extra_begin, T* out) {
  const int64_t H = shape.H, Tq = shape.T, D = shape.D, group = shape.H / shape.Hkv;
  const float scale = 1.f / std::sqrt(float(D)), cap = shape.softcap;
  // The slots query (b, t) = (query / Tq, query % Tq) reads, as offsets from its KV head.
  auto query_offsets = [&](int64_t query, std::vector<int64_t>& offsets) {
    const int64_t b = query / Tq, t = query % Tq;
    if (tree_starts != nullptr) {
      const int64_t first = extra_begin[query], count = extra_begin[query + 1] - first;
      const int64_t position = tree_starts[b] + count - 1;
      slot_offsets(shape, b, window_start(shape, position, tree_starts[b]), tree_starts[b],
                   extra + first, count, offsets);
    } else {
      const int64_t position = starts[b] + t;
      slot_offsets(shape, b, window_start(shape, position, position + 1), position + 1, nullptr,
                   0, offsets);
    }
  };
  if (grouped_attention(q, k, v, shape, scale, cap, query_offsets, out)) return;
  // Tasks run (row, query, head) with the head fastest: a query's slot offsets are computed once
  // for all its heads (query heads read their KV head through the base pointer).
  parallel_for(0, shape.B * Tq * H, 1, [&](int64_t begin, int64_t end) {
    // per thread: scaled q [D], scores [span], out [D], slot offsets [span]
    std::vector<float> qf, scores, acc;
    std::vector<int64_t> offsets;
    int64_t query = -1;  // the (row, token) whose offsets `offsets` holds
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (Tq * H), t = task / H % Tq, h = task % H;
      if (task / H != query) {
        query = task / H;
        query_offsets(query, offsets);
      }
      const int64_t head = h / group * shape.head_stride;
      const int64_t at = ((b * H + h) * Tq + t) * D;  // q and out are [B, H, T, D]
      const Offsets slots{offsets.data(), int64_t(offsets.size())};
      attend(q + at, k + head, v + head, slots, D, scale, cap, out + at, qf, scores, acc);
    }
  });
}

template void attention(const float*, const float*, const float*, const AttentionShape&,
                        const int64_t*, const int64_t*, const int64_t*, const int64_t*, float*);
template void attention(const BFloat16*, const BFloat16*, const BFloat16*,
                        const AttentionShape&, const int64_t*, const int64_t*, const int64_t*,
                        const int64_t*, BFloat16*);

}  // namespace specdecode
