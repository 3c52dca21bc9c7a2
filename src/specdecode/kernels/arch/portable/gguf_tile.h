// The GGUF tile (gguf_shared.h) in plain C++, one (row, token) sum at a time: the vector
// paths' integer sums and fp32 steps in the same order, the fused multiply-adds as std::fma, so
// the same bits. It prefetches nothing.
#pragma once

#include "../../gguf_shared.h"

#include <cmath>
#include <cstring>

namespace specdecode {
namespace {

// tokens per tile, at most (any grouping gives a token the same bits)
template <int BITS>
constexpr int GGUF_TOKENS = 8;

// The fewest tokens a tile computes for which it is handed the next tile (gguf.cpp: `next`),
// which this tile does not prefetch.
constexpr int PREFETCH_FROM_TOKENS = 1;

// Code of value k (0 <= k < S) of lane l of one tile's sub-block at `codes` (the layout in
// gguf.cpp's header).
template <int BITS, int S>
inline int32_t code_at(const uint8_t* codes, int64_t l, int64_t k) {
  const int64_t c = k / 4, b = k % 4;
  if constexpr (BITS == 8) {
    return codes[c * 64 + l * 4 + b];
  } else {  // the low nibble, then (BITS 5, 6) the high bits from the plane after the nibbles
    const uint8_t byte = codes[(c / 2) * 64 + l * 4 + b];
    const int32_t low = (c % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
    if constexpr (BITS == 4) {
      return low;
    } else {
      const uint8_t plane = codes[PLANE_AT<S> + l * 4 + b];
      return low | ((plane >> ((BITS - 4) * c)) & ((1 << (BITS - 4)) - 1)) << 4;
    }
  }
}

// gguf_tile (gguf_shared.h).
template <int BITS, int S, int SUBS, int OFF, int MINS, int T>
void gguf_tile(const uint8_t* blk, int64_t nsb, const GgufActs& a, const uint8_t*,
               float acc[T][LANES]) {
  using G = TileGeometry<BITS, S, SUBS, OFF, MINS>;
  const G geo(a);
  std::memset(acc, 0, sizeof(float) * T * LANES);
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* h = blk + s * G::sb_bytes;
    const uint16_t* D = reinterpret_cast<const uint16_t*>(h);
    const int8_t* sc = reinterpret_cast<const int8_t*>(h + G::sc_at);
    const int8_t* mn = reinterpret_cast<const int8_t*>(h + G::mn_at);
    auto table = [](const int8_t* t, int64_t j, int64_t l) {  // pair layout (see the header)
      return int32_t(t[(j / 2) * 2 * LANES + 2 * l + j % 2]);
    };
    for (int64_t l = 0; l < LANES; ++l) {
      for (int t = 0; t < T; ++t) {
        int32_t main = 0, mins = 0;
        for (int64_t j = 0; j < SUBS; ++j) {
          const int64_t k0 = (s * SUBS + j) * S;
          const uint8_t* codes = h + G::header + j * G::sub_bytes;
          int32_t isum = 0;
          for (int64_t k = 0; k < S; ++k)
            isum += code_at<BITS, S>(codes, l, k) * int32_t(a.x8[t * a.K + k0 + k]);
          const int32_t b = geo.bsum[t * geo.ld_bsum + s * SUBS + j];
          const int32_t scale = SUBS > 1 ? table(sc, j, l) : 1;
          main += scale * isum - OFF * scale * b;
          if (MINS == 1) mins += table(mn, j, l) * b;
        }
        const float dx = a.dx[t * geo.ld_dx + s];
        acc[t][l] = std::fma(float(main), half_to_float(D[l]) * dx, acc[t][l]);
        if (MINS == 1)
          acc[t][l] = std::fma(-(half_to_float(D[LANES + l]) * dx), float(mins), acc[t][l]);
        if (MINS == 2)
          acc[t][l] = std::fma(-half_to_float(D[LANES + l]), a.sx[t * geo.ld_dx + s], acc[t][l]);
      }
    }
  }
}

}  // namespace
}  // namespace specdecode
