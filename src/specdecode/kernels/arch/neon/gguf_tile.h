// The GGUF tile (gguf_shared.h) on ARM64 NEON with the dot-product instructions: a quarter of
// a tile (4 rows) at a time, sdot (16 s8 x s8 products).
#pragma once

#include "../../gguf_shared.h"

#include <arm_neon.h>

#include <cstring>

namespace specdecode {
namespace {

// tokens per tile, at most: with 32 vector registers, 8 tokens' int32 and fp32 sums fit
template <int BITS>
constexpr int GGUF_TOKENS = 8;

// The fewest tokens a tile computes for which it prefetches the next tile (gguf.cpp: `next`):
// every count (not measured without it on an ARM64 CPU).
constexpr int PREFETCH_FROM_TOKENS = 1;

// NEON works on a quarter of a tile at a time: rows 4 r .. 4 r + 3, one per 32-bit lane.

// The u8 codes of quad c (values 4 c .. 4 c + 3) of rows 4 r .. 4 r + 3 of one tile's
// sub-block at `codes`, one row per 32-bit lane.
template <int BITS, int S>
inline uint8x16_t quad_codes4(const uint8_t* codes, int c, int r) {
  if constexpr (BITS == 8) {
    return vld1q_u8(codes + c * 64 + r * 16);
  } else {
    const uint8x16_t nibbles = vld1q_u8(codes + (c / 2) * 64 + r * 16);
    const uint8x16_t low =
        (c % 2 == 0) ? vandq_u8(nibbles, vdupq_n_u8(0x0F)) : vshrq_n_u8(nibbles, 4);
    if constexpr (BITS == 4) {
      return low;
    } else {  // quad c's high bits, at bits (BITS - 4) c of each byte of the plane, to bit 4
      const uint8x16_t plane = vld1q_u8(codes + PLANE_AT<S> + r * 16);
      const uint8x16_t high = vshlq_u8(plane, vdupq_n_s8(int8_t(4 - (BITS - 4) * c)));
      return vorrq_u8(low, vandq_u8(high, vdupq_n_u8(uint8_t(((1 << (BITS - 4)) - 1) << 4))));
    }
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

template <int BITS, int S, int SUBS, int OFF, int MINS, int T>
void gguf_tile(const uint8_t* blk, int64_t nsb, const GgufActs& a, const uint8_t* next,
               float acc[T][LANES]) {
  using G = TileGeometry<BITS, S, SUBS, OFF, MINS>;
  const G geo(a);
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
      const uint8_t* h = blk + s * G::sb_bytes;
      const int8_t* sc = reinterpret_cast<const int8_t*>(h + G::sc_at);
      const int8_t* mn = reinterpret_cast<const int8_t*>(h + G::mn_at);
      int32x4_t main[T];
      UNROLL for (int t = 0; t < T; ++t) main[t] = vdupq_n_s32(0);
      _Pragma("GCC unroll 1") for (int j = 0; j < SUBS; ++j) {
        if (next != nullptr && r == 0) prefetch_part(next + s * G::sb_bytes, G::sb_bytes, j, SUBS);
        const int64_t k0 = (s * SUBS + j) * S;
        const uint8_t* codes = h + G::header + j * G::sub_bytes;
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
          table_sums4<SUBS, T>(sc, geo.bsum + s * SUBS, geo.ld_bsum, r, off);
        } else {
          UNROLL for (int t = 0; t < T; ++t)
            off[t] = vdupq_n_s32(int32_t(geo.bsum[t * geo.ld_bsum + s]));
        }
        UNROLL for (int t = 0; t < T; ++t)
          main[t] = vsubq_s32(main[t], vshlq_n_s32(off[t], G::SHIFT));
      }
      const uint16_t* hf = half_floats + s * G::sb_bytes / 2;  // D [16], then M [16]
      const float32x4_t D = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(hf + r * 4)));
      UNROLL for (int t = 0; t < T; ++t) {
        const float32x4_t dx = vdupq_n_f32(a.dx[t * geo.ld_dx + s]);
        sum[t] = vfmaq_f32(sum[t], vcvtq_f32_s32(main[t]), vmulq_f32(D, dx));
      }
      if constexpr (MINS != 0) {
        const float32x4_t M = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(hf + LANES + r * 4)));
        if constexpr (MINS == 1) {  // sum -= (M dx) * sum_j mn_j bsum_j
          int32x4_t mins[T];
          table_sums4<SUBS, T>(mn, geo.bsum + s * SUBS, geo.ld_bsum, r, mins);
          UNROLL for (int t = 0; t < T; ++t) {
            const float32x4_t mdx = vmulq_f32(M, vdupq_n_f32(a.dx[t * geo.ld_dx + s]));
            sum[t] = vfmsq_f32(sum[t], mdx, vcvtq_f32_s32(mins[t]));
          }
        } else {  // sum -= M * sx
          UNROLL for (int t = 0; t < T; ++t)
            sum[t] = vfmsq_f32(sum[t], M, vdupq_n_f32(a.sx[t * geo.ld_dx + s]));
        }
      }
    }
    UNROLL for (int t = 0; t < T; ++t) vst1q_f32(acc[t] + r * 4, sum[t]);
  }
}

}  // namespace
}  // namespace specdecode
