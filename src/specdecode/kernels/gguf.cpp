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

#include "core.h"
#include "tiles.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace specdecode {
namespace {

static_assert(LANES == GGUF_ROWS, "a GGUF tile is one row per lane");

// tokens per tile, at most: 8 where there are 32 vector registers (AVX-512, NEON). AVX-VNNI
// keeps 4: with 16, more tokens' int32 sums do not fit. Plain AVX2 takes 10: only its int16 run
// sums need to stay in registers (the rarer int32 and fp32 sums spill), and a 9-token
// verification pass is then one group, not 3 (each group decodes the tile's codes again, and
// after the first group its compute no longer overlaps the weights' stream from memory).
#if defined(__AVXVNNI__) && !defined(__AVX512VNNI__)
constexpr int GGUF_TOKENS = 4;
#elif defined(__AVX2__) && !defined(__AVX512VNNI__)
constexpr int GGUF_TOKENS = 10;
#else
constexpr int GGUF_TOKENS = 8;
#endif
// 4 activation bytes read as one int32 where they lie, so that the compiler can fold the load
// into vpdpbusd's broadcast operand
typedef int32_t unaligned_i32 __attribute__((aligned(1), may_alias));

inline float round_to_half(float v) { return half_to_float(float_to_half(v)); }

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

// Keeps v in a register here: GCC would otherwise reassociate a run's exact integer sums,
// computing every product first and spilling them to the stack (2-3x slower).
inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

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

#if defined(SPECDECODE_NEON)
// NEON works on a quarter of a tile at a time: rows 4 r .. 4 r + 3, one per 32-bit lane.

// quad_codes4's tables for BITS-bit fields (5, 6): per 16-bit word i of the two halves (lo:
// words 0-7, hi: words 8-15; word i is output byte i, value i % 4 of row 4 r + i / 4), the two
// of the 16 loaded bytes that hold its field (0xFF: none, read as 0), and the right shift
// (negative: vshlq's direction) that moves the field down, the same for both halves.
template <int BITS>
struct QuarterTables {
  uint8_t lo[16];
  uint8_t hi[16];
  int16_t shift[8];
};

template <int BITS>
constexpr QuarterTables<BITS> quarter_tables() {
  QuarterTables<BITS> tables{};
  for (int pair = 0; pair < 2; ++pair) {
    // where the pair's BITS bytes start in the 16 loaded bytes (see quad_codes4)
    const int start = 16 - 2 * BITS + pair * BITS;
    uint8_t* index = pair == 0 ? tables.lo : tables.hi;
    for (int f = 0; f < 8; ++f) {
      const int byte = start + f * BITS / 8, shift = f * BITS % 8;
      index[2 * f] = uint8_t(byte);
      index[2 * f + 1] = shift + BITS > 8 ? uint8_t(byte + 1) : uint8_t(0xFF);
      tables.shift[f] = int16_t(-shift);
    }
  }
  return tables;
}

// The u8 codes of quad c (values 4 c .. 4 c + 3) of rows 4 r .. 4 r + 3 of one tile's
// sub-block at `codes`, one row per 32-bit lane.
template <int BITS, int S>
inline uint8x16_t quad_codes4(const uint8_t* codes, int c, int r) {
  if constexpr (BITS == 8) {
    return vld1q_u8(codes + c * 64 + r * 16);
  } else if constexpr (BITS == 4) {
    const uint8x16_t nibbles = vld1q_u8(codes + (c / 2) * 64 + r * 16);
    return (c % 2 == 0) ? vandq_u8(nibbles, vdupq_n_u8(0x0F)) : vshrq_n_u8(nibbles, 4);
  } else {
    // lane pairs 2 r, 2 r + 1: the last 2 * BITS of 16 bytes loaded up to their end (the bytes
    // before them are earlier codes or the superblock's header: always inside the tile)
    static constexpr QuarterTables<BITS> tables = quarter_tables<BITS>();
    const uint8x16_t raw = vld1q_u8(codes + c * 8 * BITS + (r + 1) * 2 * BITS - 16);
    const int16x8_t shift = vld1q_s16(tables.shift);
    const uint16x8_t mask = vdupq_n_u16((1 << BITS) - 1);
    auto fields = [&](const uint8_t* index) {  // 16-bit words: a field each, moved down
      const uint16x8_t words = vreinterpretq_u16_u8(vqtbl1q_u8(raw, vld1q_u8(index)));
      return vreinterpretq_u8_u16(vandq_u16(vshlq_u16(words, shift), mask));
    };
    return vuzp1q_u8(fields(tables.lo), fields(tables.hi));  // each word's low byte
  }
}

// Column e (0, 1) of pair table p (int8 [SUBS / 2][16][2]) for rows 4 r .. 4 r + 3:
// t[2p + e][l] as int32.
inline int32x4_t table_column(const int8_t* table, int p, int r, int e) {
  const int8x8_t raw = vld1_s8(table + p * 2 * LANES + r * 4 * 2);
  const int8x8_t column = e == 0 ? vuzp1_s8(raw, raw) : vuzp2_s8(raw, raw);
  return vmovl_s16(vget_low_s16(vmovl_s8(column)));
}

// table_sums for rows 4 r .. 4 r + 3.
template <int SUBS, int T>
inline void table_sums4(const int8_t* table, const int16_t* bsum, int64_t ld, int r,
                        int32x4_t out[T]) {
  UNROLL for (int t = 0; t < T; ++t) out[t] = vdupq_n_s32(0);
  UNROLL for (int j = 0; j < SUBS; ++j) {
    const int32x4_t column = table_column(table, j / 2, r, j % 2);
    UNROLL for (int t = 0; t < T; ++t)
      out[t] = vmlaq_n_s32(out[t], column, int32_t(bsum[t * ld + j]));
  }
}
#endif

#if defined(__AVX2__) || defined(SPECDECODE_NEON)
// Prefetches into the L2 cache part `part` of `parts` of the `bytes` bytes at p (the cache
// lines that start in it).
inline void prefetch_part(const uint8_t* p, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; ++line)
#if defined(__AVX2__)
    _mm_prefetch(reinterpret_cast<const char*>(p + line * 64), _MM_HINT_T1);
#else
    __builtin_prefetch(p + line * 64, 0, 2);
#endif
}
#endif

// acc[t][l] = sum over the superblocks of row l's by token t's contributions (see the header);
// `a` holds the tile's T tokens' activations: rows of x8 (stride K), dx and sx (stride K / B),
// bsum16 (stride K / 16), bsum32 (stride K / 32);
// blk is one packed tile (16 rows) of nsb superblocks. While it computes, the tile at `next`
// (nullptr: none) is prefetched, superblock by superblock: the hardware prefetchers alone leave
// the memory stream idle while a multi-token tile computes.
template <int BITS, int S, int SUBS, int OFF, int MINS, int T>
void gguf_tile(const uint8_t* blk, int64_t nsb, const GgufActs& a, const uint8_t* next,
               float acc[T][LANES]) {
  static_assert(OFF == 0 || (OFF & (OFF - 1)) == 0, "OFF is a power of two");
  [[maybe_unused]] constexpr int SHIFT = OFF == 0 ? 0 : __builtin_ctz(OFF);  // OFF = 1 << SHIFT
  const GgufLayout layout{BITS, S, SUBS, OFF, MINS};
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
        __m256i scale = _mm256_setzero_si256();  // sc_j of each row as int32 (SUBS > 1)
        if constexpr (SUBS > 1) {
          const __m256i pair = pair_vector8(sc, j / 2, half);
          scale = j % 2 == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16)
                             : _mm256_srai_epi32(pair, 16);
        }
        // Without VNNI each run's int16 pair sums go into main at once, times sc_j: vpmaddwd
        // with sc_j in both int16 halves of a row's lane (1 without a table); the same int32
        // sum as sc_j times the sub-block's sum.
        [[maybe_unused]] const __m256i weight =
            SUBS > 1 ? _mm256_blend_epi16(_mm256_slli_epi32(scale, 16), scale, 0x55) : ones;
        __m256i isum[T];  // with VNNI: the sub-block's int32 sums
        UNROLL for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
        UNROLL for (int c0 = 0; c0 < S / 4; c0 += RUN) {
          __m256i pairs[T];  // int16 pair sums of the run's quads (without VNNI)
          UNROLL for (int t = 0; t < T; ++t) pairs[t] = _mm256_setzero_si256();
          UNROLL for (int c = c0; c < c0 + RUN; ++c) {
            const __m256i q = quad_codes8<BITS, S>(codes, c, half);
            const __m256i signed_q = _mm256_xor_si256(q, flip);  // BITS 8: code - 128
            [[maybe_unused]] const __m256i magnitude = _mm256_abs_epi8(signed_q);  // no VNNI
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
              keep_in_register(pairs[t]);
#endif
            }
          }
          if constexpr (!VNNI) {
            UNROLL for (int t = 0; t < T; ++t)
              main[t] = _mm256_add_epi32(main[t], _mm256_madd_epi16(pairs[t], weight));
          }
        }
        if constexpr (VNNI) {
          UNROLL for (int t = 0; t < T; ++t) {
            __m256i total = isum[t];
            if constexpr (SUBS > 1) total = _mm256_mullo_epi32(total, scale);
            main[t] = _mm256_add_epi32(main[t], total);
          }
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
#elif defined(SPECDECODE_NEON)
  // The AVX-512 path's steps, a quarter of a tile (4 rows) at a time, with the same fp32
  // operations in the same order (so the same bits). sdot (s8 x s8) stands in for vpdpbusd:
  // codes of BITS <= 6 are below 128, so their s8 reading is their value, and 8-bit codes are
  // summed as signed values (code - OFF), which subtracts OFF * bsum on the way.
  constexpr bool SIGNED_Q8 = BITS == 8;
  static_assert(BITS != 8 || (OFF == 128 && SUBS == 1), "8-bit codes: Q8_0 only");
  const uint16_t* half_floats = reinterpret_cast<const uint16_t*>(blk);
  for (int r = 0; r < 4; ++r) {
    float32x4_t sum[T];
    UNROLL for (int t = 0; t < T; ++t) sum[t] = vdupq_n_f32(0.f);
    for (int64_t s = 0; s < nsb; ++s) {
      const uint8_t* h = blk + s * sb_bytes;
      const int8_t* sc = reinterpret_cast<const int8_t*>(h + sc_at);
      const int8_t* mn = reinterpret_cast<const int8_t*>(h + mn_at);
      int32x4_t main[T];
      UNROLL for (int t = 0; t < T; ++t) main[t] = vdupq_n_s32(0);
      _Pragma("GCC unroll 1") for (int j = 0; j < SUBS; ++j) {
        if (next != nullptr && r == 0) prefetch_part(next + s * sb_bytes, sb_bytes, j, SUBS);
        const int64_t k0 = (s * SUBS + j) * S;
        const uint8_t* codes = h + header + j * sub_bytes;
        int32x4_t isum[T];
        UNROLL for (int t = 0; t < T; ++t) isum[t] = vdupq_n_s32(0);
        UNROLL for (int c = 0; c < S / 4; ++c) {
          uint8x16_t q = quad_codes4<BITS, S>(codes, c, r);
          if constexpr (SIGNED_Q8) q = veorq_u8(q, vdupq_n_u8(0x80));
          UNROLL for (int t = 0; t < T; ++t) {
            int32_t four;
            std::memcpy(&four, a.x8 + t * a.K + k0 + 4 * c, sizeof(four));
            isum[t] = vdotq_s32(isum[t], vreinterpretq_s8_u8(q),
                                vreinterpretq_s8_s32(vdupq_n_s32(four)));
          }
        }
        if constexpr (SUBS > 1) {
          const int32x4_t scale = table_column(sc, j / 2, r, j % 2);
          UNROLL for (int t = 0; t < T; ++t) main[t] = vmlaq_s32(main[t], isum[t], scale);
        } else {
          UNROLL for (int t = 0; t < T; ++t) main[t] = vaddq_s32(main[t], isum[t]);
        }
      }
      if constexpr (OFF != 0 && !SIGNED_Q8) {  // main -= OFF * sum_j sc_j bsum_j
        int32x4_t off[T];
        if constexpr (SUBS > 1) {
          table_sums4<SUBS, T>(sc, bsum + s * SUBS, ld_bsum, r, off);
        } else {
          UNROLL for (int t = 0; t < T; ++t) off[t] = vdupq_n_s32(int32_t(bsum[t * ld_bsum + s]));
        }
        UNROLL for (int t = 0; t < T; ++t) main[t] = vsubq_s32(main[t], vshlq_n_s32(off[t], SHIFT));
      }
      const uint16_t* hf = half_floats + s * sb_bytes / 2;  // D [16], then M [16]
      const float32x4_t D = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(hf + r * 4)));
      UNROLL for (int t = 0; t < T; ++t) {
        const float32x4_t dx = vdupq_n_f32(a.dx[t * ld_dx + s]);
        sum[t] = vfmaq_f32(sum[t], vcvtq_f32_s32(main[t]), vmulq_f32(D, dx));
      }
      if constexpr (MINS != 0) {
        const float32x4_t M = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(hf + LANES + r * 4)));
        if constexpr (MINS == 1) {  // sum -= (M dx) * sum_j mn_j bsum_j
          int32x4_t mins[T];
          table_sums4<SUBS, T>(mn, bsum + s * SUBS, ld_bsum, r, mins);
          UNROLL for (int t = 0; t < T; ++t) {
            const float32x4_t mdx = vmulq_f32(M, vdupq_n_f32(a.dx[t * ld_dx + s]));
            sum[t] = vfmsq_f32(sum[t], mdx, vcvtq_f32_s32(mins[t]));
          }
        } else {  // sum -= M * sx
          UNROLL for (int t = 0; t < T; ++t)
            sum[t] = vfmsq_f32(sum[t], M, vdupq_n_f32(a.sx[t * ld_dx + s]));
        }
      }
    }
    UNROLL for (int t = 0; t < T; ++t) vst1q_f32(acc[t] + r * 4, sum[t]);
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
    const uint8_t* next = m0 == 0 && tile + 1 < tiles ? w + (tile + 1) * tile_bytes : nullptr;
    gguf_tile<BITS, S, SUBS, OFF, MINS, T>(w + tile * tile_bytes, nsb, a, next, acc);
    store_rows(&acc[0][0], T, tile * LANES, N, b, y + m0 * ldy, ldy);
  };
  for_each_tile<GGUF_TOKENS>(tiles, M, tile_bytes, run);
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
}

}  // namespace specdecode
