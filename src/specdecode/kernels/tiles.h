// What the matmul kernels share (matmul.cpp, gguf.cpp): the tile shape and the loop over tiles
// (each arch folder's epilogue.h stores a tile's sums).
#pragma once

#include "core.h"
#include "isa.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace specdecode {
namespace {

constexpr int64_t LANES = 16;             // fp32 / int32 lanes per vector: rows per group
constexpr int64_t GROUPS = 4;             // row groups per tile
constexpr int64_t ROWS = GROUPS * LANES;  // output rows per tile (MATMUL_ROWS)
constexpr int64_t TOKENS = 4;             // tokens per tile, at most
constexpr int64_t TASK_BYTES = 1 << 16;   // weight bytes per parallel task, at least
constexpr int64_t REUSE_BYTES = 1 << 18;  // weight bytes each group of tokens runs over in turn

// Calls tile(Int<T>, block, m0) for every block (of a weight's rows) and every group of T
// tokens starting at m0: the fewest groups of at most MAX tokens, of sizes that differ by at
// most one (9 tokens of MAX 8: 5 + 4, not 8 + 1); blocks are split across threads, at least
// TASK_BYTES of weights per task. A task takes its blocks in runs of REUSE_BYTES of weights (or
// one block) and runs every group of tokens over a whole run before the next run: the run's
// weights stay in the L2 cache for the later groups, and a group's activations stay in the L1
// across the run, where every block would read all M tokens' activations again (prefill).
template <int MAX, class Tile>
void for_each_tile(int64_t blocks, int64_t M, int64_t block_bytes, const Tile& tile) {
  const int64_t grain = std::max<int64_t>(1, TASK_BYTES / block_bytes);
  const int64_t run = std::max<int64_t>(1, REUSE_BYTES / block_bytes);
  const int64_t groups = (M + MAX - 1) / MAX;
  parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t first = begin; first < end; first += run) {
      const int64_t last = std::min(end, first + run);
      for (int64_t g = 0, m0 = 0; g < groups; ++g) {
        const int64_t count = M / groups + (g < M % groups ? 1 : 0);
        with_count<MAX>(count, [&](auto tokens) {
          for (int64_t block = first; block < last; ++block) tile(tokens, block, m0);
        });
        m0 += count;
      }
    }
  });
}

}  // namespace
}  // namespace specdecode
