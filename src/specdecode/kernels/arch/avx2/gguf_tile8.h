// The GGUF tile (gguf_shared.h) on 8 lanes (AVX2, AVX-VNNI): half a tile (8 rows) at a
// time, by vpmaddubsw runs (AVX2) or vpdpbusd (VNNI); the arch folders avx2 and avxvnni each
// instantiate it.
#pragma once

#include "../../gguf_shared.h"

#include <immintrin.h>

#include <cstring>

namespace specdecode {
namespace {

// AVX2 works on half a tile at a time: rows 8 h .. 8 h + 7, one per 32-bit lane.

// Keeps v in a register here: GCC would otherwise reassociate a run's exact integer sums,
// computing every product first and spilling them to the stack (2-3x slower).
inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

// The u8 codes of quad c (values 4 c .. 4 c + 3) of rows 8 h .. 8 h + 7 of one tile's
// sub-block at `codes`, one row per 32-bit lane.
template <int BITS, int S>
inline __m256i quad_codes8(const uint8_t* codes, int c, int h) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * 64 + h * 32));
  } else {
    const __m256i nibbles =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (c / 2) * 64 + h * 32));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i low = (c % 2 == 0) ? _mm256_and_si256(nibbles, low4)
                                     : _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low4);
    if constexpr (BITS == 4) {
      return low;
    } else {  // quad c's high bits, at bits (BITS - 4) c of each byte of the plane, to bit 4
      // (16-bit shifts: what they carry across a byte falls outside the mask)
      const __m256i plane =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + PLANE_AT<S> + h * 32));
      const int shift = 4 - (BITS - 4) * c;
      const __m256i high =
          shift >= 0 ? _mm256_slli_epi16(plane, shift) : _mm256_srli_epi16(plane, -shift);
      const __m256i mask = _mm256_set1_epi8(char(((1 << (BITS - 4)) - 1) << 4));
      return _mm256_or_si256(low, _mm256_and_si256(high, mask));
    }
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

// gguf_tile (gguf_shared.h) on 8 lanes, with vpdpbusd (VNNI) or without, H halves of the tile
// (8 rows each) at a time: with H = 2 each broadcast of a token's 4 activation bytes serves 16
// rows (two vpmaddubsw), which on AVX2 costs a shuffle as well as a load; H = 1 keeps the
// registers for more tokens.
template <bool VNNI, int H, int BITS, int S, int SUBS, int OFF, int MINS, int T>
void gguf_tile8(const uint8_t* blk, int64_t nsb, const GgufActs& a, const uint8_t* next,
                float acc[T][LANES]) {
  static_assert(H == 1 || H == 2, "one half or both");
  using G = TileGeometry<BITS, S, SUBS, OFF, MINS>;
  const G geo(a);
  // The AVX-512 path's steps, on 8 rows a vector, with the same fp32 operations in the same
  // order (so the same bits). Without AVX-VNNI, vpmaddubsw (u8 x s8, pairs summed in int16,
  // saturating) stands in for vpdpbusd: the int16 pair sums of RUN quads stay below 2^15 for
  // codes of BITS <= 6 (|x8| <= 127), and 8-bit codes are summed as signed values (code - OFF,
  // |w| times x8 with w's sign), which subtracts OFF * bsum on the way.
  // With AVX-VNNI, vpdpbusd itself on 8 lanes (no int16 runs, codes as they are).
  constexpr bool SIGNED_Q8 = BITS == 8 && !VNNI;  // summed as code - OFF (see above)
  static_assert(BITS != 8 || (OFF == 128 && SUBS == 1), "8-bit codes: Q8_0 only");
  constexpr int RUN = VNNI ? S / 4 : BITS == 4 ? 8 : BITS == 5 ? 4 : BITS == 6 ? 2 : 1;
  static_assert((S / 4) % RUN == 0, "whole runs of quads per sub-block");
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  for (int h0 = 0; h0 < 2; h0 += H) {  // halves h0 .. h0 + H - 1
    __m256 sum[H][T];
    UNROLL for (int u = 0; u < H; ++u)
      UNROLL for (int t = 0; t < T; ++t) sum[u][t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; ++s) {
      const uint8_t* h = blk + s * G::sb_bytes;
      const int8_t* sc = reinterpret_cast<const int8_t*>(h + G::sc_at);
      const int8_t* mn = reinterpret_cast<const int8_t*>(h + G::mn_at);
      __m256i main[H][T];
      UNROLL for (int u = 0; u < H; ++u)
        UNROLL for (int t = 0; t < T; ++t) main[u][t] = _mm256_setzero_si256();
      _Pragma("GCC unroll 1") for (int j = 0; j < SUBS; ++j) {
        if (next != nullptr && h0 == 0) prefetch_part(next + s * G::sb_bytes, G::sb_bytes, j, SUBS);
        const int64_t k0 = (s * SUBS + j) * S;
        const uint8_t* codes = h + G::header + j * G::sub_bytes;
        __m256i scale[H], weight[H];  // sc_j of each row as int32 (SUBS > 1); see below
        UNROLL for (int u = 0; u < H; ++u) {
          scale[u] = _mm256_setzero_si256();
          if constexpr (SUBS > 1) {
            const __m256i pair = pair_vector8(sc, j / 2, h0 + u);
            scale[u] = j % 2 == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16)
                                  : _mm256_srai_epi32(pair, 16);
          }
          // Without VNNI each run's int16 pair sums go into main at once, times sc_j: vpmaddwd
          // with sc_j in both int16 halves of a row's lane (1 without a table); the same int32
          // sum as sc_j times the sub-block's sum.
          weight[u] = SUBS > 1 ? _mm256_blend_epi16(_mm256_slli_epi32(scale[u], 16), scale[u], 0x55)
                               : ones;
        }
        __m256i isum[H][T];  // with VNNI: the sub-block's int32 sums
        UNROLL for (int u = 0; u < H; ++u)
          UNROLL for (int t = 0; t < T; ++t) isum[u][t] = _mm256_setzero_si256();
        UNROLL for (int c0 = 0; c0 < S / 4; c0 += RUN) {
          __m256i pairs[H][T];  // int16 pair sums of the run's quads (without VNNI)
          UNROLL for (int u = 0; u < H; ++u)
            UNROLL for (int t = 0; t < T; ++t) pairs[u][t] = _mm256_setzero_si256();
          UNROLL for (int c = c0; c < c0 + RUN; ++c) {
            __m256i q[H], signed_q[H], magnitude[H];
            UNROLL for (int u = 0; u < H; ++u) {
              q[u] = quad_codes8<BITS, S>(codes, c, h0 + u);
              signed_q[u] = _mm256_xor_si256(q[u], flip);  // BITS 8: code - 128
              magnitude[u] = _mm256_abs_epi8(signed_q[u]);  // BITS 8 without VNNI
            }
            UNROLL for (int t = 0; t < T; ++t) {
              const __m256i x = _mm256_set1_epi32(
                  *reinterpret_cast<const unaligned_i32*>(a.x8 + t * a.K + k0 + 4 * c));
              UNROLL for (int u = 0; u < H; ++u) {
                if constexpr (VNNI) {
                  isum[u][t] = _mm256_dpbusd_avx_epi32(isum[u][t], q[u], x);
                } else {
                  const __m256i products =
                      BITS == 8
                          ? _mm256_maddubs_epi16(magnitude[u], _mm256_sign_epi8(x, signed_q[u]))
                          : _mm256_maddubs_epi16(q[u], x);
                  pairs[u][t] = _mm256_add_epi16(pairs[u][t], products);
                  keep_in_register(pairs[u][t]);
                }
              }
            }
          }
          if constexpr (!VNNI) {
            UNROLL for (int u = 0; u < H; ++u)
              UNROLL for (int t = 0; t < T; ++t)
                main[u][t] =
                    _mm256_add_epi32(main[u][t], _mm256_madd_epi16(pairs[u][t], weight[u]));
          }
        }
        if constexpr (VNNI) {
          UNROLL for (int u = 0; u < H; ++u)
            UNROLL for (int t = 0; t < T; ++t) {
              __m256i total = isum[u][t];
              if constexpr (SUBS > 1) total = _mm256_mullo_epi32(total, scale[u]);
              main[u][t] = _mm256_add_epi32(main[u][t], total);
            }
        }
      }
      UNROLL for (int u = 0; u < H; ++u) {
        const int half = h0 + u;
        if constexpr (OFF != 0 && !SIGNED_Q8) {  // main -= OFF * sum_j sc_j bsum_j
          __m256i off[T];
          if constexpr (SUBS > 1) {
            table_sums8<SUBS, T>(sc, geo.bsum + s * SUBS, geo.ld_bsum, half, off);
          } else {
            UNROLL for (int t = 0; t < T; ++t)
              off[t] = _mm256_set1_epi32(int32_t(geo.bsum[t * geo.ld_bsum + s]));
          }
          UNROLL for (int t = 0; t < T; ++t)
            main[u][t] = _mm256_sub_epi32(main[u][t], _mm256_slli_epi32(off[t], G::SHIFT));
        }
        const __m256 D =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + half * 16)));
        UNROLL for (int t = 0; t < T; ++t) {
          const __m256 dx = _mm256_set1_ps(a.dx[t * geo.ld_dx + s]);
          sum[u][t] =
              _mm256_fmadd_ps(_mm256_cvtepi32_ps(main[u][t]), _mm256_mul_ps(D, dx), sum[u][t]);
        }
        if constexpr (MINS != 0) {
          const __m256 M = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * LANES + half * 16)));
          if constexpr (MINS == 1) {  // sum -= (M dx) * sum_j mn_j bsum_j
            __m256i mins[T];
            table_sums8<SUBS, T>(mn, geo.bsum + s * SUBS, geo.ld_bsum, half, mins);
            UNROLL for (int t = 0; t < T; ++t) {
              const __m256 mdx = _mm256_mul_ps(M, _mm256_set1_ps(a.dx[t * geo.ld_dx + s]));
              sum[u][t] = _mm256_fnmadd_ps(mdx, _mm256_cvtepi32_ps(mins[t]), sum[u][t]);
            }
          } else {  // sum -= M * sx
            UNROLL for (int t = 0; t < T; ++t)
              sum[u][t] = _mm256_fnmadd_ps(M, _mm256_set1_ps(a.sx[t * geo.ld_dx + s]), sum[u][t]);
          }
        }
      }
    }
    UNROLL for (int u = 0; u < H; ++u)
      UNROLL for (int t = 0; t < T; ++t) _mm256_storeu_ps(acc[t] + (h0 + u) * 8, sum[u][t]);
  }
}

}  // namespace
}  // namespace specdecode
