// CPU matmuls y = x @ W^T (+ b) for the model's projections: they read the weights at memory
// bandwidth when a pass holds few tokens (decode, draft verification) and stay
// compute-efficient for long passes (prefill). Python packs the weights (kernels/__init__.py).
//
// int8_linear: W int8 with one fp32 scale per output row; each activation row is quantized on
//   the fly to int8 with its own scale (absmax / 127). Integer sums (AVX-512 VNNI `vpdpbusd`
//   in the AVX-512 variants, its 256-bit AVX-VNNI form in avxvnni, `vpmaddubsw` + `vpmaddwd`
//   in avx2, `sdot` in neon, plain C++ elsewhere)
//   are exact, so a token's output never depends on the other tokens of the pass, and every
//   variant gives the same bits.
// bf16_linear: W and x bf16, products summed in fp32 (AVX-512 BF16 `vdpbf16ps` in the AVX-512
//   variants; elsewhere fp32 multiplies and adds, 8 lanes at a time with AVX2, 4 with NEON).
//   Each output element is summed in one fixed order whatever the number of tokens, so this
//   kernel is row-exact too.
//
// Packed layout: W [N, K], zero-padded to [Np, Kp], stored as [Np / ROWS, Kp / P, ROWS, P] with
// P values of a row per 32-bit lane (P = 4 int8 or 2 bf16). A tile is ROWS output rows x up to
// TOKENS tokens and reads one sequential stream; each 64-byte weight vector holds P columns of
// 16 rows and meets, per token, those P activations broadcast to every lane. So every lane
// accumulates one (row, token) pair by itself: no horizontal sums, and the same order of
// summation whatever the tile shape. Compiled with -ffp-contract=off so the fp32 epilogue
// rounds exactly as the Python reference does.
//
// AMX (Intel's tile matrix unit, where the compiler targets it and the OS grants it): a tile
// multiply-add takes up to 16 tokens x 64 bytes of K against 16 rows, so a pass over 2-16 tokens
// costs about what a 1-token pass does (both stream the weights once; the vector path above
// spends a multiply-add per token and weight vector). The packed layout above is already AMX's
// B-tile layout (16 lanes x P values of 16 consecutive k-groups, 256 bytes apart), so both paths
// read the same weights. int8: exact integer sums, the same bits as the vector path, which
// keeps 1-token passes (AMX measured 0-3% slower there). bf16: AMX
// sums a lane's pairs in its own fixed order, so when AMX runs a weight it runs it for every
// token count (a token's bits never depend on the pass), and results may differ from the
// vector path's in the last bit. Weights whose input width is not a multiple of one tile's K
// (64 int8 / 32 bf16 values) take the vector path. `set_amx(false)` (or SPECDECODE_AMX=0 at
// load) selects the vector path everywhere.

#include "core.h"
#include "epilogue.h"  // this variant's: its arch folder (setup.py)
#include "matmul_dot.h"  // this variant's: its arch folder (setup.py)
#include "matmul_shared.h"
#include "tiles.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__linux__)
#define SPECDECODE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#endif

namespace specdecode {
namespace {

static_assert(ROWS == MATMUL_ROWS, "a packed block is one tile's rows");

// A tile's weights: one packed block [Kp / P, GROUPS, LANES, P] (P = I8_PACK or BF16_PACK), so
// the 32-bit lane l of vector (j, g) holds row g * LANES + l, columns j * P .. j * P + P - 1.
// Each lane accumulates one (row, token) pair: the kernel needs no horizontal sums, and the
// order in which a lane sums its products is the same for every tile shape.

// ---------------------------------------------------------------- int8

// x row [K] -> u8 codes [Kp] = q + 128 (q = round(x * 127 / absmax) in [-127, 127], 0 past K)
// and its scale absmax / 127.
template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t K, int64_t Kp, uint8_t* codes, float* scale) {
  float absmax = 0.f;
  int64_t k = absmax_lanes(x, K, absmax);
  for (; k < K; ++k) absmax = std::max(absmax, std::abs(float(x[k])));
  absmax = std::max(absmax, 1e-8f);
  const float inv = 127.f / absmax;
  k = code_lanes(x, K, inv, codes);
  for (; k < K; ++k) {
    const float q = std::nearbyint(float(x[k]) * inv);
    codes[k] = uint8_t(int32_t(std::min(127.f, std::max(-127.f, q))) + 128);
  }
  std::fill(codes + K, codes + Kp, uint8_t(128));
  *scale = absmax / 127.f;
}

// ---------------------------------------------------------------- AMX

constexpr int64_t AMX_TOKENS = 16;   // A-tile rows: tokens per tile multiply
constexpr int64_t AMX_K_BYTES = 64;  // A-tile columns: bytes of K per tile multiply

#if defined(SPECDECODE_AMX)
// The tile registers' shapes (the `ldtilecfg` operand, palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile register
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Tiles 0-3: the accumulators of the 4 row groups (M tokens x 16 lanes of 4 bytes); tile 4: A,
// M tokens x 64 bytes of K; tiles 5 and 6: B, 16 k-groups x 64 bytes (taken in turns).
constexpr TileConfig tile_config(int64_t M) {
  TileConfig config;
  for (int i = 0; i < 5; ++i) {
    config.rows[i] = uint8_t(M);
    config.colsb[i] = AMX_K_BYTES;
  }
  for (int i = 5; i < 7; ++i) {
    config.rows[i] = 16;
    config.colsb[i] = AMX_K_BYTES;
  }
  return config;
}

// The configurations for 1 .. AMX_TOKENS tokens, in static memory. They are never built on the
// stack: `ldtilecfg` reads 64 bytes, but GCC's `_tile_loadconfig` (up to GCC 13 at least) tells
// the compiler its operand is one pointer (8 bytes), so the stores of a stack copy may be
// dropped as dead. gcc -O2 dropped every row and column count (only the palette stayed), so
// the first `tilezero` met unconfigured tiles and faulted (SIGILL); -O3 happened to keep them.
// A static table's 64 bytes are all in memory, whatever the compiler assumes the asm reads.
constexpr auto TILE_CONFIGS = [] {
  std::array<TileConfig, AMX_TOKENS + 1> configs{};
  for (int64_t M = 1; M <= AMX_TOKENS; ++M) configs[M] = tile_config(M);
  return configs;
}();

// Loads the tile shapes for M tokens (1 <= M <= AMX_TOKENS).
void configure_tiles(int64_t M) { _tile_loadconfig(&TILE_CONFIGS[M]); }

// Linux hands out the tile registers' state only to a process that asks (once per process).
bool amx_granted() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
    constexpr long XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

// Whether to use AMX where it can be: SPECDECODE_AMX=0 at load, or set_amx, says no.
std::atomic<bool> amx_wanted{[] {
  const char* flag = std::getenv("SPECDECODE_AMX");
  return flag == nullptr || std::string(flag) != "0";
}()};

// Prefetches the 4 KB k-step PREFETCH_STEPS ahead of the one at b (the hardware prefetchers stop
// at page boundaries; a k-step is a page). Reading past a block's end is harmless.
constexpr int64_t PREFETCH_STEPS = 2;
inline void prefetch_ahead(const char* b) {
  const char* ahead = b + PREFETCH_STEPS * ROWS * AMX_K_BYTES;
  UNROLL for (int64_t line = 0; line < ROWS * AMX_K_BYTES; line += 64)
    _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// Multiplies A (tile 4) by the B tile of each row group g of the k-step at byte address b (4 KB:
// 16 k-groups of 64 rows x 4 bytes; group g's 64 bytes of each k-group at b + g * 64) into
// accumulator g, with the tile multiply-add DP.
#define SPECDECODE_AMX_GROUPS(DP, b)    \
  _tile_loadd(5, (b) + 0 * 64, ROWS * 4); \
  DP(0, 4, 5);                          \
  _tile_loadd(6, (b) + 1 * 64, ROWS * 4); \
  DP(1, 4, 6);                          \
  _tile_loadd(5, (b) + 2 * 64, ROWS * 4); \
  DP(2, 4, 5);                          \
  _tile_loadd(6, (b) + 3 * 64, ROWS * 4); \
  DP(3, 4, 6)

void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// acc [GROUPS, M, LANES] <- the accumulator tiles (4-byte int32 or fp32 lanes).
template <typename acc_t>
void store_accumulators(acc_t* acc, int64_t M) {
  static_assert(sizeof(acc_t) == 4, "accumulator lanes are 4 bytes");
  const int64_t stride = LANES * sizeof(acc_t);
  _tile_stored(0, acc + 0 * M * LANES, stride);
  _tile_stored(1, acc + 1 * M * LANES, stride);
  _tile_stored(2, acc + 2 * M * LANES, stride);
  _tile_stored(3, acc + 3 * M * LANES, stride);
}

// acc [GROUPS, M, LANES] = what dot_u8s8<M> gives, with the tiles configured for M tokens:
// a u8 codes [M, lda]; b one packed block; Kp % 64 == 0.
void amx_u8s8(const uint8_t* a, int64_t lda, const int8_t* b, int64_t Kp, int64_t M,
              int32_t* acc) {
  zero_accumulators();
  for (int64_t k = 0; k < Kp; k += AMX_K_BYTES, b += ROWS * AMX_K_BYTES) {
    prefetch_ahead(reinterpret_cast<const char*>(b));
    _tile_loadd(4, a + k, lda);
    SPECDECODE_AMX_GROUPS(_tile_dpbusd, b);
  }
  store_accumulators(acc, M);
}

// acc [GROUPS, M, LANES] fp32 sums of a bf16 [M, lda] by one packed bf16 block; Kp % 32 == 0.
void amx_bf16(const BFloat16* a, int64_t lda, const BFloat16* b, int64_t Kp, int64_t M,
              float* acc) {
  constexpr int64_t step = AMX_K_BYTES / sizeof(BFloat16);
  zero_accumulators();
  for (int64_t k = 0; k < Kp; k += step, b += ROWS * step) {
    prefetch_ahead(reinterpret_cast<const char*>(b));
    _tile_loadd(4, a + k, lda * sizeof(BFloat16));
    SPECDECODE_AMX_GROUPS(_tile_dpbf16ps, reinterpret_cast<const char*>(b));
  }
  store_accumulators(acc, M);
}
#else
// never called: use_amx is false without AMX
void amx_u8s8(const uint8_t*, int64_t, const int8_t*, int64_t, int64_t, int32_t*) {}
void amx_bf16(const BFloat16*, int64_t, const BFloat16*, int64_t, int64_t, float*) {}
#endif

// Whether a weight of Kp packed bytes per row runs on AMX here.
bool use_amx(int64_t row_bytes) {
#if defined(SPECDECODE_AMX)
  return amx_wanted && row_bytes % AMX_K_BYTES == 0 && amx_granted();
#else
  (void)row_bytes;
  return false;
#endif
}

// ---------------------------------------------------------------- tiling


// for_each_tile for the AMX path: tile(block, m0, T) with T <= AMX_TOKENS and the tile
// registers configured for T tokens (each thread configures its own, and releases them).
template <class Tile>
void for_each_amx_tile(int64_t blocks, int64_t M, int64_t block_bytes, const Tile& tile) {
  const int64_t grain = std::max<int64_t>(1, TASK_BYTES / block_bytes);
  parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
#if defined(SPECDECODE_AMX)
    int64_t configured = 0;
    for (int64_t block = begin; block < end; ++block)
      for (int64_t m0 = 0; m0 < M; m0 += AMX_TOKENS) {
        const int64_t T = std::min(AMX_TOKENS, M - m0);
        if (T != configured) configure_tiles(T);
        configured = T;
        tile(block, m0, T);
      }
    _tile_release();
#else
    (void)begin, (void)end, (void)tile;
#endif
  });
}

}  // namespace

template <typename scalar_t>
void int8_matmul(const scalar_t* x, int64_t M, int64_t K, const int8_t* w, int64_t blocks,
                 int64_t Kp, const float* w_scale, const int32_t* w_sum, const float* bias,
                 int64_t N, scalar_t* y) {
  std::vector<uint8_t> codes(M * Kp);  // [M, Kp] u8
  std::vector<float> x_scale(M);       // [M]
  parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(x + m * K, K, Kp, codes.data() + m * Kp, x_scale.data() + m);
  });
  // acc [GROUPS, T, LANES]: the integer sums of tokens m0 .. m0 + T - 1 by rows of `block`
  auto store = [&](int64_t block, int64_t m0, int64_t T, const int32_t* acc) {
    for (int64_t g = 0; g < GROUPS && block * ROWS + g * LANES < N; ++g)
      int8_epilogue<CODE_ZERO>(acc + g * T * LANES, T, block * ROWS + g * LANES, N, w_sum,
                               w_scale, bias, x_scale.data() + m0, y + m0 * N);
  };
  if (M > 1 && use_amx(Kp)) {  // one token: the vector path (see the header)
    for_each_amx_tile(blocks, M, ROWS * Kp, [&](int64_t block, int64_t m0, int64_t T) {
      alignas(64) int32_t acc[GROUPS * AMX_TOKENS * LANES];
      amx_u8s8(codes.data() + m0 * Kp, Kp, w + block * ROWS * Kp, Kp, T, acc);
      store(block, m0, T, acc);
    });
    return;
  }
  for_each_tile<TOKENS>(blocks, M, ROWS * Kp, [&](auto tokens, int64_t block, int64_t m0) {
    constexpr int T = decltype(tokens)::value;
    int32_t acc[GROUPS][T][LANES];
    dot_u8s8<T>(codes.data() + m0 * Kp, Kp, w + block * ROWS * Kp, Kp, acc);
    store(block, m0, T, &acc[0][0][0]);
  });
}

template void int8_matmul(const float*, int64_t, int64_t, const int8_t*, int64_t, int64_t,
                          const float*, const int32_t*, const float*, int64_t, float*);
template void int8_matmul(const BFloat16*, int64_t, int64_t, const int8_t*, int64_t, int64_t,
                          const float*, const int32_t*, const float*, int64_t, BFloat16*);

void bf16_matmul(const BFloat16* x, int64_t M, const BFloat16* w, int64_t blocks, int64_t Kp,
                 const float* bias, int64_t N, BFloat16* y) {
  // acc [GROUPS, T, LANES]: the fp32 sums of tokens m0 .. m0 + T - 1 by rows of `block`
  auto store = [&](int64_t block, int64_t m0, int64_t T, const float* acc) {
    for (int64_t g = 0; g < GROUPS && block * ROWS + g * LANES < N; ++g)
      store_rows(acc + g * T * LANES, T, block * ROWS + g * LANES, N, bias, y + m0 * N, N);
  };
  if (use_amx(Kp * sizeof(BFloat16))) {
    for_each_amx_tile(blocks, M, ROWS * Kp * 2, [&](int64_t block, int64_t m0, int64_t T) {
      alignas(64) float acc[GROUPS * AMX_TOKENS * LANES];
      amx_bf16(x + m0 * Kp, Kp, w + block * ROWS * Kp, Kp, T, acc);
      store(block, m0, T, acc);
    });
  } else {
    for_each_tile<TOKENS>(blocks, M, ROWS * Kp * 2, [&](auto tokens, int64_t block, int64_t m0) {
      constexpr int T = decltype(tokens)::value;
      float acc[GROUPS][T][LANES];
      dot_bf16<T>(x + m0 * Kp, Kp, w + block * ROWS * Kp, Kp, acc);
      store(block, m0, T, &acc[0][0][0]);
    });
  }
}

// Selects (true) or leaves (false) the AMX path; returns whether AMX is now used where it can be
// (false where it is not compiled in or the OS refuses it).
bool set_amx(bool wanted) {
#if defined(SPECDECODE_AMX)
  amx_wanted = wanted;
  return wanted && amx_granted();
#else
  (void)wanted;
  return false;
#endif
}

// What the kernels run on, per format: "amx", "avx512-vnni" / "avx512-bf16", "avx-vnni",
// "avx2", "neon-dotprod" / "neon" or "portable" (AMX only for weights whose input width is a
// multiple of 64 int8 / 32 bf16 values).
std::string isa() {
  std::string int8 = INT8_DOT, bf16 = BF16_DOT;  // the arch folder's
  if (use_amx(AMX_K_BYTES)) int8 = bf16 = "amx";
  std::string why_not;  // AMX compiled in and wanted, but the OS did not grant the tile state
#if defined(SPECDECODE_AMX)
  if (amx_wanted && !amx_granted())
    why_not = " (no AMX: the OS did not grant the tile state, arch_prctl(ARCH_REQ_XCOMP_PERM))";
#endif
  return "int8: " + int8 + ", bf16: " + bf16 + why_not;
}

}  // namespace specdecode
