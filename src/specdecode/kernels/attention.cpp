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

#include "core.h"
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace specdecode {
namespace {

constexpr int64_t V = 16;  // fp32 lanes per vector

inline float widen(float x) { return x; }
inline float widen(BFloat16 x) { return float(x); }

// The slots one query reads, in order, as element offsets into its KV head's blocks (the
// block table already applied: see `attention`).
struct Offsets {
  const int64_t* at;
  int64_t n;
  int64_t size() const { return n; }
  int64_t operator[](int64_t i) const { return at[i]; }
};

#if defined(__AVX512F__)
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
#elif defined(__AVX2__)
constexpr int64_t V8 = 8;  // fp32 lanes per AVX2 vector
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float sum8(__m256 v) {  // the 8 lanes in a fixed order
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// exp16's polynomial on 8 lanes; 2^n is built in the exponent bits (n >= -126 after the clamp).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#elif defined(SPECDECODE_NEON)
constexpr int64_t V4 = 4;  // fp32 lanes per NEON vector
inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}

// exp16's polynomial on 4 lanes; 2^n is built in the exponent bits (n >= -126 after the clamp).
inline float32x4_t exp4(float32x4_t x) {
  x = vmaxq_f32(x, vdupq_n_f32(-87.f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145752f));
  r = vfmsq_f32(r, n, vdupq_n_f32(1.42860677e-6f));
  float32x4_t p = vdupq_n_f32(1.f / 720);
  p = vfmaq_f32(vdupq_n_f32(1.f / 120), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 24), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 6), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(bits));
}
#endif

// q . k over D values in fp32 (q already fp32).
template <typename scalar_t>
float dot(const float* q, const scalar_t* k, int64_t D) {
  int64_t d = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + V <= D; d += V) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + V8 <= D; d += V8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  sum = sum8(acc);
#elif defined(SPECDECODE_NEON)
  float32x4_t acc = vdupq_n_f32(0.f);
  for (; d + V4 <= D; d += V4) acc = vfmaq_f32(acc, vld1q_f32(q + d), load4(k + d));
  sum = vaddvq_f32(acc);
#endif
  for (; d < D; ++d) sum += q[d] * widen(k[d]);
  return sum;
}

// out[0:D] += p * v[0:D] (fp32 out).
template <typename scalar_t>
void axpy(float p, const scalar_t* v, float* out, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + V <= D; d += V)
    _mm512_storeu_ps(out + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(out + d)));
#elif defined(__AVX2__)
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + V8 <= D; d += V8)
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(out + d)));
#elif defined(SPECDECODE_NEON)
  const float32x4_t pv = vdupq_n_f32(p);
  for (; d + V4 <= D; d += V4) vst1q_f32(out + d, vfmaq_f32(vld1q_f32(out + d), pv, load4(v + d)));
#endif
  for (; d < D; ++d) out[d] += p * widen(v[d]);
}

// scores[0:n] -> exp(scores - max), returns their sum; cap > 0 first soft-caps each score to
// cap * tanh(score / cap) (Gemma 2's attention; one scalar tanh per score, in every variant).
float exp_shifted(float* scores, int64_t n, float cap) {
  if (cap > 0.f)
    for (int64_t s = 0; s < n; ++s) scores[s] = cap * std::tanh(scores[s] / cap);
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < n; ++s) top = std::max(top, scores[s]);
  int64_t s = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(top);
  __m512 acc = _mm512_setzero_ps();
  for (; s + V <= n; s += V) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + s), shift));
    _mm512_storeu_ps(scores + s, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
  const __m256 shift = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  for (; s + V8 <= n; s += V8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), shift));
    _mm256_storeu_ps(scores + s, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = sum8(acc);
#elif defined(SPECDECODE_NEON)
  const float32x4_t shift = vdupq_n_f32(top);
  float32x4_t acc = vdupq_n_f32(0.f);
  for (; s + V4 <= n; s += V4) {
    const float32x4_t e = exp4(vsubq_f32(vld1q_f32(scores + s), shift));
    vst1q_f32(scores + s, e);
    acc = vaddq_f32(acc, e);
  }
  total = vaddvq_f32(acc);
#endif
  for (; s < n; ++s) {
    scores[s] = std::exp(scores[s] - top);
    total += scores[s];
  }
  return total;
}

#if !defined(__AVX512F__) && (defined(__AVX2__) || defined(SPECDECODE_NEON))
// The 256-bit (AVX2) and 128-bit (NEON) paths, for D a multiple of their W lanes: the query
// heads that share a KV head (up to MAX_HEADS at a time) attend together, with attend_one's
// arithmetic for each (the same products summed in the same order, so the same bits). Each
// key or value vector is loaded (and widened) once for all of them, NK slots are scored side
// by side (independent chains over one load of each query), and the weighted sums keep C
// vectors of each head's output in registers over all the slots, a chunk of D at a time.
// (attend_one's dot() is one chain of dependent multiply-adds per slot, and its axpy() takes
// the output through memory per slot.)
#define SPECDECODE_GROUPED_HEADS 1
#if defined(__AVX2__)
using Vec = __m256;
constexpr int64_t W = V8;
constexpr int SCORE_SUMS = 9;  // score sums in registers (of 16: also the queries, a key)
constexpr int VALUE_SUMS = 9;  // output sums in registers (also the weights, a value)
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return load8(p); }
inline Vec vload(const BFloat16* p) { return load8(p); }
inline Vec vfma(Vec a, Vec b, Vec acc) { return _mm256_fmadd_ps(a, b, acc); }
inline float vsum(Vec v) { return sum8(v); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#else
using Vec = float32x4_t;
constexpr int64_t W = V4;
constexpr int SCORE_SUMS = 20;  // of the 32 registers
constexpr int VALUE_SUMS = 20;
inline Vec vzero() { return vdupq_n_f32(0.f); }
inline Vec vset(float x) { return vdupq_n_f32(x); }
inline Vec vload(const float* p) { return load4(p); }
inline Vec vload(const BFloat16* p) { return load4(p); }
inline Vec vfma(Vec a, Vec b, Vec acc) { return vfmaq_f32(acc, a, b); }
inline float vsum(Vec v) { return vaddvq_f32(v); }
inline void vstore(float* p, Vec v) { vst1q_f32(p, v); }
#endif
constexpr int MAX_HEADS = 4;  // query heads attending together, at most

// scores [NH, span] = qf [NH, D] . k[slot] for every slot (dot()'s sums per head).
template <int NH, typename scalar_t, typename Slots>
void score_heads(const float* qf, const scalar_t* k, const Slots& slots, int64_t D,
                 float* scores) {
  constexpr int NK = SCORE_SUMS / NH;  // slots side by side
  const int64_t span = slots.size();
  int64_t s = 0;
  for (; s + NK <= span; s += NK) {
    const scalar_t* key[NK];
    Vec acc[NH][NK];
    UNROLL for (int j = 0; j < NK; ++j) {
      key[j] = k + slots[s + j];
      UNROLL for (int i = 0; i < NH; ++i) acc[i][j] = vzero();
    }
    for (int64_t d = 0; d < D; d += W) {
      Vec qv[NH];
      UNROLL for (int i = 0; i < NH; ++i) qv[i] = vload(qf + i * D + d);
      UNROLL for (int j = 0; j < NK; ++j) {
        const Vec kv = vload(key[j] + d);
        UNROLL for (int i = 0; i < NH; ++i) acc[i][j] = vfma(qv[i], kv, acc[i][j]);
      }
    }
    UNROLL for (int i = 0; i < NH; ++i)
      UNROLL for (int j = 0; j < NK; ++j) scores[i * span + s + j] = vsum(acc[i][j]);
  }
  for (; s < span; ++s)
    for (int i = 0; i < NH; ++i) scores[i * span + s] = dot(qf + i * D, k + slots[s], D);
}

// out [NH, D] columns d0 .. d0 + C * W - 1 = the sum over the slots, in order, of
// p[i][s] * v[slot s] (axpy()'s sums per head).
template <int NH, int C, typename scalar_t, typename Slots>
void weigh_chunk(const float* p, const scalar_t* v, const Slots& slots, int64_t D, int64_t d0,
                 float* out) {
  const int64_t span = slots.size();
  Vec acc[NH][C];
  UNROLL for (int i = 0; i < NH; ++i) UNROLL for (int c = 0; c < C; ++c) acc[i][c] = vzero();
  for (int64_t s = 0; s < span; ++s) {
    Vec weight[NH];
    UNROLL for (int i = 0; i < NH; ++i) weight[i] = vset(p[i * span + s]);
    const scalar_t* value = v + slots[s] + d0;
    UNROLL for (int c = 0; c < C; ++c) {
      const Vec x = vload(value + c * W);
      UNROLL for (int i = 0; i < NH; ++i) acc[i][c] = vfma(weight[i], x, acc[i][c]);
    }
  }
  UNROLL for (int i = 0; i < NH; ++i)
    UNROLL for (int c = 0; c < C; ++c) vstore(out + i * D + d0 + c * W, acc[i][c]);
}

// out [NH, D] = the weighted sums of every head, C vectors of D at a time.
template <int NH, typename scalar_t, typename Slots>
void weigh_heads(const float* p, const scalar_t* v, const Slots& slots, int64_t D, float* out) {
  constexpr int C = VALUE_SUMS / NH;
  int64_t d0 = 0;
  for (; d0 + C * W <= D; d0 += C * W) weigh_chunk<NH, C>(p, v, slots, D, d0, out);
  if (d0 < D)  // the last, shorter chunk
    with_count<C>((D - d0) / W, [&](auto rest) {
      weigh_chunk<NH, decltype(rest)::value>(p, v, slots, D, d0, out);
    });
}

// attend_one for nh (<= MAX_HEADS) query heads q[i] that share the KV head at k, v.
template <typename scalar_t, typename Slots>
void attend_heads(int64_t nh, const scalar_t* const* q, const scalar_t* k, const scalar_t* v,
                  const Slots& slots, int64_t D, float scale, float cap, scalar_t* const* out,
                  std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t span = slots.size();
  qf.resize(nh * D);
  for (int64_t i = 0; i < nh; ++i)
    for (int64_t d = 0; d < D; ++d) qf[i * D + d] = widen(q[i][d]) * scale;
  scores.resize(nh * span);
  acc.resize(nh * D);
  with_count<MAX_HEADS>(nh, [&](auto heads) {
    constexpr int NH = decltype(heads)::value;
    score_heads<NH>(qf.data(), k, slots, D, scores.data());
    float total[NH];
    for (int i = 0; i < NH; ++i) total[i] = exp_shifted(scores.data() + i * span, span, cap);
    weigh_heads<NH>(scores.data(), v, slots, D, acc.data());
    for (int i = 0; i < NH; ++i) {
      const float inv = 1.f / total[i];
      for (int64_t d = 0; d < D; ++d) out[i][d] = scalar_t(acc[i * D + d] * inv);
    }
  });
}
#endif

template <typename scalar_t, typename Slots>
void attend_one(const scalar_t* q, const scalar_t* k, const scalar_t* v, const Slots& slots, int64_t D, float scale, float cap, scalar_t* out,
                std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t span = slots.size();
  qf.resize(D);
  for (int64_t d = 0; d < D; ++d) qf[d] = widen(q[d]) * scale;
  scores.resize(span);
  for (int64_t s = 0; s < span; ++s) scores[s] = dot(qf.data(), k + slots[s], D);
  const float total = exp_shifted(scores.data(), span, cap);
  acc.assign(D, 0.f);
  for (int64_t s = 0; s < span; ++s) axpy(scores[s], v + slots[s], acc.data(), D);
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = scalar_t(acc[d] * inv);
}

#if defined(__AVX512F__)
// attend_one for D = 16 * C with the query and the output kept in registers: the same products
// summed in the same order (so the same bits), without a trip through memory per slot.
template <int C, typename scalar_t, typename Slots>
void attend_one_registers(const scalar_t* q, const scalar_t* k, const scalar_t* v, const Slots& slots, float scale, float cap, scalar_t* out,
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
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// attend_one for bf16 and D = 32 * C, in registers: the scores as bf16 pair dot products of q
// and k as they are (products exact in fp32, q's scale applied to the sum), the values widened
// by shifts (even and odd values in separate lanes) and summed over the slots in order.
template <int C, typename Slots>
void attend_bf16(const BFloat16* q, const BFloat16* k, const BFloat16* v, const Slots& slots, float scale,
                 float cap, BFloat16* out, std::vector<float>& scores) {
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
#endif

// One query: the attention over `slots` with the fastest exact routine for its dtype and D.
template <typename scalar_t, typename Slots>
void attend(const scalar_t* q, const scalar_t* keys, const scalar_t* values, const Slots& slots,
            int64_t D, float scale, float cap, scalar_t* out, std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<scalar_t, BFloat16>) {
    if (D == 64 || D == 128) {
      auto run = D == 64 ? attend_bf16<2, Slots> : attend_bf16<4, Slots>;
      run(q, keys, values, slots, scale, cap, out, scores);
      return;
    }
  }
#endif
#if defined(__AVX512F__)
  if (D == 64 || D == 128) {
    auto run = D == 64 ? attend_one_registers<4, scalar_t, Slots>
                       : attend_one_registers<8, scalar_t, Slots>;
    run(q, keys, values, slots, scale, cap, out, scores);
    return;
  }
#endif
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
#if defined(SPECDECODE_GROUPED_HEADS)
  if (D % W == 0) {
    // Tasks run (row, query, KV head, block of the KV head's query heads), blocks fastest: at
    // most MAX_HEADS heads a block, and more, smaller blocks where the pool has more threads
    // than (row, query, KV head) units. A head's bits do not depend on its block.
    const int64_t units = shape.B * Tq * shape.Hkv;
    const int64_t fewest = (group + MAX_HEADS - 1) / MAX_HEADS;
    const int64_t blocks =
        std::min(group, std::max(fewest, (max_threads() + units - 1) / units));
    parallel_for(0, units * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf, scores, acc;  // per thread, see attend_heads
      std::vector<int64_t> offsets;
      int64_t query = -1;  // the (row, token) whose offsets `offsets` holds
      const T* qs[MAX_HEADS];
      T* outs[MAX_HEADS];
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
        attend_heads(h1 - h0, qs, k + head, v + head, slots, D, scale, cap, outs, qf, scores,
                     acc);
      }
    });
    return;
  }
#endif
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
