// The matmuls' epilogues in plain C++, one value at a time (the avx2, avxvnni, neon and portable
// folders' epilogue.h; AVX-512's vectors give the same values).
//
// Each arch folder's epilogue.h defines:
//   absmax_lanes(x, K, absmax), code_lanes(x, K, inv, codes): the vector part of an int8
//   row's quantization (matmul.cpp's quantize_row): each covers a prefix of the row and
//   returns its length (0 here), the rest is done one value at a time after it;
//   store_rows(acc, T, n0, N, b, y, ldy): a tile's fp32 sums stored (+ bias);
//   int8_epilogue<CODE_ZERO>(acc, T, n0, N, wsum, ws, b, x_scale, y): a tile's int32 sums
//   scaled and stored (+ bias).
#pragma once

#include "../../tiles.h"

#include <algorithm>
#include <cstdint>

namespace specdecode {
namespace {

// absmax_lanes, code_lanes: no vectors, nothing done.
template <typename scalar_t>
inline int64_t absmax_lanes(const scalar_t*, int64_t, float&) {
  return 0;
}

template <typename scalar_t>
inline int64_t code_lanes(const scalar_t*, int64_t, float, uint8_t*) {
  return 0;
}

// y[t][n0 + l] = out_t(acc[t][l] (+ b[n0 + l])) for the rows n0 .. n0 + 15 (those < N) of T
// tokens; acc [T, LANES], y rows at stride ldy.
template <typename out_t>
void store_rows(const float* acc, int64_t T, int64_t n0, int64_t N, const float* b, out_t* y,
                int64_t ldy) {
  const int64_t count = std::min(LANES, N - n0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t l = 0; l < count; ++l) {
      const float v = acc[t * LANES + l];
      y[t * ldy + n0 + l] = out_t(b != nullptr ? v + b[n0 + l] : v);
    }
}

// y[t][n] = out_t(float(acc[t][n] - CODE_ZERO * wsum[n]) * (x_scale[t] * ws[n]) (+ b[n])) for
// the 16 rows n0 .. n0 + 15 (those < N) of T tokens: acc [T, LANES] int32 at stride LANES,
// y [T, N].
template <int32_t CODE_ZERO, typename out_t>
void int8_epilogue(const int32_t* acc, int64_t T, int64_t n0, int64_t N, const int32_t* wsum,
                   const float* ws, const float* b, const float* x_scale, out_t* y) {
  const int64_t count = std::min(LANES, N - n0);
  for (int64_t l = 0; l < count; ++l) {
    const int64_t n = n0 + l;
    for (int64_t t = 0; t < T; ++t) {
      const int32_t dot = acc[t * LANES + l] - CODE_ZERO * wsum[n];  // see CODE_ZERO
      float v = float(dot) * (x_scale[t] * ws[n]);
      if (b != nullptr) v = v + b[n];
      y[t * N + n] = out_t(v);  // rounded once to y's dtype
    }
  }
}

}  // namespace
}  // namespace specdecode
