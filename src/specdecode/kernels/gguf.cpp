// y = x @ W^T (+ b) for weights kept in GGUF's block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K, Q6_K), with activations quantized to int8 as llama.cpp's CPU backend does, and
// integer dot products (AVX-512 VNNI `vpdpbusd`, its AVX-VNNI form on 8 lanes, AVX2
// `vpmaddubsw`, NEON `sdot` on 4 lanes, plain C++ elsewhere): the same bits on every variant.
//
// Every format is one case of a two-level block code (Python repacks the GGUF blocks once at
// load time, model/gguf_blocks.py, keeping every quantized value and scale as it is):
//   w[n][k] = D[n][s] * sc[n][j] * (q[n][k] - OFF) - M[n][s] * mn[n][j]
// q: BITS-bit unsigned codes; superblock s of SUBS sub-blocks of S values each; D (and M) fp16
// per (row, superblock); sc (and mn) int8 per (row, sub-block), or 1 when SUBS == 1. MINS says
// what the M term is: 0 -> none, 1 -> M times its own int8 table mn (Q4_K, Q5_K), 2 -> M alone
// (Q4_1, Q5_1: M = -m). E.g. Q4_0: OFF = 8, D = d; Q6_K: OFF = 32, D = d, sc its scales.
//
// Activations (gguf_quantize), per token in blocks of B = S * SUBS values (the superblock): for
// B = 32 llama.cpp's Q8_0 / Q8_1 (x8 = round(x * 127 / absmax), dx = fp16(absmax / 127),
// sx = fp16(absmax / 127 * sum x8)), for B = 256 its Q8_K (dx = 1 / (127 / absmax) in fp32);
// bsum16 / bsum32: the int16 sums of x8 per 16 and per 32 values. Each superblock is then
// summed in int32 exactly as llama.cpp sums it:
//   main = sum_j sc_j * (sum_k q_k x8_k - OFF * bsum_j),  mins = sum_j mn_j * bsum_j
// and added in fp32:  y += (D dx) * main  - (M dx) * mins  (MINS 1)  or  - M * sx  (MINS 2).
// A tile is 16 rows (one per 32-bit lane) by up to GGUF_TOKENS<BITS> tokens; each lane accumulates
// one (row, token) pair, in the same order whatever the number of tokens in the pass, so a
// token's output never depends on the others (row-exact). Each instruction set's tile is in its
// arch folder (arch/<folder>/gguf_tile.h, gguf_shared.h says what it defines); this file holds
// what they share: the activations' quantization, the dispatch by layout, the loop over tiles,
// the packing. Compiled with -ffp-contract=off; the portable tile spells the same fused
// multiply-adds with std::fma, so it rounds as the vector tiles do.
//
// Packed layout of one tile of 16 rows, per superblock:
//   D fp16 [16], M fp16 [16] (MINS > 0), sc int8 [SUBS / 2][16][2] (SUBS > 1; lane l's pair
//   of sub-blocks 2p, 2p + 1 side by side), mn int8 [SUBS / 2][16][2] (MINS == 1),
//   then per sub-block j, 16 * S * BITS / 8 bytes of codes:
//   - BITS 8: [S / 4 quads][16 lanes][4]: byte b of lane l = q[row l][4 c + b];
//   - BITS 4: nibbles [S / 8][16 lanes][4]: byte b of lane l of vector v holds q[l][8 v + b]
//     in its low and q[l][8 v + 4 + b] in its high nibble;
//   - BITS 5, 6: the low 4 bits of every code as BITS 4 lays them out (16 * S / 2 bytes), then
//     a plane of their high bits, [16 lanes][4] (64 bytes: (BITS - 4) * S == 32): byte b of
//     lane l holds q[l][4 c + b] >> 4 at bits (BITS - 4) c .. (BITS - 4) (c + 1) - 1, quad c
//     from 0. A quad then decodes as a 4-bit one plus a shift and a mask of the plane.

#include "epilogue.h"  // this variant's: its arch folder (setup.py)
#include "gguf_shared.h"
#include "gguf_tile.h"  // this variant's: its arch folder (setup.py)
#include "tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace specdecode {
namespace {

inline float round_to_half(float v) { return half_to_float(float_to_half(v)); }

// ---------------------------------------------------------------- activations

// One token's row x [K] (K % B == 0) in blocks of B (32 or 256, see the header) -> x8 [K],
// dx [K / B], sx [K / B] (B == 32 only), bsum16 [K / 16], bsum32 [K / 32], in loops the
// compiler vectorizes.
typedef uint32_t alias_u32 __attribute__((may_alias));
inline uint32_t bits_of(const float* x, int64_t i) {
  return reinterpret_cast<const alias_u32*>(x)[i];
}
inline uint32_t bits_of(const BFloat16* x, int64_t i) { return uint32_t(x[i].bits) << 16; }

// The largest |x[i]| of n values, NaN left out (as std::max(absmax, NaN) leaves absmax): the
// integer max of the bit patterns of |x|, which orders them as their values (NaN's, above
// every other, masked to 0), in a loop the compiler vectorizes.
template <typename scalar_t>
float block_absmax(const scalar_t* x, int64_t n) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = bits_of(x, i) & 0x7FFFFFFFu;
    top = std::max(top, u & (0u - uint32_t(u <= 0x7F800000u)));
  }
  float absmax;
  std::memcpy(&absmax, &top, sizeof(absmax));
  return absmax;
}

template <typename scalar_t>
void quantize_act_row(const scalar_t* x, int64_t K, int64_t B, int8_t* x8, float* dx, float* sx,
                      int16_t* bsum16, int16_t* bsum32) {
  for (int64_t b = 0; b < K / B; ++b) {
    const scalar_t* xb = x + b * B;
    const float absmax = block_absmax(xb, B);
    const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
    int8_t* q8 = x8 + b * B;
    for (int64_t i = 0; i < B; ++i) {
      const float q = std::nearbyint(float(xb[i]) * inv);
      q8[i] = int8_t(int32_t(std::min(127.f, std::max(-127.f, q))));
    }
    int32_t sum = 0;  // of the block's codes
    for (int64_t g = 0; g < B / 16; ++g) {  // groups of 16 codes
      int32_t group = 0;
      for (int64_t i = 0; i < 16; ++i) group += q8[g * 16 + i];
      bsum16[b * B / 16 + g] = int16_t(group);
      sum += group;
    }
    for (int64_t g = 0; g < B / 32; ++g)
      bsum32[b * B / 32 + g] = int16_t(bsum16[b * B / 16 + 2 * g] + bsum16[b * B / 16 + 2 * g + 1]);
    if (B == 32) {  // Q8_0 / Q8_1
      const float d = absmax / 127.f;
      dx[b] = round_to_half(d);
      sx[b] = round_to_half(d * float(sum));
    } else {  // Q8_K
      dx[b] = absmax > 0.f ? 1.f / inv : 0.f;
    }
  }
}

// Runs gguf_tile<BITS, S, SUBS, OFF, MINS> over every tile of 16 rows and group of up to
// GGUF_TOKENS<BITS> tokens (tiles split across threads) and stores into y.
template <int BITS, int S, int SUBS, int OFF, int MINS, typename out_t>
void gguf_tiles(const uint8_t* w, int64_t tiles, int64_t nsb, const GgufActs& acts, int64_t M,
                int64_t N, const float* b, out_t* y, int64_t ldy) {
  const int64_t tile_bytes = nsb * GgufLayout{BITS, S, SUBS, OFF, MINS}.superblock_bytes();
  const int64_t B = S * SUBS;
  auto run = [&](auto tokens, int64_t tile, int64_t m0) {
    constexpr int T = decltype(tokens)::value;
    float acc[T][LANES];
    const GgufActs a{acts.x8 + m0 * acts.K,           acts.dx + m0 * (acts.K / B),
                     acts.sx + m0 * (acts.K / B),      acts.bsum16 + m0 * (acts.K / 16),
                     acts.bsum32 + m0 * (acts.K / 32), acts.K};
    const bool prefetch = T >= PREFETCH_FROM_TOKENS && m0 == 0 && tile + 1 < tiles;
    const uint8_t* next = prefetch ? w + (tile + 1) * tile_bytes : nullptr;
    gguf_tile<BITS, S, SUBS, OFF, MINS, T>(w + tile * tile_bytes, nsb, a, next, acc);
    store_rows(&acc[0][0], T, tile * LANES, N, b, y + m0 * ldy, ldy);
  };
  for_each_tile<GGUF_TOKENS<BITS>>(tiles, M, tile_bytes, run);
}

// Calls run(Int<BITS>, Int<S>, Int<SUBS>, Int<OFF>, Int<MINS>) for a supported layout; returns
// whether it is one.
template <class Run>
bool with_layout(const GgufLayout& l, const Run& run) {
#define SPECDECODE_GGUF_CASE(BITS, S, SUBS, OFF, MINS)                                       \
  if (l.bits == BITS && l.sub == S && l.subs == SUBS && l.off == OFF && l.mins == MINS) {    \
    run(Int<BITS>(), Int<S>(), Int<SUBS>(), Int<OFF>(), Int<MINS>());                        \
    return true;                                                                             \
  }
  SPECDECODE_GGUF_CASE(4, 32, 1, 8, 0)    // Q4_0
  SPECDECODE_GGUF_CASE(4, 32, 1, 0, 2)    // Q4_1
  SPECDECODE_GGUF_CASE(5, 32, 1, 16, 0)   // Q5_0
  SPECDECODE_GGUF_CASE(5, 32, 1, 0, 2)    // Q5_1
  SPECDECODE_GGUF_CASE(8, 32, 1, 128, 0)  // Q8_0
  SPECDECODE_GGUF_CASE(4, 32, 8, 0, 1)    // Q4_K
  SPECDECODE_GGUF_CASE(5, 32, 8, 0, 1)    // Q5_K
  SPECDECODE_GGUF_CASE(6, 16, 16, 32, 0)  // Q6_K
#undef SPECDECODE_GGUF_CASE
  return false;
}

}  // namespace

bool gguf_supported(const GgufLayout& layout) {
  return with_layout(layout, [](auto...) {});
}

template <typename T>
void gguf_quantize(const T* x, int64_t M, int64_t K, int64_t block, int8_t* x8, float* dx,
                   float* sx, int16_t* bsum16, int16_t* bsum32) {
  parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_act_row(x + m * K, K, block, x8 + m * K, dx + m * (K / block),
                       block == 32 ? sx + m * (K / block) : nullptr, bsum16 + m * (K / 16),
                       bsum32 + m * (K / 32));
  });
}

template <typename T>
void gguf_matmul(const GgufActs& acts, int64_t M, const uint8_t* w, int64_t tiles,
                 const GgufLayout& layout, const float* bias, int64_t N, T* y, int64_t ldy) {
  const int64_t nsb = acts.K / layout.superblock_values();
  with_layout(layout, [&](auto bits, auto sub, auto subs, auto off, auto mins) {
    gguf_tiles<decltype(bits)::value, decltype(sub)::value, decltype(subs)::value,
               decltype(off)::value, decltype(mins)::value>(w, tiles, nsb, acts, M, N, bias, y,
                                                            ldy);
  });
}

template void gguf_quantize(const float*, int64_t, int64_t, int64_t, int8_t*, float*, float*,
                            int16_t*, int16_t*);
template void gguf_quantize(const BFloat16*, int64_t, int64_t, int64_t, int8_t*, float*, float*,
                            int16_t*, int16_t*);
template void gguf_matmul(const GgufActs&, int64_t, const uint8_t*, int64_t, const GgufLayout&,
                          const float*, int64_t, float*, int64_t);
template void gguf_matmul(const GgufActs&, int64_t, const uint8_t*, int64_t, const GgufLayout&,
                          const float*, int64_t, BFloat16*, int64_t);

void gguf_pack_codes(const uint8_t* q, int64_t Np, int64_t K, int64_t bits, int64_t sub,
                     int64_t subs, uint8_t* out) {
  const int64_t tiles = Np / LANES, nsb = K / (sub * subs);
  const int64_t sub_bytes = LANES * sub * bits / 8;
  parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t sb = 0; sb < nsb * subs; ++sb) {  // sub-blocks of the tile, in order
        const uint8_t* rows = q + tile * LANES * K + sb * sub;
        uint8_t* o = out + (tile * nsb * subs + sb) * sub_bytes;
        auto code = [&](int64_t l, int64_t k) { return rows[l * K + k]; };
        uint8_t* plane = o + LANES * sub / 2;  // the high bits (BITS 5, 6)
        if (bits > 4) std::memset(plane, 0, 4 * LANES);
        for (int64_t c = 0; c < sub / 4; ++c) {  // quads
          for (int64_t l = 0; l < LANES; ++l)
            for (int64_t b = 0; b < 4; ++b) {
              const uint8_t v = code(l, 4 * c + b);
              if (bits == 8) {
                o[c * 64 + l * 4 + b] = v;
                continue;
              }
              // vector c / 2 holds quads c (low nibbles) and c + 1 (high nibbles)
              uint8_t& nibbles = o[(c / 2) * 64 + l * 4 + b];
              nibbles = c % 2 == 0 ? uint8_t(v & 0x0F) : uint8_t(nibbles | (v & 0x0F) << 4);
              if (bits > 4) plane[l * 4 + b] |= uint8_t((v >> 4) << ((bits - 4) * c));
            }
        }
      }
  });
}

}  // namespace specdecode
