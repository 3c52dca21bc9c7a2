// CPU matmuls y = x @ W^T (+ b) for the model's projections: they read the weights at memory
// bandwidth when a pass holds few tokens (decode, draft verification) and stay
// compute-efficient for long passes (prefill). Python packs the weights (kernels/__init__.py).
//
// int8_linear: W int8 with one fp32 scale per output row; each activation row is quantized on
//   the fly to int8 with its own scale (absmax / 127). Integer sums (AVX-512 VNNI `vpdpbusd`
//   where the compiler targets it, plain C++ elsewhere) are exact, so a token's output never
//   depends on the other tokens of the pass.
// bf16_linear: W and x bf16, products summed in fp32 (AVX-512 BF16 `vdpbf16ps` where
//   available, fp32 multiply-adds elsewhere). Each output element is summed in one fixed order
//   whatever the number of tokens, so this kernel is row-exact too.
//
// Packed layout: W [N, K], zero-padded to [Np, Kp], stored as [Np / ROWS, Kp / P, ROWS, P] with
// P values of a row per 32-bit lane (P = 4 int8 or 2 bf16). A tile is ROWS output rows x up to
// TOKENS tokens and reads one sequential stream; each 64-byte weight vector holds P columns of
// 16 rows and meets, per token, those P activations broadcast to every lane. So every lane
// accumulates one (row, token) pair by itself: no horizontal sums, and the same order of
// summation whatever the tile shape. Compiled with -ffp-contract=off so the fp32 epilogue
// rounds exactly as the Python reference does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Full unrolling of the tile loops lets the compiler keep every accumulator in a register.
#define UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int64_t LANES = 16;             // fp32 / int32 lanes per vector: rows per group
constexpr int64_t GROUPS = 4;             // row groups per tile
constexpr int64_t ROWS = GROUPS * LANES;  // output rows per tile
constexpr int64_t TOKENS = 4;             // tokens per tile, at most
constexpr int64_t I8_PACK = 4;            // int8 values of a row per 32-bit lane
constexpr int64_t BF16_PACK = 2;          // bf16 values of a row per 32-bit lane
constexpr int64_t TASK_BYTES = 1 << 16;   // weight bytes per parallel task, at least

// A tile's weights: one packed block [Kp / P, GROUPS, LANES, P] (P = I8_PACK or BF16_PACK), so
// the 32-bit lane l of vector (j, g) holds row g * LANES + l, columns j * P .. j * P + P - 1.
// Each lane accumulates one (row, token) pair: the kernel needs no horizontal sums, and the
// order in which a lane sums its products is the same for every tile shape.

// ---------------------------------------------------------------- int8

// acc[g][t] lane l = sum_k a[t][k] * b[row g * 16 + l][k]: a u8 codes [T, lda] (lda % 4 == 0).
template <int T>
void dot_u8s8(const uint8_t* a, int64_t lda, const int8_t* b, int64_t Kp,
              int32_t acc[GROUPS][T][LANES]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i sum[GROUPS][T];
  UNROLL for (int g = 0; g < GROUPS; ++g)
    UNROLL for (int t = 0; t < T; ++t) sum[g][t] = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += I8_PACK, b += ROWS * I8_PACK) {
    __m512i av[T];  // 4 codes of token t, repeated in every lane
    UNROLL for (int t = 0; t < T; ++t) {
      int32_t four;
      std::memcpy(&four, a + t * lda + k, sizeof(four));
      av[t] = _mm512_set1_epi32(four);
    }
    UNROLL for (int g = 0; g < GROUPS; ++g) {
      const __m512i bv = _mm512_loadu_si512(b + g * LANES * I8_PACK);
      UNROLL for (int t = 0; t < T; ++t) sum[g][t] = _mm512_dpbusd_epi32(sum[g][t], av[t], bv);
    }
  }
  UNROLL for (int g = 0; g < GROUPS; ++g)
    UNROLL for (int t = 0; t < T; ++t) _mm512_storeu_si512(acc[g][t], sum[g][t]);
#else
  std::memset(acc, 0, sizeof(int32_t) * GROUPS * T * LANES);
  for (int64_t k = 0; k < Kp; k += I8_PACK, b += ROWS * I8_PACK)
    for (int g = 0; g < GROUPS; ++g)
      for (int t = 0; t < T; ++t)
        for (int64_t l = 0; l < LANES; ++l)
          for (int64_t p = 0; p < I8_PACK; ++p)
            acc[g][t][l] += int32_t(a[t * lda + k + p]) *
                            int32_t(b[(g * LANES + l) * I8_PACK + p]);
#endif
}

// x row [K] -> u8 codes [Kp] = q + 128 (q = round(x * 127 / absmax) in [-127, 127], 0 past K)
// and its scale absmax / 127.
template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t K, int64_t Kp, uint8_t* codes, float* scale) {
  float absmax = 0.f;
  for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::abs(float(x[k])));
  absmax = std::max(absmax, 1e-8f);
  const float inv = 127.f / absmax;
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::nearbyint(float(x[k]) * inv);
    codes[k] = uint8_t(int32_t(std::min(127.f, std::max(-127.f, q))) + 128);
  }
  std::fill(codes + K, codes + Kp, uint8_t(128));
  *scale = absmax / 127.f;
}

// ---------------------------------------------------------------- bf16

// acc[g][t] lane l = sum_k a[t][k] * b[row g * 16 + l][k] in fp32, pairs of k in order:
// a bf16 [T, lda] (lda even).
template <int T>
void dot_bf16(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t Kp,
              float acc[GROUPS][T][LANES]) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  __m512 sum[GROUPS][T];
  UNROLL for (int g = 0; g < GROUPS; ++g)
    UNROLL for (int t = 0; t < T; ++t) sum[g][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += BF16_PACK, b += ROWS * BF16_PACK) {
    __m512bh av[T];  // 2 values of token t, repeated in every lane
    UNROLL for (int t = 0; t < T; ++t) {
      int32_t two;
      std::memcpy(&two, a + t * lda + k, sizeof(two));
      av[t] = (__m512bh)_mm512_set1_epi32(two);
    }
    UNROLL for (int g = 0; g < GROUPS; ++g) {
      const __m512bh bv = (__m512bh)_mm512_loadu_si512(b + g * LANES * BF16_PACK);
      UNROLL for (int t = 0; t < T; ++t) sum[g][t] = _mm512_dpbf16_ps(sum[g][t], av[t], bv);
    }
  }
  UNROLL for (int g = 0; g < GROUPS; ++g)
    UNROLL for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc[g][t], sum[g][t]);
#else
  std::memset(acc, 0, sizeof(float) * GROUPS * T * LANES);
  for (int64_t k = 0; k < Kp; k += BF16_PACK, b += ROWS * BF16_PACK)
    for (int g = 0; g < GROUPS; ++g)
      for (int t = 0; t < T; ++t)
        for (int64_t l = 0; l < LANES; ++l)
          for (int64_t p = BF16_PACK - 1; p >= 0; --p)
            acc[g][t][l] += float(a[t * lda + k + p]) *
                            float(b[(g * LANES + l) * BF16_PACK + p]);
#endif
}

// ---------------------------------------------------------------- tiling

template <int V>
using Int = std::integral_constant<int, V>;

// Calls tile(Int<T>, block, m0) for every block of ROWS rows and every group of T tokens
// starting at m0 (T = TOKENS, the last group the remainder); blocks are split across threads.
template <class Tile>
void for_each_tile(int64_t blocks, int64_t M, int64_t block_bytes, const Tile& tile) {
  const int64_t grain = std::max<int64_t>(1, TASK_BYTES / block_bytes);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      for (int64_t m0 = 0; m0 < M; m0 += TOKENS) {
        switch (std::min(TOKENS, M - m0)) {
          case 4: tile(Int<4>(), block, m0); break;
          case 3: tile(Int<3>(), block, m0); break;
          case 2: tile(Int<2>(), block, m0); break;
          default: tile(Int<1>(), block, m0);
        }
      }
  });
}

// Checks a packed weight [Np / ROWS, Kp / pack, ROWS, pack] against x [..., K], out_features
// N and bias; returns Kp.
int64_t check_packed(const at::Tensor& x, const at::Tensor& w, at::ScalarType wtype,
                     int64_t pack, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "specdecode kernels run on the CPU");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == ROWS && w.size(3) == pack &&
                  w.scalar_type() == wtype && w.is_contiguous(),
              "weight must be packed as a contiguous [Np/", ROWS, ", Kp/", pack, ", ", ROWS,
              ", ", pack, "] ", wtype, " tensor, got ", w.sizes(), " ", w.scalar_type());
  const int64_t Kp = w.size(1) * pack;
  TORCH_CHECK(x.size(-1) <= Kp && Kp - x.size(-1) < pack, "x has ", x.size(-1),
              " features, the packed weight ", Kp);
  TORCH_CHECK(N <= w.size(0) * ROWS && w.size(0) * ROWS - N < ROWS, "out_features ", N,
              " does not fit the packed weight's ", w.size(0) * ROWS, " rows");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat &&
                                    bias->is_contiguous() && bias->numel() == N),
              "bias must be a contiguous fp32 [", N, "] tensor");
  return Kp;
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return shape;
}

}  // namespace

// x [..., K] fp32 or bf16; w int8 packed [Np/64, Kp/4, 64, 4]; w_scale fp32 [Np];
// w_sum int32 [Np] (row sums of w); bias fp32 [N] or None. Returns [..., N] in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& w_sum, const c10::optional<at::Tensor>& bias,
                       int64_t N) {
  const int64_t Kp = check_packed(x, w, at::kChar, I8_PACK, N, bias);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_sum.scalar_type() == at::kInt &&
                  w_scale.numel() == w.size(0) * ROWS && w_sum.numel() == w.size(0) * ROWS,
              "w_scale must be fp32 and w_sum int32, one per packed row");
  const int64_t K = x.size(-1);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();  // [M, K]
  const int64_t M = rows.size(0);
  std::vector<uint8_t> codes(M * Kp);  // [M, Kp] u8
  std::vector<float> x_scale(M);       // [M]
  auto quantize = [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const scalar_t* data = rows.data_ptr<scalar_t>();
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        quantize_row(data + m * K, K, Kp, codes.data() + m * Kp, x_scale.data() + m);
    });
  };
  fp32_or_bf16(rows.scalar_type(), "int8_linear", quantize);
  at::Tensor y = at::empty({M, N}, rows.options());  // [M, N] in x's dtype
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* ws = w_scale.data_ptr<float>();
  const int32_t* wsum = w_sum.data_ptr<int32_t>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto run = [&](auto type_tag) {
    using out_t = decltype(type_tag);
    out_t* yp = y.data_ptr<out_t>();
    for_each_tile(w.size(0), M, ROWS * Kp, [&](auto tokens, int64_t block, int64_t m0) {
      constexpr int T = decltype(tokens)::value;
      int32_t acc[GROUPS][T][LANES];
      dot_u8s8<T>(codes.data() + m0 * Kp, Kp, wp + block * ROWS * Kp, Kp, acc);
      for (int64_t g = 0; g < GROUPS; ++g)
        for (int64_t l = 0; l < LANES; ++l) {
          const int64_t n = block * ROWS + g * LANES + l;
          if (n >= N) break;
          for (int t = 0; t < T; ++t) {
            const int32_t dot = acc[g][t][l] - 128 * wsum[n];  // codes carry +128
            float v = float(dot) * (x_scale[m0 + t] * ws[n]);
            if (b != nullptr) v = v + b[n];
            yp[(m0 + t) * N + n] = out_t(v);  // rounded once to x's dtype
          }
        }
    });
  };
  fp32_or_bf16(rows.scalar_type(), "int8_linear", run);
  return y.view(out_shape(x, N));
}

// x [..., K] bf16; w bf16 packed [Np/64, Kp/2, 64, 2]; bias fp32 [N] or None.
// Returns [..., N] bf16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias, int64_t N) {
  const int64_t Kp = check_packed(x, w, at::kBFloat16, BF16_PACK, N, bias);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bf16, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  at::Tensor rows = x.reshape({-1, K});  // [M, K]
  rows = K == Kp ? rows.contiguous() : at::constant_pad_nd(rows, {0, Kp - K});  // [M, Kp]
  const int64_t M = rows.size(0);
  at::Tensor y = at::empty({M, N}, rows.options());  // [M, N] bf16
  const at::BFloat16* xp = rows.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  for_each_tile(w.size(0), M, ROWS * Kp * 2, [&](auto tokens, int64_t block, int64_t m0) {
    constexpr int T = decltype(tokens)::value;
    float acc[GROUPS][T][LANES];
    dot_bf16<T>(xp + m0 * Kp, Kp, wp + block * ROWS * Kp, Kp, acc);
    for (int64_t g = 0; g < GROUPS; ++g)
      for (int64_t l = 0; l < LANES; ++l) {
        const int64_t n = block * ROWS + g * LANES + l;
        if (n >= N) break;
        for (int t = 0; t < T; ++t)
          yp[(m0 + t) * N + n] = at::BFloat16(b != nullptr ? acc[g][t][l] + b[n] : acc[g][t][l]);
      }
  });
  return y.view(out_shape(x, N));
}

// What the compiler targeted, per kernel: "avx512-vnni" / "avx512-bf16" or "portable".
std::string isa() {
  std::string int8 = "portable", bf16 = "portable";
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  int8 = "avx512-vnni";
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  bf16 = "avx512-bf16";
#endif
  return "int8: " + int8 + ", bf16: " + bf16;
}
