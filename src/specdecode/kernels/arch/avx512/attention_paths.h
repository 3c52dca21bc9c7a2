// The attention paths on AVX-512 (16 fp32 lanes): the vector parts, and for D = 64 or 128 one
// query with its query and output in registers (bf16: AVX-512 BF16 pair dot products, and the
// query heads that share a KV head together: each value vector widened once for them).
#pragma once

#include "../../attention_shared.h"

#include <immintrin.h>

#include <algorithm>
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

// Slot j of a block of 16 keeps its score's sums in vector tree_index(j), so that lane_sums
// leaves its score in lane j.
constexpr int tree_index(int j) { return 4 * (j % 4) + j / 4; }

// Lane j: the sum of the 16 lanes of acc[tree_index(j)], by one tree for every j (lanes l and
// l + 8, then l and l + 4, l and l + 2, l and l + 1 of what is left): 45 shuffles and adds for
// 16 sums, where one horizontal sum each takes ~8 instructions.
inline __m512 lane_sums(const __m512* acc) {
  __m512 halves[8], quarters[4], pairs[2];
  UNROLL for (int i = 0; i < 8; ++i) {  // [a lanes 0-7 + 8-15, b lanes 0-7 + 8-15]
    const __m512 a = acc[2 * i], b = acc[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  UNROLL for (int i = 0; i < 4; ++i) {  // one vector's 4 partial sums per 128-bit lane
    const __m512 a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] =
        _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  UNROLL for (int i = 0; i < 2; ++i) {  // two vectors' 2 partial sums per 128-bit lane
    const __m512 a = quarters[2 * i], b = quarters[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                       _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
}

constexpr int64_t PAIRS = 2 * V;  // bf16 values per vector

// scores[i] [span] = (q[i] . k[slot]) * scale for NH bf16 query heads (qv: D = 32 * C as
// pairs), 16 / NH slots at a time for all of them (each key vector loaded once): bf16 pair dot
// products (exact products, summed in fp32 along D), every (head, slot) vector summed by
// lane_sums' tree (so a score's bits do not depend on NH), a shorter last block with its
// missing slots zero.
template <int NH, int C, typename Slots>
void score_bf16(const __m512bh (&qv)[NH][C], const BFloat16* k, const Slots& slots, float scale,
                float* const* scores) {
  constexpr int N = 16 / NH;  // slots a block
  const int64_t span = slots.size();
  const __m512 sv = _mm512_set1_ps(scale);
  __m512 acc[16];  // (head i, slot j) at tree_index(i * N + j)
  alignas(64) float sums[16];
  for (int64_t s = 0; s < span; s += N) {
    const int64_t n = std::min<int64_t>(N, span - s);
    if (n == N) {
      UNROLL for (int j = 0; j < N; ++j) {
        const BFloat16* key = k + slots[s + j];
        __m512 sum[NH];
        UNROLL for (int i = 0; i < NH; ++i) sum[i] = _mm512_setzero_ps();
        UNROLL for (int c = 0; c < C; ++c) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(key + c * PAIRS);
          UNROLL for (int i = 0; i < NH; ++i) sum[i] = _mm512_dpbf16_ps(sum[i], qv[i][c], kv);
        }
        UNROLL for (int i = 0; i < NH; ++i) acc[tree_index(i * N + j)] = sum[i];
      }
    } else {
      for (int j = 0; j < N; ++j)
        for (int i = 0; i < NH; ++i) {
          __m512 sum = _mm512_setzero_ps();
          if (j < n)
            for (int c = 0; c < C; ++c)
              sum = _mm512_dpbf16_ps(
                  sum, qv[i][c], (__m512bh)_mm512_loadu_si512(k + slots[s + j] + c * PAIRS));
          acc[tree_index(i * N + j)] = sum;
        }
    }
    _mm512_store_ps(sums, _mm512_mul_ps(lane_sums(acc), sv));
    UNROLL for (int i = 0; i < NH; ++i) std::copy_n(sums + i * N, n, scores[i] + s);
  }
}

// out[i] [D] += the sum over the slots, in order, of p[i][s] * v[slot s] for NH heads, in
// registers (even and odd values in separate lanes); each value vector is widened once for all.
template <int NH, int C, typename Slots>
void weigh_bf16(const float* const* p, const BFloat16* v, const Slots& slots,
                __m512 (&even)[NH][C], __m512 (&odd)[NH][C]) {
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  const int64_t span = slots.size();
  for (int64_t s = 0; s < span; ++s) {
    __m512 weight[NH];
    UNROLL for (int i = 0; i < NH; ++i) weight[i] = _mm512_set1_ps(p[i][s]);
    const BFloat16* value = v + slots[s];
    UNROLL for (int c = 0; c < C; ++c) {
      const __m512i raw = _mm512_loadu_si512(value + c * PAIRS);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
      UNROLL for (int i = 0; i < NH; ++i) {
        even[i][c] = _mm512_fmadd_ps(weight[i], lo, even[i][c]);
        odd[i][c] = _mm512_fmadd_ps(weight[i], hi, odd[i][c]);
      }
    }
  }
}

// attend_one for NH bf16 query heads q[i] sharing a KV head, D = 32 * C: scores by score_bf16
// (q as it is, its scale applied to each sum), the softmax by exp_shifted, the weighted sums by
// weigh_bf16, each out[i] rounded once. A head's bits do not depend on the others.
template <int NH, int C, typename Slots>
void attend_bf16(const BFloat16* const* q, const BFloat16* k, const BFloat16* v,
                 const Slots& slots, float scale, float cap, BFloat16* const* out,
                 std::vector<float>& scores) {
  const int64_t span = slots.size();
  scores.resize(NH * span);
  float* p[NH];
  __m512bh qv[NH][C];
  UNROLL for (int i = 0; i < NH; ++i) {
    p[i] = scores.data() + i * span;
    UNROLL for (int c = 0; c < C; ++c)
      qv[i][c] = (__m512bh)_mm512_loadu_si512(q[i] + c * PAIRS);
  }
  score_bf16<NH, C>(qv, k, slots, scale, p);
  float total[NH];
  UNROLL for (int i = 0; i < NH; ++i) total[i] = exp_shifted(p[i], span, cap);
  __m512 even[NH][C], odd[NH][C];
  UNROLL for (int i = 0; i < NH; ++i)
    UNROLL for (int c = 0; c < C; ++c) even[i][c] = odd[i][c] = _mm512_setzero_ps();
  weigh_bf16<NH, C>(p, v, slots, even, odd);
  alignas(64) float evens[V], odds[V];
  UNROLL for (int i = 0; i < NH; ++i) {
    const float inv = 1.f / total[i];
    UNROLL for (int c = 0; c < C; ++c) {
      _mm512_store_ps(evens, even[i][c]);
      _mm512_store_ps(odds, odd[i][c]);
      for (int64_t l = 0; l < V; ++l) {
        out[i][c * PAIRS + 2 * l] = BFloat16(evens[l] * inv);
        out[i][c * PAIRS + 2 * l + 1] = BFloat16(odds[l] * inv);
      }
    }
  }
}

// fast_attend (attention_shared.h): fp32, D = 64 or 128 in registers (bf16 heads of those
// sizes take the grouped path below).
template <typename scalar_t, typename Slots>
bool fast_attend(const scalar_t* q, const scalar_t* keys, const scalar_t* values,
                 const Slots& slots, int64_t D, float scale, float cap, scalar_t* out,
                 std::vector<float>& scores) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (D != 64 && D != 128) return false;
    auto run = D == 64 ? attend_one_registers<4, float, Slots>
                       : attend_one_registers<8, float, Slots>;
    run(q, keys, values, slots, scale, cap, out, scores);
    return true;
  }
  return false;
}

// heads_at_once (attention_group_tasks.h): bf16 heads of 64 or 128 values, as many at a time
// as their sums fit the registers (4 of 64, 2 of 128).
template <typename T>
int64_t heads_at_once(int64_t D) {
  if (!std::is_same_v<T, BFloat16>) return 0;
  return D == 64 ? 4 : D == 128 ? 2 : 0;
}

// attend_heads (attention_group_tasks.h): attend_bf16 for the nh heads, heads_at_once(D) of
// them at a time.
template <typename scalar_t, typename Slots>
void attend_heads(int64_t nh, const scalar_t* const* q, const scalar_t* k, const scalar_t* v,
                  const Slots& slots, int64_t D, float scale, float cap, scalar_t* const* out,
                  std::vector<float>&, std::vector<float>& scores, std::vector<float>&) {
  if constexpr (std::is_same_v<scalar_t, BFloat16>) {
    const int64_t most = heads_at_once<scalar_t>(D);
    for (int64_t i = 0; i < nh; i += most) {
      if (D == 64)
        with_count<4>(std::min(most, nh - i), [&](auto heads) {
          attend_bf16<decltype(heads)::value, 2>(q + i, k, v, slots, scale, cap, out + i, scores);
        });
      else
        with_count<2>(std::min(most, nh - i), [&](auto heads) {
          attend_bf16<decltype(heads)::value, 4>(q + i, k, v, slots, scale, cap, out + i, scores);
        });
    }
  }
}

}  // namespace
}  // namespace specdecode

#include "../../attention_group_tasks.h"
