// y = x @ W^T (+ b) for weights kept in GGUF's block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K, Q6_K), with activations quantized to int8 as llama.cpp's CPU backend does, and
// integer dot products (AVX-512 VNNI `vpdpbusd`, its AVX-VNNI form on 8 lanes, AVX2
// `vpmaddubsw`, plain C++ elsewhere): the same bits on every variant.
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
// A tile is 16 rows (one per 32-bit lane) by up to 8 tokens; each lane accumulates one
// (row, token) pair, in the same order whatever the number of tokens in the pass, so a token's
// output never depends on the others (row-exact). Compiled with -ffp-contract=off; the portable
// path spells the same fused multiply-adds with std::fma, so it rounds as the vector path does.
//
// Packed layout of one tile of 16 rows, per superblock:
//   D fp16 [16], M fp16 [16] (MINS > 0), sc int8 [SUBS / 2][16][2] (SUBS > 1; lane l's pair
//   of sub-blocks 2p, 2p + 1 side by side), mn int8 [SUBS / 2][16][2] (MINS == 1),
//   then per sub-block j, 16 * S * BITS / 8 bytes of codes:
//   - BITS 8: [S / 4 quads][16 lanes][4]: byte b of lane l = q[row l][4 c + b];
//   - BITS 4: nibbles [S / 8][16 lanes][4]: byte b of lane l of vector v holds q[l][8 v + b]
//     in its low and q[l][8 v + 4 + b] in its high nibble;
//   - BITS 5, 6: [S / 4 quads][8 lane pairs][BITS bytes]: the 8 codes q[2 i][4 c .. 4 c + 3],
//     q[2 i + 1][4 c .. 4 c + 3] of pair i as BITS-bit fields, the first in the lowest bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "dispatch.h"
#include "tiles.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

// tokens per tile, at most (AVX2 has half the vector registers: fewer tokens' sums fit)
#if !defined(__AVX512VNNI__) && defined(__AVX2__)
constexpr int GGUF_TOKENS = 4;
#else
constexpr int GGUF_TOKENS = 8;
#endif
// 4 activation bytes read as one int32 where they lie, so that the compiler can fold the load
// into vpdpbusd's broadcast operand
typedef int32_t unaligned_i32 __attribute__((aligned(1), may_alias));

// The packed geometry of one layout (see the header).
struct Layout {
  int64_t bits, sub, subs, mins;  // BITS, S, SUBS, MINS
  int64_t sub_bytes() const { return LANES * sub * bits / 8; }
  int64_t header_bytes() const {
    return (mins ? 2 : 1) * LANES * 2 + (subs > 1 ? subs * LANES : 0) +
           (mins == 1 ? subs * LANES : 0);
  }
  int64_t superblock_bytes() const { return header_bytes() + subs * sub_bytes(); }
  int64_t superblock_values() const { return sub * subs; }
};

inline float half_to_float(uint16_t h) { return float(c10::Half(h, c10::Half::from_bits())); }
inline float round_to_half(float v) { return float(c10::Half(v)); }

// ---------------------------------------------------------------- activations

// One token's row x [K] (K % B == 0) in blocks of B (32 or 256, see the header) -> x8 [K],
// dx [K / B], sx [K / B] (B == 32 only), bsum16 [K / 16], bsum32 [K / 32].
template <typename scalar_t>
void quantize_act_row(const scalar_t* x, int64_t K, int64_t B, int8_t* x8, float* dx, float* sx,
                      int16_t* bsum16, int16_t* bsum32) {
  for (int64_t b = 0; b < K / B; ++b) {
    const scalar_t* xb = x + b * B;
    float absmax = 0.f;
    for (int64_t i = 0; i < B; ++i) absmax = std::max(absmax, std::abs(float(xb[i])));
    const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
    int32_t sum = 0;  // of the block's codes
    for (int64_t g = b * B / 16; g < (b + 1) * B / 16; ++g) {  // groups of 16 codes
      int32_t group = 0;
      for (int64_t i = g * 16; i < g * 16 + 16; ++i) {
        const float q = std::nearbyint(float(x[i]) * inv);
        const int32_t code = int32_t(std::min(127.f, std::max(-127.f, q)));
        x8[i] = int8_t(code);
        group += code;
      }
      bsum16[g] = int16_t(group);
      if (g % 2 == 1) bsum32[g / 2] = int16_t(bsum16[g - 1] + group);
      sum += group;
    }
    if (B == 32) {  // Q8_0 / Q8_1
      const float d = absmax / 127.f;
      dx[b] = round_to_half(d);
      sx[b] = round_to_half(d * float(sum));
    } else {  // Q8_K
      dx[b] = absmax > 0.f ? 1.f / inv : 0.f;
    }
  }
}

// ---------------------------------------------------------------- weights

// Code of value k (0 <= k < S) of lane l of one tile's sub-block at `codes` (the layout in the
// header).
template <int BITS, int S>
inline int32_t code_at(const uint8_t* codes, int64_t l, int64_t k) {
  const int64_t c = k / 4, b = k % 4;
  if constexpr (BITS == 8) {
    return codes[c * 64 + l * 4 + b];
  } else if constexpr (BITS == 4) {
    const uint8_t byte = codes[(c / 2) * 64 + l * 4 + b];
    return (c % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
  } else {  // field (l % 2) * 4 + b of the BITS bytes of lane pair l / 2 in quad c
    const uint8_t* pair = codes + c * 8 * BITS + (l / 2) * BITS;
    const int64_t bit = ((l % 2) * 4 + b) * BITS;
    const int32_t two = pair[bit / 8] | (bit / 8 + 1 < BITS ? pair[bit / 8 + 1] << 8 : 0);
    return (two >> (bit % 8)) & ((1 << BITS) - 1);
  }
}

// The u8 codes of quad c (values 4 c .. 4 c + 3 of each of the 16 rows) of one tile's
// sub-block at `codes`, one row per 32-bit lane.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int BITS, int S>
inline __m512i quad_codes(const uint8_t* codes, int c) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(codes + c * 64);
  } else if constexpr (BITS == 4) {
    const __m512i nibbles = _mm512_loadu_si512(codes + (c / 2) * 64);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    return (c % 2 == 0) ? _mm512_and_si512(nibbles, low4)
                        : _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low4);
  } else {
#if defined(__AVX512VBMI__)
    // 8 BITS bytes per lane pair -> one 64-bit word each (vpermb), then the 8 fields of each
    // word into its 8 bytes (vpmultishiftqb) and the low BITS bits kept.
    alignas(64) static constexpr auto spread = [] {
      struct { uint8_t at[64]; } idx{};
      for (int i = 0; i < 64; ++i) idx.at[i] = uint8_t((i / 8) * BITS + std::min(i % 8, BITS - 1));
      return idx;
    }();
    // the quad's 8 BITS bytes (40 or 48) in two loads that stay inside them
    const uint8_t* at = codes + c * 8 * BITS;
    const __m128i tail = BITS == 6 ? _mm_loadu_si128((const __m128i*)(at + 32))
                                   : _mm_loadl_epi64((const __m128i*)(at + 32));
    const __m512i raw = _mm512_inserti32x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)at)), tail, 2);
    const __m512i words = _mm512_permutexvar_epi8(_mm512_load_si512(spread.at), raw);
    const __m512i shifts = _mm512_set1_epi64(int64_t(0x0706050403020100ULL * BITS));
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, words),
                            _mm512_set1_epi8(char((1 << BITS) - 1)));
#else
    alignas(64) uint8_t q[64];
    for (int l = 0; l < LANES; ++l)
      for (int b = 0; b < 4; ++b) q[l * 4 + b] = uint8_t(code_at<BITS, S>(codes, l, 4 * c + b));
    return _mm512_load_si512(q);
#endif
  }
}

// Lane l of pair table p (int8 [SUBS / 2][16][2]) as two int16: (t[2p][l], t[2p + 1][l]).
inline __m512i pair_vector(const int8_t* table, int p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(table + p * 2 * LANES)));
}

// out[t][l] = sum_j table[j][l] * bsum[t * ld + j] over a superblock's SUBS sub-blocks: a
// pair table (int8 [SUBS / 2][16][2]) times T tokens' int16 sums of their codes.
template <int SUBS, int T>
inline void table_sums(const int8_t* table, const int16_t* bsum, int64_t ld, __m512i out[T]) {
  UNROLL for (int t = 0; t < T; ++t) out[t] = _mm512_setzero_si512();
  UNROLL for (int p = 0; p < SUBS / 2; ++p) {
    const __m512i pair = pair_vector(table, p);
    UNROLL for (int t = 0; t < T; ++t) {
      int32_t two;  // bsum[t][2p], bsum[t][2p + 1] as two int16
      std::memcpy(&two, bsum + t * ld + 2 * p, sizeof(two));
      out[t] = _mm512_dpwssd_epi32(out[t], pair, _mm512_set1_epi32(two));
    }
  }
}
#endif

#if !defined(__AVX512VNNI__) && defined(__AVX2__)
// AVX2 works on half a tile at a time: rows 8 h .. 8 h + 7, one per 32-bit lane.

// quad_codes8's tables for BITS-bit fields (5, 6): per 16-bit word f of each 128-bit lane, the
// shuffle that puts field f's one or two bytes in it (lo: the lane's first lane pair, hi: its
// second), and the multiplier that moves the field's bits to the word's top.
template <int BITS>
struct FieldTables {
  alignas(32) uint8_t lo[32];
  alignas(32) uint8_t hi[32];
  alignas(32) uint16_t mul[16];
};

template <int BITS>
constexpr FieldTables<BITS> field_tables() {
  FieldTables<BITS> tables{};
  for (int lane = 0; lane < 2; ++lane)
    for (int pair = 0; pair < 2; ++pair) {
      // where the pair's BITS bytes start in the lane's 16 loaded bytes (see quad_codes8)
      const int start = (lane == 0 ? 0 : 16 - 2 * BITS) + pair * BITS;
      uint8_t* shuffle = pair == 0 ? tables.lo : tables.hi;
      for (int f = 0; f < 8; ++f) {
        const int byte = start + f * BITS / 8, shift = f * BITS % 8;
        shuffle[lane * 16 + 2 * f] = uint8_t(byte);
        shuffle[lane * 16 + 2 * f + 1] = shift + BITS > 8 ? uint8_t(byte + 1) : uint8_t(0x80);
        tables.mul[lane * 8 + f] = uint16_t(1u << (16 - BITS - shift));
      }
    }
  return tables;
}

// The u8 codes of quad c (values 4 c .. 4 c + 3) of rows 8 h .. 8 h + 7 of one tile's
// sub-block at `codes`, one row per 32-bit lane.
template <int BITS, int S>
inline __m256i quad_codes8(const uint8_t* codes, int c, int h) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * 64 + h * 32));
  } else if constexpr (BITS == 4) {
    const __m256i nibbles =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (c / 2) * 64 + h * 32));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    return (c % 2 == 0) ? _mm256_and_si256(nibbles, low4)
                        : _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low4);
  } else {
    // lane pairs 4 h .. 4 h + 3: 4 * BITS bytes; 128-bit lane 0 loads pairs 4 h, 4 h + 1 from
    // their start, lane 1 pairs 4 h + 2, 4 h + 3 as the last 16 of the 4 * BITS bytes (both
    // loads stay inside the quad)
    static constexpr FieldTables<BITS> tables = field_tables<BITS>();
    const uint8_t* first = codes + c * 8 * BITS + h * 4 * BITS;
    const __m256i raw =
        _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(first + 4 * BITS - 16),
                            reinterpret_cast<const __m128i*>(first));
    const __m256i mul = _mm256_load_si256(reinterpret_cast<const __m256i*>(tables.mul));
    auto fields = [&](const uint8_t* shuffle) {  // 16-bit words: a field each, moved down
      const __m256i words =
          _mm256_shuffle_epi8(raw, _mm256_load_si256(reinterpret_cast<const __m256i*>(shuffle)));
      return _mm256_srli_epi16(_mm256_mullo_epi16(words, mul), 16 - BITS);
    };
    return _mm256_packus_epi16(fields(tables.lo), fields(tables.hi));
  }
}

// Lane l of pair table p (int8 [SUBS / 2][16][2]) for rows 8 h .. 8 h + 7 as two int16:
// (t[2p][l], t[2p + 1][l]).
inline __m256i pair_vector8(const int8_t* table, int p, int h) {
  return _mm256_cvtepi8_epi16(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(table + p * 2 * LANES + h * 8 * 2)));
}

// table_sums for rows 8 h .. 8 h + 7.
template <int SUBS, int T>
inline void table_sums8(const int8_t* table, const int16_t* bsum, int64_t ld, int h,
                        __m256i out[T]) {
  UNROLL for (int t = 0; t < T; ++t) out[t] = _mm256_setzero_si256();
  UNROLL for (int p = 0; p < SUBS / 2; ++p) {
    const __m256i pair = pair_vector8(table, p, h);
    UNROLL for (int t = 0; t < T; ++t) {
      int32_t two;  // bsum[t][2p], bsum[t][2p + 1] as two int16
      std::memcpy(&two, bsum + t * ld + 2 * p, sizeof(two));
      out[t] = _mm256_add_epi32(out[t], _mm256_madd_epi16(pair, _mm256_set1_epi32(two)));
    }
  }
}
#endif

#if defined(__AVX2__)
// Prefetches into the L2 cache part `part` of `parts` of the `bytes` bytes at p (the cache
// lines that start in it).
inline void prefetch_part(const uint8_t* p, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(p + line * 64), _MM_HINT_T1);
}
#endif

// Tokens' activations for a tile (see the header): T rows of x8 (stride K), dx and sx (stride
// K / B), bsum16 (stride K / 16), bsum32 (stride K / 32).
struct Acts {
  const int8_t* x8;
  const float* dx;
  const float* sx;
  const int16_t* bsum16;
  const int16_t* bsum32;
  int64_t K;
};

// acc[t][l] = sum over the superblocks of row l's by token t's contributions (see the header);
// blk is one packed tile (16 rows) of nsb superblocks. While it computes, the tile at `next`
// (nullptr: none) is prefetched, superblock by superblock: the hardware prefetchers alone leave
// the memory stream idle while a multi-token tile computes.
template <int BITS, int S, int SUBS, int OFF, int MINS, int T>
void gguf_tile(const uint8_t* blk, int64_t nsb, const Acts& a, const uint8_t* next,
               float acc[T][LANES]) {
  static_assert(OFF == 0 || (OFF & (OFF - 1)) == 0, "OFF is a power of two");
  constexpr int SHIFT = OFF == 0 ? 0 : __builtin_ctz(OFF);  // OFF = 1 << SHIFT
  const Layout layout{BITS, S, SUBS, MINS};
  const int64_t header = layout.header_bytes(), sub_bytes = layout.sub_bytes();
  const int64_t sb_bytes = layout.superblock_bytes();
  const int64_t ld_dx = a.K / (S * SUBS), ld16 = a.K / 16, ld32 = a.K / 32;
  const int64_t sc_at = (MINS ? 4 : 2) * LANES, mn_at = sc_at + (SUBS > 1 ? SUBS * LANES : 0);
  // the sums of x8 per sub-block
  const int16_t* bsum = S == 16 ? a.bsum16 : a.bsum32;
  const int64_t ld_bsum = S == 16 ? ld16 : ld32;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // One token alone sums even and odd quads apart (shorter dependency chains; integer sums
  // are exact in any order).
  constexpr int P = T == 1 ? 2 : 1;
  __m512 sum[T];
  UNROLL for (int t = 0; t < T; ++t) sum[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* h = blk + s * sb_bytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(h + sc_at);
    const int8_t* mn = reinterpret_cast<const int8_t*>(h + mn_at);
    __m512i main[T];
    UNROLL for (int t = 0; t < T; ++t) main[t] = _mm512_setzero_si512();
    // the sub-blocks in a loop: unrolled, the compiler hoists loads across them and spills
    _Pragma("GCC unroll 1") for (int j = 0; j < SUBS; ++j) {
      if (next != nullptr) prefetch_part(next + s * sb_bytes, sb_bytes, j, SUBS);
      const int64_t k0 = (s * SUBS + j) * S;
      const uint8_t* codes = h + header + j * sub_bytes;
      __m512i isum[P][T];
      UNROLL for (int p = 0; p < P; ++p)
        UNROLL for (int t = 0; t < T; ++t) isum[p][t] = _mm512_setzero_si512();
      UNROLL for (int c = 0; c < S / 4; ++c) {
        const __m512i q = quad_codes<BITS, S>(codes, c);
        UNROLL for (int t = 0; t < T; ++t) {
          const int32_t four = *reinterpret_cast<const unaligned_i32*>(a.x8 + t * a.K + k0 + 4 * c);
          isum[c % P][t] = _mm512_dpbusd_epi32(isum[c % P][t], q, _mm512_set1_epi32(four));
        }
      }
      __m512i scale = _mm512_setzero_si512();
      if constexpr (SUBS > 1) {
        const __m512i pair = pair_vector(sc, j / 2);
        scale = j % 2 == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16)
                           : _mm512_srai_epi32(pair, 16);
      }
      UNROLL for (int t = 0; t < T; ++t) {
        __m512i total = isum[0][t];
        if constexpr (P == 2) total = _mm512_add_epi32(total, isum[1][t]);
        if constexpr (SUBS > 1) total = _mm512_mullo_epi32(total, scale);
        main[t] = _mm512_add_epi32(main[t], total);
      }
    }
    if constexpr (OFF != 0) {  // main -= OFF * sum_j sc_j bsum_j
      __m512i off[T];
      if constexpr (SUBS > 1) {
        table_sums<SUBS, T>(sc, bsum + s * SUBS, ld_bsum, off);
      } else {
        UNROLL for (int t = 0; t < T; ++t)
          off[t] = _mm512_set1_epi32(int32_t(bsum[t * ld_bsum + s]));
      }
      UNROLL for (int t = 0; t < T; ++t)
        main[t] = _mm512_sub_epi32(main[t], _mm512_slli_epi32(off[t], SHIFT));
    }
    const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h));
    UNROLL for (int t = 0; t < T; ++t) {
      const __m512 dx = _mm512_set1_ps(a.dx[t * ld_dx + s]);
      sum[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(main[t]), _mm512_mul_ps(D, dx), sum[t]);
    }
    if constexpr (MINS != 0) {
      const __m512 M = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + 2 * LANES)));
      if constexpr (MINS == 1) {  // sum -= (M dx) * sum_j mn_j bsum_j
        __m512i mins[T];
        table_sums<SUBS, T>(mn, bsum + s * SUBS, ld_bsum, mins);
        UNROLL for (int t = 0; t < T; ++t) {
          const __m512 mdx = _mm512_mul_ps(M, _mm512_set1_ps(a.dx[t * ld_dx + s]));
          sum[t] = _mm512_fnmadd_ps(mdx, _mm512_cvtepi32_ps(mins[t]), sum[t]);
        }
      } else {  // sum -= M * sx
        UNROLL for (int t = 0; t < T; ++t)
          sum[t] = _mm512_fnmadd_ps(M, _mm512_set1_ps(a.sx[t * ld_dx + s]), sum[t]);
      }
    }
  }
  UNROLL for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc[t], sum[t]);
#elif defined(__AVX2__)
  // The AVX-512 path's steps, half a tile (8 rows) at a time, with the same fp32 operations in
  // the same order (so the same bits). Without AVX-VNNI, vpmaddubsw (u8 x s8, pairs summed in
  // int16, saturating) stands in for vpdpbusd: the int16 pair sums of RUN quads stay below
  // 2^15 for codes of BITS <= 6 (|x8| <= 127), and 8-bit codes are summed as signed values
  // (code - OFF, |w| times x8 with w's sign), which subtracts OFF * bsum on the way.
  // With AVX-VNNI, vpdpbusd itself on 8 lanes (no int16 runs, codes as they are).
#if defined(__AVXVNNI__)
  constexpr bool VNNI = true;
#else
  constexpr bool VNNI = false;
#endif
  constexpr bool SIGNED_Q8 = BITS == 8 && !VNNI;  // summed as code - OFF (see above)
  static_assert(BITS != 8 || (OFF == 128 && SUBS == 1), "8-bit codes: Q8_0 only");
  constexpr int RUN = VNNI ? S / 4 : BITS == 4 ? 8 : BITS == 5 ? 4 : BITS == 6 ? 2 : 1;
  static_assert((S / 4) % RUN == 0, "whole runs of quads per sub-block");
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  for (int half = 0; half < 2; ++half) {
    __m256 sum[T];
    UNROLL for (int t = 0; t < T; ++t) sum[t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; ++s) {
      const uint8_t* h = blk + s * sb_bytes;
      const int8_t* sc = reinterpret_cast<const int8_t*>(h + sc_at);
      const int8_t* mn = reinterpret_cast<const int8_t*>(h + mn_at);
      __m256i main[T];
      UNROLL for (int t = 0; t < T; ++t) main[t] = _mm256_setzero_si256();
      _Pragma("GCC unroll 1") for (int j = 0; j < SUBS; ++j) {
        if (next != nullptr && half == 0) prefetch_part(next + s * sb_bytes, sb_bytes, j, SUBS);
        const int64_t k0 = (s * SUBS + j) * S;
        const uint8_t* codes = h + header + j * sub_bytes;
        __m256i isum[T];
        UNROLL for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
        UNROLL for (int c0 = 0; c0 < S / 4; c0 += RUN) {
          __m256i pairs[T];  // int16 pair sums of the run's quads (without VNNI)
          UNROLL for (int t = 0; t < T; ++t) pairs[t] = _mm256_setzero_si256();
          UNROLL for (int c = c0; c < c0 + RUN; ++c) {
            const __m256i q = quad_codes8<BITS, S>(codes, c, half);
            const __m256i signed_q = _mm256_xor_si256(q, flip);  // BITS 8: code - 128
            const __m256i magnitude = _mm256_abs_epi8(signed_q);
            UNROLL for (int t = 0; t < T; ++t) {
              const __m256i x = _mm256_set1_epi32(
                  *reinterpret_cast<const unaligned_i32*>(a.x8 + t * a.K + k0 + 4 * c));
#if defined(__AVXVNNI__)
              isum[t] = _mm256_dpbusd_avx_epi32(isum[t], q, x);
#else
              const __m256i products =
                  BITS == 8 ? _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, signed_q))
                            : _mm256_maddubs_epi16(q, x);
              pairs[t] = _mm256_add_epi16(pairs[t], products);
#endif
            }
          }
          if constexpr (!VNNI) {
            UNROLL for (int t = 0; t < T; ++t)
              isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(pairs[t], ones));
          }
        }
        __m256i scale = _mm256_setzero_si256();
        if constexpr (SUBS > 1) {
          const __m256i pair = pair_vector8(sc, j / 2, half);
          scale = j % 2 == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16)
                             : _mm256_srai_epi32(pair, 16);
        }
        UNROLL for (int t = 0; t < T; ++t) {
          __m256i total = isum[t];
          if constexpr (SUBS > 1) total = _mm256_mullo_epi32(total, scale);
          main[t] = _mm256_add_epi32(main[t], total);
        }
      }
      if constexpr (OFF != 0 && !SIGNED_Q8) {  // main -= OFF * sum_j sc_j bsum_j
        __m256i off[T];
        if constexpr (SUBS > 1) {
          table_sums8<SUBS, T>(sc, bsum + s * SUBS, ld_bsum, half, off);
        } else {
          UNROLL for (int t = 0; t < T; ++t)
            off[t] = _mm256_set1_epi32(int32_t(bsum[t * ld_bsum + s]));
        }
        UNROLL for (int t = 0; t < T; ++t)
          main[t] = _mm256_sub_epi32(main[t], _mm256_slli_epi32(off[t], SHIFT));
      }
      const __m256 D =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + half * 16)));
      UNROLL for (int t = 0; t < T; ++t) {
        const __m256 dx = _mm256_set1_ps(a.dx[t * ld_dx + s]);
        sum[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(main[t]), _mm256_mul_ps(D, dx), sum[t]);
      }
      if constexpr (MINS != 0) {
        const __m256 M = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * LANES + half * 16)));
        if constexpr (MINS == 1) {  // sum -= (M dx) * sum_j mn_j bsum_j
          __m256i mins[T];
          table_sums8<SUBS, T>(mn, bsum + s * SUBS, ld_bsum, half, mins);
          UNROLL for (int t = 0; t < T; ++t) {
            const __m256 mdx = _mm256_mul_ps(M, _mm256_set1_ps(a.dx[t * ld_dx + s]));
            sum[t] = _mm256_fnmadd_ps(mdx, _mm256_cvtepi32_ps(mins[t]), sum[t]);
          }
        } else {  // sum -= M * sx
          UNROLL for (int t = 0; t < T; ++t)
            sum[t] = _mm256_fnmadd_ps(M, _mm256_set1_ps(a.sx[t * ld_dx + s]), sum[t]);
        }
      }
    }
    UNROLL for (int t = 0; t < T; ++t) _mm256_storeu_ps(acc[t] + half * 8, sum[t]);
  }
#else
  std::memset(acc, 0, sizeof(float) * T * LANES);
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* h = blk + s * sb_bytes;
    const uint16_t* D = reinterpret_cast<const uint16_t*>(h);
    const int8_t* sc = reinterpret_cast<const int8_t*>(h + sc_at);
    const int8_t* mn = reinterpret_cast<const int8_t*>(h + mn_at);
    auto table = [](const int8_t* t, int64_t j, int64_t l) {  // pair layout (see the header)
      return int32_t(t[(j / 2) * 2 * LANES + 2 * l + j % 2]);
    };
    for (int64_t l = 0; l < LANES; ++l) {
      for (int t = 0; t < T; ++t) {
        int32_t main = 0, mins = 0;
        for (int64_t j = 0; j < SUBS; ++j) {
          const int64_t k0 = (s * SUBS + j) * S;
          const uint8_t* codes = h + header + j * sub_bytes;
          int32_t isum = 0;
          for (int64_t k = 0; k < S; ++k)
            isum += code_at<BITS, S>(codes, l, k) * int32_t(a.x8[t * a.K + k0 + k]);
          const int32_t b = bsum[t * ld_bsum + s * SUBS + j];
          const int32_t scale = SUBS > 1 ? table(sc, j, l) : 1;
          main += scale * isum - OFF * scale * b;
          if (MINS == 1) mins += table(mn, j, l) * b;
        }
        const float dx = a.dx[t * ld_dx + s];
        acc[t][l] = std::fma(float(main), half_to_float(D[l]) * dx, acc[t][l]);
        if (MINS == 1)
          acc[t][l] = std::fma(-(half_to_float(D[LANES + l]) * dx), float(mins), acc[t][l]);
        if (MINS == 2)
          acc[t][l] = std::fma(-half_to_float(D[LANES + l]), a.sx[t * ld_dx + s], acc[t][l]);
      }
    }
  }
#endif
}

// Runs gguf_tile<BITS, S, SUBS, OFF, MINS> over every tile of 16 rows and group of up to
// GGUF_TOKENS tokens (tiles split across threads) and stores into y.
template <int BITS, int S, int SUBS, int OFF, int MINS, typename out_t>
void gguf_matmul(const uint8_t* w, int64_t tiles, int64_t nsb, const Acts& acts, int64_t M,
                 int64_t N, const float* b, out_t* y, int64_t ldy) {
  const int64_t tile_bytes = nsb * Layout{BITS, S, SUBS, MINS}.superblock_bytes();
  const int64_t B = S * SUBS;
  auto run = [&](auto tokens, int64_t tile, int64_t m0) {
    constexpr int T = decltype(tokens)::value;
    float acc[T][LANES];
    const Acts a{acts.x8 + m0 * acts.K,          acts.dx + m0 * (acts.K / B),
                 acts.sx + m0 * (acts.K / B),    acts.bsum16 + m0 * (acts.K / 16),
                 acts.bsum32 + m0 * (acts.K / 32), acts.K};
    const uint8_t* next = m0 == 0 && tile + 1 < tiles ? w + (tile + 1) * tile_bytes : nullptr;
    gguf_tile<BITS, S, SUBS, OFF, MINS, T>(w + tile * tile_bytes, nsb, a, next, acc);
    store_rows(&acc[0][0], T, tile * LANES, N, b, y + m0 * ldy, ldy);
  };
  for_each_tile<GGUF_TOKENS>(tiles, M, tile_bytes, run);
}

}  // namespace

// x [..., K] fp32 or bf16 in blocks of `block` (32 or 256; K % block == 0) -> (x8 int8 [M, K],
// dx fp32 [M, K / block], sx fp32 [M, K / block] (block 32; [M, 0] for 256), bsum16 int16
// [M, K / 16], bsum32 int16 [M, K / 32]) with M the number of rows of x; see the header.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gguf_quantize(
    const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.device().is_cpu(), "specdecode kernels run on the CPU");
  TORCH_CHECK(block == 32 || block == 256, "gguf_quantize blocks are 32 or 256, got ", block);
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % block == 0, "gguf_quantize needs K % ", block, " == 0, got ", K);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();  // [M, K]
  const int64_t M = rows.size(0);
  at::Tensor x8 = at::empty({M, K}, rows.options().dtype(at::kChar));
  const auto f32 = rows.options().dtype(at::kFloat), i16 = rows.options().dtype(at::kShort);
  at::Tensor dx = at::empty({M, K / block}, f32);
  at::Tensor sx = at::empty({M, block == 32 ? K / block : 0}, f32);
  at::Tensor bsum16 = at::empty({M, K / 16}, i16), bsum32 = at::empty({M, K / 32}, i16);
  fp32_or_bf16(rows.scalar_type(), "gguf_quantize", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const scalar_t* data = rows.data_ptr<scalar_t>();
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        quantize_act_row(data + m * K, K, block, x8.data_ptr<int8_t>() + m * K,
                         dx.data_ptr<float>() + m * (K / block),
                         sx.data_ptr<float>() + m * sx.size(1),
                         bsum16.data_ptr<int16_t>() + m * (K / 16),
                         bsum32.data_ptr<int16_t>() + m * (K / 32));
    });
  });
  return {x8, dx, sx, bsum16, bsum32};
}

// y[:, offset : offset + N] = acts @ W^T (+ bias) for one packed GGUF weight w uint8
// [Np / 16, K / (S * SUBS), superblock bytes] of layout (bits, sub, subs, off, mins); acts
// (x8, dx, sx, bsum16, bsum32) from gguf_quantize with block S * SUBS; y [M, ldy] fp32 or bf16,
// contiguous; bias fp32 [N] or None.
void gguf_linear(const at::Tensor& x8, const at::Tensor& dx, const at::Tensor& sx,
                 const at::Tensor& bsum16, const at::Tensor& bsum32, const at::Tensor& w,
                 int64_t bits, int64_t sub, int64_t subs, int64_t off, int64_t mins, int64_t N,
                 const c10::optional<at::Tensor>& bias, at::Tensor& y, int64_t offset) {
  const Layout layout{bits, sub, subs, mins};
  const int64_t M = x8.size(0), K = x8.size(1), B = layout.superblock_values();
  TORCH_CHECK(x8.scalar_type() == at::kChar && x8.dim() == 2 && x8.is_contiguous(),
              "x8 must be a contiguous int8 [M, K] tensor from gguf_quantize");
  TORCH_CHECK(dx.scalar_type() == at::kFloat && dx.is_contiguous() && dx.size(0) == M &&
                  dx.size(1) * B == K && bsum16.scalar_type() == at::kShort &&
                  bsum16.is_contiguous() && bsum16.numel() == M * (K / 16) &&
                  bsum32.scalar_type() == at::kShort && bsum32.is_contiguous() &&
                  bsum32.numel() == M * (K / 32) &&
                  (mins != 2 || (sx.scalar_type() == at::kFloat && sx.is_contiguous() &&
                                 sx.numel() == dx.numel())),
              "activations must come from gguf_quantize with block ", B);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() &&
                  w.size(1) * B == K && w.size(2) == layout.superblock_bytes(),
              "packed GGUF weight must be a contiguous uint8 [Np/16, K/", B, ", ",
              layout.superblock_bytes(), "] tensor for K = ", K, ", got ", w.sizes());
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
  const Acts acts{x8.data_ptr<int8_t>(),      dx.data_ptr<float>(),
                  mins == 2 ? sx.data_ptr<float>() : nullptr,
                  bsum16.data_ptr<int16_t>(), bsum32.data_ptr<int16_t>(), K};
  fp32_or_bf16(y.scalar_type(), "gguf_linear", [&](auto type_tag) {
    using out_t = decltype(type_tag);
    out_t* yp = y.data_ptr<out_t>() + offset;
#define SPECDECODE_GGUF_CASE(BITS, S, SUBS, OFF, MINS)                                   \
  if (bits == BITS && sub == S && subs == SUBS && off == OFF && mins == MINS)            \
    return gguf_matmul<BITS, S, SUBS, OFF, MINS>(wp, tiles, nsb, acts, M, N, b, yp, ldy);
    SPECDECODE_GGUF_CASE(4, 32, 1, 8, 0)    // Q4_0
    SPECDECODE_GGUF_CASE(4, 32, 1, 0, 2)    // Q4_1
    SPECDECODE_GGUF_CASE(5, 32, 1, 16, 0)   // Q5_0
    SPECDECODE_GGUF_CASE(5, 32, 1, 0, 2)    // Q5_1
    SPECDECODE_GGUF_CASE(8, 32, 1, 128, 0)  // Q8_0
    SPECDECODE_GGUF_CASE(4, 32, 8, 0, 1)    // Q4_K
    SPECDECODE_GGUF_CASE(5, 32, 8, 0, 1)    // Q5_K
    SPECDECODE_GGUF_CASE(6, 16, 16, 32, 0)  // Q6_K
#undef SPECDECODE_GGUF_CASE
    TORCH_CHECK(false, "no GGUF kernel for the layout bits=", bits, " sub=", sub,
                " subs=", subs, " off=", off, " mins=", mins);
  });
}

// q uint8 [Np, K] (Np % 16 == 0; codes of BITS bits, K % (sub * subs) == 0) -> the codes of
// every tile's sub-blocks in the layout of the header, uint8 [Np / 16, K / (sub * subs),
// subs * 16 * sub * BITS / 8] (the packed weight less its scale tables; gguf_blocks.pack).
at::Tensor gguf_pack_codes(const at::Tensor& q, int64_t bits, int64_t sub, int64_t subs) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() &&
                  q.size(0) % LANES == 0 && q.size(1) % (sub * subs) == 0 && sub % 8 == 0,
              "codes must be a contiguous uint8 [Np, K] tensor, Np % 16 == 0 and K % ",
              sub * subs, " == 0");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "no code layout for ", bits,
              " bits");
  const int64_t K = q.size(1), tiles = q.size(0) / LANES, nsb = K / (sub * subs);
  const int64_t sub_bytes = LANES * sub * bits / 8;
  at::Tensor out = at::empty({tiles, nsb, subs * sub_bytes}, q.options());
  const uint8_t* src = q.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t sb = 0; sb < nsb * subs; ++sb) {  // sub-blocks of the tile, in order
        const uint8_t* rows = src + tile * LANES * K + sb * sub;
        uint8_t* o = dst + (tile * nsb * subs + sb) * sub_bytes;
        auto code = [&](int64_t l, int64_t k) { return rows[l * K + k]; };
        for (int64_t c = 0; c < sub / 4; ++c) {  // quads
          if (bits == 8) {
            for (int64_t l = 0; l < LANES; ++l)
              for (int64_t b = 0; b < 4; ++b) o[c * 64 + l * 4 + b] = code(l, 4 * c + b);
          } else if (bits == 4) {
            if (c % 2 == 1) continue;  // vector c / 2 holds quads c and c + 1
            for (int64_t l = 0; l < LANES; ++l)
              for (int64_t b = 0; b < 4; ++b)
                o[(c / 2) * 64 + l * 4 + b] =
                    uint8_t((code(l, 4 * c + b) & 0x0F) | (code(l, 4 * c + 4 + b) << 4));
          } else {
            for (int64_t i = 0; i < LANES / 2; ++i) {  // lane pairs
              uint64_t word = 0;
              for (int64_t f = 0; f < 8; ++f)
                word |= uint64_t(code(2 * i + f / 4, 4 * c + f % 4)) << (f * bits);
              std::memcpy(o + c * 8 * bits + i * bits, &word, size_t(bits));
            }
          }
        }
      }
  });
  return out;
}
