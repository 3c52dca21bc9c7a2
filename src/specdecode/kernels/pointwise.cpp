// Small per-row ops in one call each, where torch needs several (RMSNorm, RoPE) or runs slowly
// (argmax over a bf16 vocabulary). Row by row, so a row's result never depends on the other
// rows; rounded as the torch code they replace.

#include "core.h"
#include "isa.h"

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

inline float value(float x) { return x; }
inline float value(BFloat16 x) { return float(x); }

// The first index of a NaN in x [N], or -1.
template <typename T>
int64_t first_nan(const T* x, int64_t N) {
  for (int64_t i = 0; i < N; ++i)
    if (std::isnan(value(x[i]))) return i;
  return -1;
}

// The first index of the largest of x [from, N) given the largest of x [0, from) at `best`
// (none when best < 0); no NaN in x.
template <typename T>
int64_t first_max(const T* x, int64_t N, int64_t from, int64_t best) {
  float top = best < 0 ? 0.0f : value(x[best]);
  for (int64_t i = from; i < N; ++i)
    if (best < 0 || value(x[i]) > top) top = value(x[i]), best = i;
  return best;
}

// The first NaN's index, else the first largest value's: torch.argmax over one row.
template <typename T>
int64_t argmax_scalar(const T* x, int64_t N) {
  const int64_t nan = first_nan(x, N);
  return nan >= 0 ? nan : first_max(x, N, 0, -1);
}

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {  // bf16 -> fp32: a 16-bit shift
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// argmax_row's loop over 8 lanes: each lane keeps its largest value and that value's first
// index (a strict > never moves it to a later equal value), then the lanes' largest value
// and, among the lanes holding it, the lowest index. A NaN anywhere: the first NaN.
template <typename T>
int64_t argmax_row(const T* x, int64_t N) {
  if (N < 8 || N > INT32_MAX) return argmax_scalar(x, N);  // the lanes keep int32 indices
  __m256 top = load8(x);
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i index = at;
  __m256 nan = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
  const __m256i step = _mm256_set1_epi32(8);
  const int64_t whole = N / 8 * 8;
  for (int64_t i = 8; i < whole; i += 8) {
    const __m256 v = load8(x + i);
    index = _mm256_add_epi32(index, step);
    const __m256 more = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
    top = _mm256_blendv_ps(top, v, more);
    at = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(index), more));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan) != 0) return first_nan(x, N);
  alignas(32) float tops[8];
  alignas(32) int32_t ats[8];
  _mm256_store_ps(tops, top);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ats), at);
  float best_value = tops[0];
  int64_t best = ats[0];
  for (int l = 1; l < 8; ++l)
    if (tops[l] > best_value || (tops[l] == best_value && ats[l] < best))
      best_value = tops[l], best = ats[l];
  const int64_t tail_nan = first_nan(x + whole, N - whole);
  if (tail_nan >= 0) return whole + tail_nan;
  return first_max(x, N, whole, best);
}
#else
template <typename T>
int64_t argmax_row(const T* x, int64_t N) {
  return argmax_scalar(x, N);
}
#endif

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
