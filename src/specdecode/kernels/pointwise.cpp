// Small per-row ops in one call each, where torch needs several (RMSNorm, RoPE) or runs slowly
// (argmax over a bf16 vocabulary). Row by row, so a row's result never depends on the other
// rows; rounded as the torch code they replace.

#include "argmax_row.h"  // this variant's: its arch folder (setup.py)
#include "core.h"

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace specdecode {
namespace {

// A weight in x's dtype multiplies the rounded normed value (Llama's order); an fp32 weight
// under bf16 x multiplies before rounding (Gemma's, whose weight is 1 + w kept in fp32).
template <typename scalar_t, typename weight_t>
void rms_norm_row(const scalar_t* x, const weight_t* w, int64_t D, float eps, scalar_t* y) {
  float squares = 0.f;
  for (int64_t d = 0; d < D; ++d) squares += float(x[d]) * float(x[d]);
  const float inv = 1.f / std::sqrt(squares / float(D) + eps);
  for (int64_t d = 0; d < D; ++d) {
    if constexpr (std::is_same_v<scalar_t, weight_t>)
      y[d] = scalar_t(float(w[d]) * float(scalar_t(float(x[d]) * inv)));
    else
      y[d] = scalar_t(float(x[d]) * inv * float(w[d]));
  }
}

// One token's `heads` heads of D values, rotated in place (rotate-half convention):
// y = r(r(x * r(c)) + r(rot(x) * r(s))), r = rounding to scalar_t, rot(x) = [-x2, x1].
template <typename scalar_t>
void rope_row(scalar_t* x, const float* cos, const float* sin, int64_t heads, int64_t D,
              std::vector<float>& old) {
  const int64_t half = D / 2;
  old.resize(D);
  for (int64_t h = 0; h < heads; ++h, x += D) {
    for (int64_t d = 0; d < D; ++d) old[d] = float(x[d]);
    for (int64_t d = 0; d < D; ++d) {
      const float rotated = d < half ? -old[d + half] : old[d - half];
      const float a = float(scalar_t(old[d] * float(scalar_t(cos[d]))));
      const float b = float(scalar_t(rotated * float(scalar_t(sin[d]))));
      x[d] = scalar_t(a + b);
    }
  }
}

}  // namespace

template <typename T>
void argmax(const T* x, int64_t rows, int64_t N, int64_t* out) {
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * N, N);
  });
}

template <typename T>
void rope(T* x, const float* cos, const float* sin, int64_t tokens, int64_t W, int64_t heads,
          int64_t D) {
  parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> old;  // one head's values before rotation
    for (int64_t i = begin; i < end; ++i)
      rope_row(x + i * W, cos + i * D, sin + i * D, heads, D, old);
  });
}

template <typename T, typename W>
void rms_norm(const T* x, const W* w, int64_t rows, int64_t D, float eps, T* y) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * D, w, D, eps, y + r * D);
  });
}

template void argmax(const float*, int64_t, int64_t, int64_t*);
template void argmax(const BFloat16*, int64_t, int64_t, int64_t*);
template void rope(float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t);
template void rope(BFloat16*, const float*, const float*, int64_t, int64_t, int64_t, int64_t);
template void rms_norm(const float*, const float*, int64_t, int64_t, float, float*);
template void rms_norm(const BFloat16*, const BFloat16*, int64_t, int64_t, float, BFloat16*);
template void rms_norm(const BFloat16*, const float*, int64_t, int64_t, float, BFloat16*);

}  // namespace specdecode
