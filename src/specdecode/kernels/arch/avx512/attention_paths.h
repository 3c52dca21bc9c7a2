// The attention paths on AVX-512 (16 fp32 lanes): the vector parts, and for D = 64 or 128 one
// query with its query and output in registers (bf16: AVX-512 BF16 pair dot products).
#pragma once

#include "../../attention_shared.h"

#include <immintrin.h>

#include <type_traits>
#include <vector>

namespace specdecode {
namespace {

constexpr int64_t V = 16;  // fp32 lanes per vector

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (softmax after subtracting the max): x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by its degree-6 Taylor polynomial (relative error < 2e-7), then scaled by 2^n.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // exp(-87) ~ 1.6e-38: smaller values flush
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// dot_lanes, axpy_lanes, exp_lanes (attention_shared.h).
template <typename scalar_t>
inline int64_t dot_lanes(const float* q, const scalar_t* k, int64_t D, float& sum) {
  int64_t d = 0;
  __m512 acc = _mm512_setzero_ps();
  for (; d + V <= D; d += V) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  sum = _mm512_reduce_add_ps(acc);
  return d;
}

template <typename scalar_t>
inline int64_t axpy_lanes(float p, const scalar_t* v, float* out, int64_t D) {
  int64_t d = 0;
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + V <= D; d += V)
    _mm512_storeu_ps(out + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(out + d)));
  return d;
}

inline int64_t exp_lanes(float* scores, int64_t n, float top, float& total) {
  int64_t s = 0;
  const __m512 shift = _mm512_set1_ps(top);
  __m512 acc = _mm512_setzero_ps();
  for (; s + V <= n; s += V) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + s), shift));
    _mm512_storeu_ps(scores + s, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
  return s;
}

}  // namespace
}  // namespace specdecode

#include "../../attention_rows.h"

namespace specdecode {
namespace {

// attend_one for D = 16 * C with the query and the output kept in registers: the same products
// summed in the same order (so the same bits), without a trip through memory per slot.
template <int C, typename scalar_t, typename Slots>
void attend_one_registers(const scalar_t* q, const scalar_t* k, const scalar_t* v,
                          const Slots& slots, float scale, float cap, scalar_t* out,
                          std::vector<float>& scores) {
  constexpr int64_t D = C * V;
  const int64_t span = slots.size();
  __m512 qv[C];
  for (int c = 0; c < C; ++c) {
    alignas(64) float chunk[V];
    for (int64_t d = 0; d < V; ++d) chunk[d] = widen(q[c * V + d]) * scale;
    qv[c] = _mm512_load_ps(chunk);
  }
  scores.resize(span);
  for (int64_t s = 0; s < span; ++s) {
    const scalar_t* key = k + slots[s];
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) sum = _mm512_fmadd_ps(qv[c], load16(key + c * V), sum);
    scores[s] = _mm512_reduce_add_ps(sum);
  }
  const float total = exp_shifted(scores.data(), span, cap);
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < span; ++s) {
    const __m512 p = _mm512_set1_ps(scores[s]);
    const scalar_t* value = v + slots[s];
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(p, load16(value + c * V), acc[c]);
  }
  const float inv = 1.f / total;
  alignas(64) float result[D];
  for (int c = 0; c < C; ++c) _mm512_store_ps(result + c * V, acc[c]);
  for (int64_t d = 0; d < D; ++d) out[d] = scalar_t(result[d] * inv);
}

// attend_one for bf16 and D = 32 * C, in registers: the scores as bf16 pair dot products of q
// and k as they are (products exact in fp32, q's scale applied to the sum), the values widened
// by shifts (even and odd values in separate lanes) and summed over the slots in order.
template <int C, typename Slots>
void attend_bf16(const BFloat16* q, const BFloat16* k, const BFloat16* v, const Slots& slots,
                 float scale, float cap, BFloat16* out, std::vector<float>& scores) {
  constexpr int64_t PAIRS = 2 * V;  // bf16 values per vector
  const int64_t span = slots.size();
  __m512bh qv[C];
  for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + c * PAIRS);
  auto score = [&](const BFloat16* key) {
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c)
      sum = _mm512_dpbf16_ps(sum, qv[c], (__m512bh)_mm512_loadu_si512(key + c * PAIRS));
    return _mm512_reduce_add_ps(sum) * scale;
  };
  scores.resize(span);
  int64_t s = 0;
  for (; s + 4 <= span; s += 4) {  // four independent sums at a time: the same values
    __m512 sum[4];
    for (int j = 0; j < 4; ++j) sum[j] = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < 4; ++j)
        sum[j] = _mm512_dpbf16_ps(
            sum[j], qv[c], (__m512bh)_mm512_loadu_si512(k + slots[s + j] + c * PAIRS));
    for (int j = 0; j < 4; ++j) scores[s + j] = _mm512_reduce_add_ps(sum[j]) * scale;
  }
  for (; s < span; ++s) scores[s] = score(k + slots[s]);
  const float total = exp_shifted(scores.data(), span, cap);
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __m512 even[C], odd[C];
  for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  for (s = 0; s < span; ++s) {
    const __m512 p = _mm512_set1_ps(scores[s]);
    const BFloat16* value = v + slots[s];
    for (int c = 0; c < C; ++c) {
      const __m512i raw = _mm512_loadu_si512(value + c * PAIRS);
      even[c] = _mm512_fmadd_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), even[c]);
      odd[c] = _mm512_fmadd_ps(p, _mm512_castsi512_ps(_mm512_and_si512(raw, high)), odd[c]);
    }
  }
  const float inv = 1.f / total;
  alignas(64) float evens[V], odds[V];
  for (int c = 0; c < C; ++c) {
    _mm512_store_ps(evens, even[c]);
    _mm512_store_ps(odds, odd[c]);
    for (int64_t i = 0; i < V; ++i) {
      out[c * PAIRS + 2 * i] = BFloat16(evens[i] * inv);
      out[c * PAIRS + 2 * i + 1] = BFloat16(odds[i] * inv);
    }
  }
}

// fast_attend (attention_shared.h): D = 64 or 128 in registers.
template <typename scalar_t, typename Slots>
bool fast_attend(const scalar_t* q, const scalar_t* keys, const scalar_t* values,
                 const Slots& slots, int64_t D, float scale, float cap, scalar_t* out,
                 std::vector<float>& scores) {
  if (D != 64 && D != 128) return false;
  if constexpr (std::is_same_v<scalar_t, BFloat16>) {
    auto run = D == 64 ? attend_bf16<2, Slots> : attend_bf16<4, Slots>;
    run(q, keys, values, slots, scale, cap, out, scores);
  } else {
    auto run = D == 64 ? attend_one_registers<4, scalar_t, Slots>
                       : attend_one_registers<8, scalar_t, Slots>;
    run(q, keys, values, slots, scale, cap, out, scores);
  }
  return true;
}

}  // namespace
}  // namespace specdecode

// no grouped heads: fast_attend keeps a query's output in registers by itself
#include "../../attention_grouped_absent.h"
