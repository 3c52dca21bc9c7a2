// Attention for decode and verification passes: every (row, head, new token) attends by itself
// over exactly the cache slots it may see, with the same arithmetic a 1-token step uses, so its
// output is bit for bit independent of how many tokens the pass holds (what exact verification
// needs), in one call instead of one Python-level attention per token.
//
// Query t of batch row b reads slots 0 .. starts[b] + t; in a tree pass it reads slots
// 0 .. tree_starts[b] - 1 and then the slots tree_starts[b] + r that its mask row allows (its
// ancestors and itself), in increasing order: the same keys in the same order as a chain pass
// over its own path, so the same bits. Scores q.k * scale, the softmax and the
// weighted sum of values are all in fp32 (bf16 inputs are widened, never rounded in between;
// bf16 scores of head size 64 / 128 are sums of exact bf16 products, scaled after the sum);
// the output is rounded once to q's dtype. Query head h reads KV head h / (H / Hkv). A query's
// arithmetic depends only on its own span, never on the other queries of the call. The
// AVX-512 and AVX2 variants sum in vectors of 16 and 8 lanes: their last bits may differ from
// each other's, never between the passes of one variant.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t V = 16;  // fp32 lanes per vector

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return float(x); }

// The slots one query reads, in order. Contiguous: 0 .. n - 1 (decode and chain passes).
struct Contiguous {
  int64_t n;
  int64_t size() const { return n; }
  int64_t operator[](int64_t i) const { return i; }
};

// Tree: 0 .. prefix - 1, then prefix + extra[j] for j < count (extra increasing).
struct Listed {
  int64_t prefix;
  const int64_t* extra;
  int64_t count;
  int64_t size() const { return prefix + count; }
  int64_t operator[](int64_t i) const { return i < prefix ? i : prefix + extra[i - prefix]; }
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
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
inline __m256 load8(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
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
#endif
  for (; d < D; ++d) out[d] += p * widen(v[d]);
}

// scores[0:n] -> exp(scores - max), returns their sum.
float exp_shifted(float* scores, int64_t n) {
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
#endif
  for (; s < n; ++s) {
    scores[s] = std::exp(scores[s] - top);
    total += scores[s];
  }
  return total;
}

template <typename scalar_t, typename Slots>
void attend_one(const scalar_t* q, const scalar_t* k, int64_t k_row, const scalar_t* v,
                int64_t v_row, const Slots& slots, int64_t D, float scale, scalar_t* out,
                std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t span = slots.size();
  qf.resize(D);
  for (int64_t d = 0; d < D; ++d) qf[d] = widen(q[d]) * scale;
  scores.resize(span);
  for (int64_t s = 0; s < span; ++s) scores[s] = dot(qf.data(), k + slots[s] * k_row, D);
  const float total = exp_shifted(scores.data(), span);
  acc.assign(D, 0.f);
  for (int64_t s = 0; s < span; ++s) axpy(scores[s], v + slots[s] * v_row, acc.data(), D);
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = scalar_t(acc[d] * inv);
}

#if defined(__AVX512F__)
// attend_one for D = 16 * C with the query and the output kept in registers: the same products
// summed in the same order (so the same bits), without a trip through memory per slot.
template <int C, typename scalar_t, typename Slots>
void attend_one_registers(const scalar_t* q, const scalar_t* k, int64_t k_row, const scalar_t* v,
                          int64_t v_row, const Slots& slots, float scale, scalar_t* out,
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
    const scalar_t* key = k + slots[s] * k_row;
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) sum = _mm512_fmadd_ps(qv[c], load16(key + c * V), sum);
    scores[s] = _mm512_reduce_add_ps(sum);
  }
  const float total = exp_shifted(scores.data(), span);
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < span; ++s) {
    const __m512 p = _mm512_set1_ps(scores[s]);
    const scalar_t* value = v + slots[s] * v_row;
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
void attend_bf16(const at::BFloat16* q, const at::BFloat16* k, int64_t k_row,
                 const at::BFloat16* v, int64_t v_row, const Slots& slots, float scale,
                 at::BFloat16* out, std::vector<float>& scores) {
  constexpr int64_t PAIRS = 2 * V;  // bf16 values per vector
  const int64_t span = slots.size();
  __m512bh qv[C];
  for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + c * PAIRS);
  auto score = [&](const at::BFloat16* key) {
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
            sum[j], qv[c], (__m512bh)_mm512_loadu_si512(k + slots[s + j] * k_row + c * PAIRS));
    for (int j = 0; j < 4; ++j) scores[s + j] = _mm512_reduce_add_ps(sum[j]) * scale;
  }
  for (; s < span; ++s) scores[s] = score(k + slots[s] * k_row);
  const float total = exp_shifted(scores.data(), span);
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __m512 even[C], odd[C];
  for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  for (s = 0; s < span; ++s) {
    const __m512 p = _mm512_set1_ps(scores[s]);
    const at::BFloat16* value = v + slots[s] * v_row;
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
      out[c * PAIRS + 2 * i] = at::BFloat16(evens[i] * inv);
      out[c * PAIRS + 2 * i + 1] = at::BFloat16(odds[i] * inv);
    }
  }
}
#endif

// One query: the attention over `slots` with the fastest exact routine for its dtype and D.
template <typename scalar_t, typename Slots>
void attend(const scalar_t* q, const scalar_t* keys, int64_t k_row, const scalar_t* values,
            int64_t v_row, const Slots& slots, int64_t D, float scale, scalar_t* out,
            std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (D == 64 || D == 128) {
      auto run = D == 64 ? attend_bf16<2, Slots> : attend_bf16<4, Slots>;
      run(q, keys, k_row, values, v_row, slots, scale, out, scores);
      return;
    }
  }
#endif
#if defined(__AVX512F__)
  if (D == 64 || D == 128) {
    auto run = D == 64 ? attend_one_registers<4, scalar_t, Slots>
                       : attend_one_registers<8, scalar_t, Slots>;
    run(q, keys, k_row, values, v_row, slots, scale, out, scores);
    return;
  }
#endif
  attend_one(q, keys, k_row, values, v_row, slots, D, scale, out, qf, scores, acc);
}

}  // namespace

// q [B, H, T, D]; k, v [B, Hkv, S, D] (any strides but a contiguous last dim); starts [B]:
// query t of row b attends to slots 0 .. starts[b] + t. Tree passes also give tree_starts [B]
// and tree_mask [B, T, M] bool: query t of row b then attends to slots 0 .. tree_starts[b] - 1
// and to tree_starts[b] + r wherever tree_mask[b, t, r] (which must hold for its own slot
// starts[b] + t and for no later slot). Returns [B, H, T, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& tree_starts,
                            const c10::optional<at::Tensor>& tree_mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "specdecode kernels run on the CPU");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k, v must share a dtype");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.sizes() == k.sizes() && k.size(3) == D && H % Hkv == 0,
              "k, v must be [", B, ", Hkv, S, ", D, "] with H % Hkv == 0; got q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v need a contiguous last dim");
  TORCH_CHECK(int64_t(starts.size()) == B, "one start per batch row");
  for (const int64_t start : starts)
    TORCH_CHECK(start >= 0 && start + T <= S, "start ", start, " + ", T,
                " new tokens exceed the ", S, " cached slots");
  // Tree passes: per (row, query), the increasing offsets r past tree_starts[b] it may read.
  const bool tree = tree_mask.has_value();
  std::vector<int64_t> extra, extra_begin(B * T + 1, 0);
  if (tree) {
    const at::Tensor mask = tree_mask->to(at::kBool).contiguous();
    TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == T,
                "tree_mask must be [B, T, M] = [", B, ", ", T, ", M], got ", mask.sizes());
    TORCH_CHECK(int64_t(tree_starts.size()) == B, "one tree start per batch row");
    const int64_t M = mask.size(2);
    const bool* mp = mask.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t offset = starts[b] - tree_starts[b];  // tree slots cached before the pass
      TORCH_CHECK(offset >= 0 && offset + T <= M, "row ", b, ": tree start ", tree_starts[b],
                  " must lie in 0 .. start ", starts[b], " and the mask must cover ",
                  offset + T, " slots, got ", M);
      for (int64_t t = 0; t < T; ++t) {
        const bool* row = mp + (b * T + t) * M;
        TORCH_CHECK(row[offset + t], "row ", b, ", query ", t, ": a query must see itself");
        for (int64_t r = 0; r < M; ++r) {
          if (!row[r]) continue;
          TORCH_CHECK(r <= offset + t, "row ", b, ", query ", t, " may not see the later slot ",
                      tree_starts[b] + r);
          extra.push_back(r);
        }
        extra_begin[b * T + t + 1] = int64_t(extra.size());
      }
    }
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);  // [B, H, T, D]
  const int64_t group = H / Hkv;
  const float scale = 1.f / std::sqrt(float(D));
  auto run = [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * H * T, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf, scores, acc;  // per thread: scaled q [D], scores [span], out [D]
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / (H * T), h = task / T % H, t = task % T;
        const int64_t kvh = h / group;
        const scalar_t* keys = kp + b * k.stride(0) + kvh * k.stride(1);
        const scalar_t* values = vp + b * v.stride(0) + kvh * v.stride(1);
        if (tree) {
          const int64_t first = extra_begin[b * T + t], count = extra_begin[b * T + t + 1] - first;
          const Listed slots{tree_starts[b], extra.data() + first, count};
          attend(qp + task * D, keys, k.stride(2), values, v.stride(2), slots, D, scale,
                 op + task * D, qf, scores, acc);
        } else {
          const Contiguous slots{starts[b] + t + 1};
          attend(qp + task * D, keys, k.stride(2), values, v.stride(2), slots, D, scale,
                 op + task * D, qf, scores, acc);
        }
      }
    });
  };
  fp32_or_bf16(q.scalar_type(), "decode_attention", run);
  return out;
}
