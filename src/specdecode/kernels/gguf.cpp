// y = x @ W^T (+ b) for weights kept in GGUF's block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K, Q6_K), with activations quantized to int8 per block of 32, as llama.cpp's CPU
// backend does, and integer dot products (AVX-512 VNNI `vpdpbusd`; plain C++ elsewhere).
//
// Every format is one case of a two-level block code (Python repacks the GGUF blocks once at
// load time, model/gguf_blocks.py, keeping every quantized value and scale as it is):
//   w[n][k] = D[n][s] * sc[n][j] * q[n][k] - M[n][s] * mn[n][j]
// q: BITS-bit unsigned codes; superblock s of SUBS sub-blocks of S values each; D and M fp16 per
// (row, superblock); sc (and mn) int8 per (row, sub-block), or 1 when SUBS == 1. MINS says what
// mn is: 0 -> 1, 1 -> its own int8 table (Q4_K, Q5_K), 2 -> sc itself (Q6_K: M = 32 D).
// E.g. Q4_0: q in 0..15, D = d, M = 8 d; Q4_K: D = d, M = dmin, sc and mn its 6-bit scales.
//
// Activations (gguf_quantize): each token's row in blocks of 32: dx = absmax / 127 and
// x8 = round(x / dx); mx = dx * (sum of the sub-block's x8) per sub-block of 16 and of 32.
// Then a sub-block contributes  isum * (D sc) * dx - (M mn) * mx  with isum = sum q * x8 exact
// in int32. A tile is 16 rows (one per 32-bit lane) by up to 8 tokens; each lane accumulates one
// (row, token) pair, in the same order whatever the number of tokens in the pass, so a token's
// output never depends on the others (row-exact). Compiled with -ffp-contract=off; the portable
// path spells the same fused multiply-adds with std::fma, so it rounds as the vector path does.
//
// Packed layout of one tile of 16 rows, per superblock (SUBS * S values):
//   D fp16 [16], M fp16 [16], sc int8 [SUBS][16] (SUBS > 1), mn int8 [SUBS][16] (MINS == 1),
//   then per sub-block j, 16 * S * BITS / 8 bytes of codes:
//   - BITS 8: [S / 4 quads][16 lanes][4]: byte b of lane l = q[row l][4 c + b];
//   - else nibbles [S / 8][16 lanes][4]: byte b of lane l of vector v holds q[l][8 v + b] in
//     its low and q[l][8 v + 4 + b] in its high nibble; then BITS - 4 bit planes, each
//     [S / 4 quads] 64-bit masks: bit 4 l + b of quad c's mask = bit (4 + p) of q[l][4 c + b].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "dispatch.h"
#include "tiles.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t ACT_BLOCK = 32;   // activation values per int8 scale
constexpr int GGUF_TOKENS = 8;      // tokens per tile, at most

// The packed geometry of one layout (see the header).
struct Layout {
  int64_t bits, sub, subs, mins;  // BITS, S, SUBS, MINS
  int64_t sub_bytes() const { return LANES * sub * bits / 8; }
  int64_t header_bytes() const {
    return 2 * LANES * 2 + (subs > 1 ? subs * LANES : 0) + (mins == 1 ? subs * LANES : 0);
  }
  int64_t superblock_bytes() const { return header_bytes() + subs * sub_bytes(); }
  int64_t superblock_values() const { return sub * subs; }
};

// ---------------------------------------------------------------- activations

// One token's row x [K] (K % 32 == 0) -> x8 [K], dx [K / 32], mx16 [K / 16], mx32 [K / 32].
template <typename scalar_t>
void quantize_act_row(const scalar_t* x, int64_t K, int8_t* x8, float* dx, float* mx16,
                      float* mx32) {
  for (int64_t b = 0; b < K / ACT_BLOCK; ++b) {
    const scalar_t* xb = x + b * ACT_BLOCK;
    float absmax = 0.f;
    for (int64_t i = 0; i < ACT_BLOCK; ++i) absmax = std::max(absmax, std::abs(float(xb[i])));
    const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
    int32_t sums[2] = {0, 0};
    for (int64_t i = 0; i < ACT_BLOCK; ++i) {
      const float q = std::nearbyint(float(xb[i]) * inv);
      const int32_t code = int32_t(std::min(127.f, std::max(-127.f, q)));
      x8[b * ACT_BLOCK + i] = int8_t(code);
      sums[i / 16] += code;
    }
    const float scale = absmax / 127.f;
    dx[b] = scale;
    mx16[2 * b] = scale * float(sums[0]);
    mx16[2 * b + 1] = scale * float(sums[1]);
    mx32[b] = scale * float(sums[0] + sums[1]);
  }
}

// ---------------------------------------------------------------- weights

// The u8 codes of quad c (values 4 c .. 4 c + 3 of each of the 16 rows) of one tile's
// sub-block at `codes`, one row per 32-bit lane.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int BITS, int S>
inline __m512i quad_codes(const uint8_t* codes, int c) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(codes + c * 64);
  } else {
    const __m512i nibbles = _mm512_loadu_si512(codes + (c / 2) * 64);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i q = (c % 2 == 0) ? _mm512_and_si512(nibbles, low4)
                             : _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low4);
    const uint8_t* planes = codes + S * 8;
    UNROLL for (int p = 0; p < BITS - 4; ++p) {
      uint64_t bits;
      std::memcpy(&bits, planes + p * S * 2 + c * 8, sizeof(bits));
      q = _mm512_mask_add_epi8(q, __mmask64(bits), q, _mm512_set1_epi8(char(16 << p)));
    }
    return q;
  }
}
#endif

// Code of value k (0 <= k < S) of lane l of one tile's sub-block at `codes` (portable path).
template <int BITS, int S>
inline int32_t code_at(const uint8_t* codes, int64_t l, int64_t k) {
  const int64_t c = k / 4, b = k % 4;
  if constexpr (BITS == 8) {
    return codes[c * 64 + l * 4 + b];
  } else {
    const uint8_t byte = codes[(c / 2) * 64 + l * 4 + b];
    int32_t q = (c % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
    const uint8_t* planes = codes + S * 8;
    for (int p = 0; p < BITS - 4; ++p) {
      uint64_t bits;
      std::memcpy(&bits, planes + p * S * 2 + c * 8, sizeof(bits));
      q += int32_t((bits >> (4 * l + b)) & 1) << (4 + p);
    }
    return q;
  }
}

inline float half_to_float(uint16_t h) { return float(c10::Half(h, c10::Half::from_bits())); }

// Tokens' activations for a tile: T rows of x8 (stride K), dx (stride K / 32) and mx (the
// sub-block sums for sub-blocks of S values, stride K / S).
struct Acts {
  const int8_t* x8;
  const float* dx;
  const float* mx;
  int64_t K;
};

// acc[t][l] = sum over the superblocks of row l's by token t's contributions (see the header);
// blk is one packed tile (16 rows) of nsb superblocks.
template <int BITS, int S, int SUBS, int MINS, int T>
void gguf_tile(const uint8_t* blk, int64_t nsb, const Acts& a, float acc[T][LANES]) {
  const Layout layout{BITS, S, SUBS, MINS};
  const int64_t header = layout.header_bytes(), sub_bytes = layout.sub_bytes();
  const int64_t sb_bytes = layout.superblock_bytes();
  const int64_t ld_mx = a.K / S, ld_dx = a.K / ACT_BLOCK;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 4 * LANES);
  const int8_t* mn = sc + SUBS * LANES;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // One token alone sums even and odd quads apart (shorter dependency chains; integer sums
  // are exact in any order).
  constexpr int P = T == 1 ? 2 : 1;
  __m512 sum[T];
  UNROLL for (int t = 0; t < T; ++t) sum[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const int64_t at = s * sb_bytes;
    const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + at)));
    const __m512 M = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + at + 32)));
    UNROLL for (int j = 0; j < SUBS; ++j) {
      const int64_t sub = s * SUBS + j;  // the sub-block's index in the row
      const int64_t k0 = sub * S;
      __m512 ds = D, ms = M;
      if constexpr (SUBS > 1) {
        const __m512 scale = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sc + at + j * LANES))));
        ds = _mm512_mul_ps(ds, scale);
        if constexpr (MINS == 2) ms = _mm512_mul_ps(ms, scale);
      }
      if constexpr (MINS == 1) {
        const __m512 scale = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(mn + at + j * LANES))));
        ms = _mm512_mul_ps(ms, scale);
      }
      const uint8_t* codes = blk + at + header + j * sub_bytes;
      __m512i isum[P][T];
      UNROLL for (int p = 0; p < P; ++p)
        UNROLL for (int t = 0; t < T; ++t) isum[p][t] = _mm512_setzero_si512();
      UNROLL for (int c = 0; c < S / 4; ++c) {
        const __m512i q = quad_codes<BITS, S>(codes, c);
        UNROLL for (int t = 0; t < T; ++t) {
          int32_t four;
          std::memcpy(&four, a.x8 + t * a.K + k0 + 4 * c, sizeof(four));
          isum[c % P][t] = _mm512_dpbusd_epi32(isum[c % P][t], q, _mm512_set1_epi32(four));
        }
      }
      UNROLL for (int t = 0; t < T; ++t) {
        __m512i total = isum[0][t];
        if constexpr (P == 2) total = _mm512_add_epi32(total, isum[1][t]);
        const __m512 scale = _mm512_mul_ps(ds, _mm512_set1_ps(a.dx[t * ld_dx + k0 / ACT_BLOCK]));
        sum[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, sum[t]);
        sum[t] = _mm512_fnmadd_ps(ms, _mm512_set1_ps(a.mx[t * ld_mx + sub]), sum[t]);
      }
    }
  }
  UNROLL for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc[t], sum[t]);
#else
  std::memset(acc, 0, sizeof(float) * T * LANES);
  for (int64_t s = 0; s < nsb; ++s) {
    const int64_t at = s * sb_bytes;
    const uint16_t* D = reinterpret_cast<const uint16_t*>(blk + at);
    for (int j = 0; j < SUBS; ++j) {
      const int64_t sub = s * SUBS + j, k0 = sub * S;
      const uint8_t* codes = blk + at + header + j * sub_bytes;
      for (int64_t l = 0; l < LANES; ++l) {
        float ds = half_to_float(D[l]), ms = half_to_float(D[LANES + l]);
        if (SUBS > 1) {
          ds = ds * float(sc[at + j * LANES + l]);
          if (MINS == 2) ms = ms * float(sc[at + j * LANES + l]);
        }
        if (MINS == 1) ms = ms * float(mn[at + j * LANES + l]);
        for (int t = 0; t < T; ++t) {
          int32_t isum = 0;
          for (int64_t k = 0; k < S; ++k)
            isum += code_at<BITS, S>(codes, l, k) * int32_t(a.x8[t * a.K + k0 + k]);
          const float scale = ds * a.dx[t * ld_dx + k0 / ACT_BLOCK];
          acc[t][l] = std::fma(float(isum), scale, acc[t][l]);
          acc[t][l] = std::fma(-ms, a.mx[t * ld_mx + sub], acc[t][l]);
        }
      }
    }
  }
#endif
}

// Runs gguf_tile<BITS, S, SUBS, MINS> over every tile of 16 rows and group of up to
// GGUF_TOKENS tokens (tiles split across threads) and stores into y.
template <int BITS, int S, int SUBS, int MINS, typename out_t>
void gguf_matmul(const uint8_t* w, int64_t tiles, int64_t nsb, const Acts& acts, int64_t M,
                 int64_t N, const float* b, out_t* y, int64_t ldy) {
  const int64_t tile_bytes = nsb * Layout{BITS, S, SUBS, MINS}.superblock_bytes();
  auto run = [&](auto tokens, int64_t tile, int64_t m0) {
    constexpr int T = decltype(tokens)::value;
    float acc[T][LANES];
    const Acts a{acts.x8 + m0 * acts.K, acts.dx + m0 * (acts.K / ACT_BLOCK),
                 acts.mx + m0 * (acts.K / S), acts.K};
    gguf_tile<BITS, S, SUBS, MINS, T>(w + tile * tile_bytes, nsb, a, acc);
    store_rows(&acc[0][0], T, tile * LANES, N, b, y + m0 * ldy, ldy);
  };
  for_each_tile<GGUF_TOKENS>(tiles, M, tile_bytes, run);
}

}  // namespace

// x [..., K] fp32 or bf16 (K % 32 == 0) -> (x8 int8 [M, K], dx fp32 [M, K / 32],
// mx16 fp32 [M, K / 16], mx32 fp32 [M, K / 32]) with M the number of rows of x.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gguf_quantize(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "specdecode kernels run on the CPU");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % ACT_BLOCK == 0, "gguf_quantize needs K % ", ACT_BLOCK, " == 0, got ", K);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();  // [M, K]
  const int64_t M = rows.size(0);
  at::Tensor x8 = at::empty({M, K}, rows.options().dtype(at::kChar));
  const auto f32 = rows.options().dtype(at::kFloat);
  at::Tensor dx = at::empty({M, K / ACT_BLOCK}, f32), mx32 = at::empty({M, K / ACT_BLOCK}, f32);
  at::Tensor mx16 = at::empty({M, K / 16}, f32);
  fp32_or_bf16(rows.scalar_type(), "gguf_quantize", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const scalar_t* data = rows.data_ptr<scalar_t>();
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        quantize_act_row(data + m * K, K, x8.data_ptr<int8_t>() + m * K,
                         dx.data_ptr<float>() + m * (K / ACT_BLOCK),
                         mx16.data_ptr<float>() + m * (K / 16),
                         mx32.data_ptr<float>() + m * (K / ACT_BLOCK));
    });
  });
  return {x8, dx, mx16, mx32};
}

// y[:, offset : offset + N] = acts @ W^T (+ bias) for one packed GGUF weight w uint8
// [Np / 16, K / (S * SUBS), superblock bytes] of layout (bits, sub, subs, mins); acts from
// gguf_quantize; y [M, ldy] fp32 or bf16, contiguous; bias fp32 [N] or None.
void gguf_linear(const at::Tensor& x8, const at::Tensor& dx, const at::Tensor& mx16,
                 const at::Tensor& mx32, const at::Tensor& w, int64_t bits, int64_t sub,
                 int64_t subs, int64_t mins, int64_t N, const c10::optional<at::Tensor>& bias,
                 at::Tensor& y, int64_t offset) {
  const Layout layout{bits, sub, subs, mins};
  const int64_t M = x8.size(0), K = x8.size(1);
  TORCH_CHECK(x8.scalar_type() == at::kChar && x8.dim() == 2 && x8.is_contiguous(),
              "x8 must be a contiguous int8 [M, K] tensor from gguf_quantize");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() &&
                  w.size(1) * layout.superblock_values() == K &&
                  w.size(2) == layout.superblock_bytes(),
              "packed GGUF weight must be a contiguous uint8 [Np/16, K/", layout.superblock_values(),
              ", ", layout.superblock_bytes(), "] tensor for K = ", K, ", got ", w.sizes());
  TORCH_CHECK(N <= w.size(0) * LANES && w.size(0) * LANES - N < LANES, "out_features ", N,
              " does not fit the packed weight's ", w.size(0) * LANES, " rows");
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == M && offset >= 0 &&
                  offset + N <= y.size(1),
              "y must be a contiguous [M, >= offset + N] tensor");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat &&
                                    bias->is_contiguous() && bias->numel() == N),
              "bias must be a contiguous fp32 [", N, "] tensor");
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t tiles = w.size(0), nsb = w.size(1), ldy = y.size(1);
  fp32_or_bf16(y.scalar_type(), "gguf_linear", [&](auto type_tag) {
    using out_t = decltype(type_tag);
    out_t* yp = y.data_ptr<out_t>() + offset;
    const Acts acts16{x8.data_ptr<int8_t>(), dx.data_ptr<float>(), mx16.data_ptr<float>(), K};
    const Acts acts32{x8.data_ptr<int8_t>(), dx.data_ptr<float>(), mx32.data_ptr<float>(), K};
#define SPECDECODE_GGUF_CASE(BITS, S, SUBS, MINS)                                         \
  if (bits == BITS && sub == S && subs == SUBS && mins == MINS)                           \
    return gguf_matmul<BITS, S, SUBS, MINS>(wp, tiles, nsb, S == 16 ? acts16 : acts32, M, \
                                            N, b, yp, ldy);
    SPECDECODE_GGUF_CASE(4, 32, 1, 0)   // Q4_0, Q4_1
    SPECDECODE_GGUF_CASE(5, 32, 1, 0)   // Q5_0, Q5_1
    SPECDECODE_GGUF_CASE(8, 32, 1, 0)   // Q8_0
    SPECDECODE_GGUF_CASE(4, 32, 8, 1)   // Q4_K
    SPECDECODE_GGUF_CASE(5, 32, 8, 1)   // Q5_K
    SPECDECODE_GGUF_CASE(6, 16, 16, 2)  // Q6_K
#undef SPECDECODE_GGUF_CASE
    TORCH_CHECK(false, "no GGUF kernel for the layout bits=", bits, " sub=", sub,
                " subs=", subs, " mins=", mins);
  });
}
