// The kernels' plain C++ interface: raw pointers and sizes, nothing from torch. The cores
// (matmul.cpp, gguf.cpp, attention.cpp, pointwise.cpp) implement it; tensors.cpp binds it to
// torch tensors (the checks, the allocations and torch's thread pool), and the native test
// driver (tests/native/driver.cpp) calls it directly on every variant, ARM64 under qemu
// included. Each function is declared for fp32 and bf16 (`float`, `BFloat16`) where its
// activations may be either.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

namespace specdecode {

// bf16 as torch stores it (c10::BFloat16: the top 16 bits of an fp32), rounded as torch rounds
// (to nearest even; NaN -> 0x7FC0), so a core's bf16 results are torch's bits.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  BFloat16(float value) {  // NOLINT: implicit, as c10::BFloat16's
    uint32_t u;
    std::memcpy(&u, &value, sizeof(u));
    bits = value != value ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
  operator float() const {  // NOLINT: implicit, as c10::BFloat16's
    const uint32_t u = uint32_t(bits) << 16;
    float value;
    std::memcpy(&value, &u, sizeof(value));
    return value;
  }
};

// IEEE fp16 -> fp32 (exact).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t u;
  if (exp == 0x1F) {  // inf, NaN
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp == 0) {  // zero, subnormal: man * 2^-24
    const float value = float(man) * 5.9604644775390625e-8f;
    return sign ? -value : value;
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float value;
  std::memcpy(&value, &u, sizeof(value));
  return value;
}

// fp32 -> IEEE fp16, rounded to nearest even (as c10::Half and the hardware conversions).
inline uint16_t float_to_half(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  const uint32_t sign = (u >> 16) & 0x8000, mag = u & 0x7FFFFFFFu;
  if (mag >= 0x7F800000u) return uint16_t(sign | (mag > 0x7F800000u ? 0x7E00 : 0x7C00));
  if (mag >= 0x477FF000u) return uint16_t(sign | 0x7C00);  // >= 65520: rounds to inf
  uint32_t h, rest, half;
  if (mag < 0x38800000u) {  // below 2^-14: a subnormal half (units of 2^-24) or zero
    const uint32_t exp = mag >> 23;
    if (exp < 102) return uint16_t(sign);  // below 2^-25
    const uint32_t man = (mag & 0x7FFFFFu) | 0x800000u, shift = 126 - exp;
    h = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
  } else {  // normal: exponent rebased from 127 to 15, 23 mantissa bits rounded to 10
    h = (mag >> 13) - ((127 - 15) << 10), rest = mag & 0x1FFF, half = 0x1000;
  }
  if (rest > half || (rest == half && (h & 1))) ++h;  // a carry moves into the exponent
  return uint16_t(sign | h);
}

// body(begin, end) over chunks of [begin, end) of at least `grain` items, on the thread pool
// of whoever links the cores (torch's in tensors.cpp; the test driver's own).
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& body);

// The number of threads parallel_for may run the chunks on.
int64_t max_threads();

// ---------------------------------------------------------------- matmul.cpp

constexpr int64_t MATMUL_ROWS = 64;  // output rows per packed block of int8 / bf16 weights
constexpr int64_t I8_PACK = 4;       // int8 values of a row per 32-bit lane
constexpr int64_t BF16_PACK = 2;     // bf16 values of a row per 32-bit lane

// y [M, N] = x [M, K] @ W^T (+ bias): W int8 packed [blocks, Kp / 4, 64, 4] (K <= Kp < K + 4)
// with one fp32 scale and one int32 row sum per packed row (w_scale, w_sum [blocks * 64]);
// each row of x quantized to int8 by its own absmax; bias fp32 [N] or nullptr.
template <typename T>
void int8_matmul(const T* x, int64_t M, int64_t K, const int8_t* w, int64_t blocks, int64_t Kp,
                 const float* w_scale, const int32_t* w_sum, const float* bias, int64_t N, T* y);

// y [M, N] = x [M, Kp] @ W^T (+ bias) in bf16 with fp32 sums: W packed [blocks, Kp / 2, 64, 2],
// x zero-padded to Kp columns.
void bf16_matmul(const BFloat16* x, int64_t M, const BFloat16* w, int64_t blocks, int64_t Kp,
                 const float* bias, int64_t N, BFloat16* y);

// Selects (true) or leaves (false) the AMX path; returns whether AMX is now used where it can
// be (false where it is not compiled in or the OS refuses it).
bool set_amx(bool wanted);

// What the matmuls run on, per format, e.g. "int8: avx512-vnni, bf16: avx512-bf16".
std::string isa();

// ---------------------------------------------------------------- gguf.cpp

constexpr int64_t GGUF_ROWS = 16;  // output rows per packed GGUF tile

// A packed GGUF weight's block code (gguf.cpp's header): BITS-bit codes, sub-blocks of S values,
// SUBS of them per superblock, code offset OFF, and MINS (0: none, 1: a min table, 2: a min).
struct GgufLayout {
  int64_t bits, sub, subs, off, mins;
  constexpr int64_t sub_bytes() const { return GGUF_ROWS * sub * bits / 8; }
  constexpr int64_t header_bytes() const {
    return (mins ? 2 : 1) * GGUF_ROWS * 2 + (subs > 1 ? subs * GGUF_ROWS : 0) +
           (mins == 1 ? subs * GGUF_ROWS : 0);
  }
  constexpr int64_t superblock_bytes() const { return header_bytes() + subs * sub_bytes(); }
  constexpr int64_t superblock_values() const { return sub * subs; }
};

// Whether gguf_matmul has a kernel for the layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K).
bool gguf_supported(const GgufLayout& layout);

// M tokens' activations quantized for gguf_matmul in blocks of B (32 or 256): x8 int8 [M, K],
// dx [M, K / B], sx [M, K / B] (B == 32 only; else unused), bsum16 [M, K / 16], bsum32
// [M, K / 32].
struct GgufActs {
  const int8_t* x8;
  const float* dx;
  const float* sx;
  const int16_t* bsum16;
  const int16_t* bsum32;
  int64_t K;
};

// x [M, K] (K % block == 0, block 32 or 256) -> the arrays of GgufActs (see gguf.cpp's header).
template <typename T>
void gguf_quantize(const T* x, int64_t M, int64_t K, int64_t block, int8_t* x8, float* dx,
                   float* sx, int16_t* bsum16, int16_t* bsum32);

// y[:, 0:N] (rows at stride ldy) = acts @ W^T (+ bias) for one packed weight w
// [tiles, K / B, superblock bytes] of a supported layout; bias fp32 [N] or nullptr.
template <typename T>
void gguf_matmul(const GgufActs& acts, int64_t M, const uint8_t* w, int64_t tiles,
                 const GgufLayout& layout, const float* bias, int64_t N, T* y, int64_t ldy);

// q uint8 [Np, K] (codes of `bits` bits; Np % 16 == 0, K % (sub * subs) == 0, sub % 8 == 0) ->
// out [Np / 16, K / (sub * subs), subs * sub_bytes]: the codes in the tiles' layout.
void gguf_pack_codes(const uint8_t* q, int64_t Np, int64_t K, int64_t bits, int64_t sub,
                     int64_t subs, uint8_t* out);

// ---------------------------------------------------------------- attention.cpp

// The geometry of one attention call: q and out [B, H, T, D] contiguous; k and v pools of blocks
// [blocks, Hkv, block_size, D] at these element strides (the same for both; last dim
// contiguous). Row b's slot s is slot s % block_size of block table[b * max_blocks + s /
// block_size]. A rectangular cache [B, Hkv, S, D] is the case block_size = S, table[b] = b.
// window > 0: sliding-window attention, a query at position p reads no slot before
// p - window + 1 (see `attention`). softcap > 0: each score becomes softcap * tanh(score /
// softcap) before the softmax (Gemma 2).
struct AttentionShape {
  int64_t B, H, T, D, Hkv;
  int64_t block_stride, head_stride, slot_stride;
  int64_t block_size, max_blocks;
  const int64_t* table;  // [B, max_blocks]
  int64_t window = 0;    // 0: every earlier slot
  float softcap = 0.f;   // 0: scores as they are
};

// Query t of row b (position p = starts[b] + t) attends to slots 0 .. p. A tree pass
// (tree_starts != nullptr) instead reads slots 0 .. tree_starts[b] - 1 and then
// tree_starts[b] + r for the increasing offsets r in extra[extra_begin[q] .. extra_begin[q + 1])
// of query q = b * T + t: its ancestors and itself, so p = tree_starts[b] + their count - 1.
// With a window, the slots before tree_starts[b] (or the chain's) start at p - window + 1 (a
// tree's own slots are all read: the caller keeps trees shallower than the window).
template <typename T>
void attention(const T* q, const T* k, const T* v, const AttentionShape& shape,
               const int64_t* starts, const int64_t* tree_starts, const int64_t* extra,
               const int64_t* extra_begin, T* out);

// ---------------------------------------------------------------- pointwise.cpp

// out[r] = the index of the first largest value of row r of x [rows, N] (N >= 1), a NaN
// counting as the largest (the first NaN's index): torch.argmax(x, -1).
template <typename T>
void argmax(const T* x, int64_t rows, int64_t N, int64_t* out);

// y [rows, D] = w * x / rms(x) row by row, the rms in fp32; w in x's dtype (applied after
// rounding x / rms(x)) or fp32 under bf16 x (applied before rounding).
template <typename T, typename W>
void rms_norm(const T* x, const W* w, int64_t rows, int64_t D, float eps, T* y);

// RoPE in place on the first `heads` heads of D values of each of `tokens` rows of W values;
// cos, sin fp32 [tokens, D].
template <typename T>
void rope(T* x, const float* cos, const float* sin, int64_t tokens, int64_t W, int64_t heads,
          int64_t D);

// ---------------------------------------------------------------- peak.cpp

// The int8 multiply-adds a second (1e9) that this variant's int8 vector instruction reaches
// from registers on every pool thread at once: `iterations` rounds of PEAK_CHAINS independent
// instructions a thread (AVX-512 VNNI vpdpbusd, 64 products; AVX-VNNI vpdpbusd, 32; AVX2
// vpmaddubsw, 32; NEON sdot, 16; portable: one scalar multiply-add). The roofline's compute
// ceiling for the int8 and GGUF matmuls, which spend their products in that instruction.
double int8_peak(int64_t iterations);

}  // namespace specdecode
