// What every instruction set's GGUF tile shares (arch/<folder>/gguf_tile.h; the packed layout
// and the sums are gguf.cpp's header): where a tile's parts lie, the activations' strides, and
// the prefetch of the next tile.
//
// Each arch folder's gguf_tile.h defines, for its instruction sets:
//   GGUF_TOKENS<BITS>: the most tokens a tile of BITS-bit codes computes at once;
//   gguf_tile<BITS, S, SUBS, OFF, MINS, T>(blk, nsb, a, next, acc): acc[t][l] = the sum over
//   the nsb superblocks of one packed tile (16 rows) at blk of row l's by token t's
//   contributions; `a` holds the tile's T tokens' activations: rows of x8 (stride K), dx and sx
//   (stride K / B), bsum16 (stride K / 16), bsum32 (stride K / 32). While it computes, the tile
//   at `next` (nullptr: none) may be prefetched, superblock by superblock (prefetch_part): the
//   hardware prefetchers alone leave the memory stream idle while a multi-token tile computes.
//   Each folder says from how many tokens a tile is handed `next` (PREFETCH_FROM_TOKENS).
//   Every folder's tile gives the same bits.
#pragma once

#include "core.h"
#include "tiles.h"

#include <cstdint>

namespace specdecode {
namespace {

static_assert(LANES == GGUF_ROWS, "a GGUF tile is one row per lane");

// 4 activation bytes read as one int32 where they lie, so that the compiler can fold the load
// into a broadcast operand
typedef int32_t unaligned_i32 __attribute__((aligned(1), may_alias));

// Where the parts of one packed tile's superblock lie (bytes from its start), and the
// activations' strides.
template <int BITS, int S, int SUBS, int OFF, int MINS>
struct TileGeometry {
  static_assert(OFF == 0 || (OFF & (OFF - 1)) == 0, "OFF is a power of two");
  static_assert(BITS == 4 || BITS == 8 || (BITS - 4) * S == 32,
                "BITS 5, 6: the high bits of a sub-block's codes fill one 64-byte plane");
  static constexpr int SHIFT = OFF == 0 ? 0 : __builtin_ctz(OFF);  // OFF = 1 << SHIFT
  static constexpr GgufLayout layout{BITS, S, SUBS, OFF, MINS};
  static constexpr int64_t header = layout.header_bytes(), sub_bytes = layout.sub_bytes();
  static constexpr int64_t sb_bytes = layout.superblock_bytes();
  static constexpr int64_t sc_at = (MINS ? 4 : 2) * LANES;  // the sc table (SUBS > 1)
  static constexpr int64_t mn_at = sc_at + (SUBS > 1 ? SUBS * LANES : 0);  // mn (MINS == 1)
  int64_t ld_dx;        // dx, sx per token: K / (S * SUBS)
  const int16_t* bsum;  // the sums of x8 per sub-block (bsum16 or bsum32)
  int64_t ld_bsum;      // per token: K / S
  explicit TileGeometry(const GgufActs& a)
      : ld_dx(a.K / (S * SUBS)), bsum(S == 16 ? a.bsum16 : a.bsum32), ld_bsum(a.K / S) {}
};

// Where the plane of high bits (BITS 5, 6) starts in a sub-block of S codes a row: after the
// low nibbles.
template <int S>
constexpr int64_t PLANE_AT = LANES * S / 2;

// Prefetches into the L2 cache part `part` of `parts` of the `bytes` bytes at p (the cache
// lines that start in it).
inline void prefetch_part(const uint8_t* p, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; ++line)
    __builtin_prefetch(p + line * 64, 0, 2);  // x86: prefetcht1
}

}  // namespace
}  // namespace specdecode
