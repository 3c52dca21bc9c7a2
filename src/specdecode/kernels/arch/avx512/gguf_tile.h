// The GGUF tile (gguf_shared.h) on AVX-512 VNNI: 16 rows in one vector, vpdpbusd (64 u8 x s8
// products) with each token's 4 activation bytes as its broadcast memory operand.
#pragma once

#include "../../gguf_shared.h"

#include <immintrin.h>

#include <cstring>

namespace specdecode {
namespace {

// tokens per tile, at most: 10, so that a 9-token verification pass (8 drafted tokens) is one
// group, which decodes the codes once while they stream in. With 32 vector registers 8
// tokens' int32 and fp32 sums fit; at 9-10 the compiler spills some of the fp32 sums, touched
// once a superblock. Measured against 8 (benchmarks/gguf_ab.py, AMD EPYC Zen 4, one thread,
// 2026-11-28): 9 tokens in one group instead of 5 + 4 1.04x (Q4_K), 1.18x (Q6_K), 1.07x
// (Q4_0), 1.04x (Q8_0); 1-8 and 16 tokens unchanged.
template <int BITS>
constexpr int GGUF_TOKENS = 10;

// The fewest tokens a tile computes for which it prefetches the next tile (gguf.cpp: `next`).
// For one token the hardware prefetchers keep the stream going alone and the software
// prefetch slows it: whole 1-token passes of Qwen2.5-1.5B (gguf) with it 29.3 ms, without
// 25.3 ms (median of 1,542 interleaved pairs, 1.14x; 1.11x in another 2,461), of the 0.5B
// (q4_0) 9.4 against 8.6 ms (1.09x); at 2 and 3 tokens it pays (0.96x, 0.97x without it) and
// from 4 on the pass costs 1.5-1.6x without it. AMD EPYC Zen 4, 2 threads, 2026-11-29.
constexpr int PREFETCH_FROM_TOKENS = 2;

// The u8 codes of quad c (values 4 c .. 4 c + 3 of each of the 16 rows) of one tile's
// sub-block at `codes`, one row per 32-bit lane.
template <int BITS, int S>
inline __m512i quad_codes(const uint8_t* codes, int c) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(codes + c * 64);
  } else {
    const __m512i nibbles = _mm512_loadu_si512(codes + (c / 2) * 64);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i low = (c % 2 == 0) ? _mm512_and_si512(nibbles, low4)
                                     : _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low4);
    if constexpr (BITS == 4) {
      return low;
    } else {  // quad c's high bits, at bits (BITS - 4) c of each byte of the plane, to bit 4
      // (16-bit shifts: what they carry across a byte falls outside the mask)
      const __m512i plane = _mm512_loadu_si512(codes + PLANE_AT<S>);
      const int shift = 4 - (BITS - 4) * c;
      const __m512i high =
          shift >= 0 ? _mm512_slli_epi16(plane, shift) : _mm512_srli_epi16(plane, -shift);
      const __m512i mask = _mm512_set1_epi8(char(((1 << (BITS - 4)) - 1) << 4));
      return _mm512_ternarylogic_epi32(low, high, mask, 0xF8);  // low | (high & mask)
    }
  }
}

// acc += q (u8) times the 4 int8 at x in every lane: vpdpbusd with x as its broadcast memory
// operand (one instruction; GCC would load and broadcast x apart).
inline void dpbusd_broadcast(__m512i& acc, __m512i q, const int8_t* x) {
  asm("vpdpbusd %[x]%{1to16%}, %[q], %[acc]"
      : [acc] "+v"(acc)
      : [q] "v"(q), [x] "m"(*reinterpret_cast<const unaligned_i32*>(x)));
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

template <int BITS, int S, int SUBS, int OFF, int MINS, int T>
void gguf_tile(const uint8_t* blk, int64_t nsb, const GgufActs& a, const uint8_t* next,
               float acc[T][LANES]) {
  using G = TileGeometry<BITS, S, SUBS, OFF, MINS>;
  [[maybe_unused]] const G geo(a);
  // One token alone sums even and odd quads apart (shorter dependency chains; integer sums
  // are exact in any order).
  constexpr int P = T == 1 ? 2 : 1;
  __m512 sum[T];
  UNROLL for (int t = 0; t < T; ++t) sum[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* h = blk + s * G::sb_bytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(h + G::sc_at);
    const int8_t* mn = reinterpret_cast<const int8_t*>(h + G::mn_at);
    __m512i main[T];
    UNROLL for (int t = 0; t < T; ++t) main[t] = _mm512_setzero_si512();
    // the sub-blocks in a loop: unrolled, the compiler hoists loads across them and spills
    _Pragma("GCC unroll 1") for (int j = 0; j < SUBS; ++j) {
      if (next != nullptr) prefetch_part(next + s * G::sb_bytes, G::sb_bytes, j, SUBS);
      const int64_t k0 = (s * SUBS + j) * S;
      const uint8_t* codes = h + G::header + j * G::sub_bytes;
      __m512i isum[P][T];
      UNROLL for (int p = 0; p < P; ++p)
        UNROLL for (int t = 0; t < T; ++t) isum[p][t] = _mm512_setzero_si512();
      UNROLL for (int c = 0; c < S / 4; ++c) {
        const __m512i q = quad_codes<BITS, S>(codes, c);
        UNROLL for (int t = 0; t < T; ++t) {
          dpbusd_broadcast(isum[c % P][t], q, a.x8 + t * a.K + k0 + 4 * c);
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
        table_sums<SUBS, T>(sc, geo.bsum + s * SUBS, geo.ld_bsum, off);
      } else {
        UNROLL for (int t = 0; t < T; ++t)
          off[t] = _mm512_set1_epi32(int32_t(geo.bsum[t * geo.ld_bsum + s]));
      }
      UNROLL for (int t = 0; t < T; ++t)
        main[t] = _mm512_sub_epi32(main[t], _mm512_slli_epi32(off[t], G::SHIFT));
    }
    const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h));
    UNROLL for (int t = 0; t < T; ++t) {
      const __m512 dx = _mm512_set1_ps(a.dx[t * geo.ld_dx + s]);
      sum[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(main[t]), _mm512_mul_ps(D, dx), sum[t]);
    }
    if constexpr (MINS != 0) {
      const __m512 M = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + 2 * LANES)));
      if constexpr (MINS == 1) {  // sum -= (M dx) * sum_j mn_j bsum_j
        __m512i mins[T];
        table_sums<SUBS, T>(mn, geo.bsum + s * SUBS, geo.ld_bsum, mins);
        UNROLL for (int t = 0; t < T; ++t) {
          const __m512 mdx = _mm512_mul_ps(M, _mm512_set1_ps(a.dx[t * geo.ld_dx + s]));
          sum[t] = _mm512_fnmadd_ps(mdx, _mm512_cvtepi32_ps(mins[t]), sum[t]);
        }
      } else {  // sum -= M * sx
        UNROLL for (int t = 0; t < T; ++t)
          sum[t] = _mm512_fnmadd_ps(M, _mm512_set1_ps(a.sx[t * geo.ld_dx + s]), sum[t]);
      }
    }
  }
  UNROLL for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc[t], sum[t]);
}

}  // namespace
}  // namespace specdecode
