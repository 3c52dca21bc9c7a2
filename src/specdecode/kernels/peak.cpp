// The int8 compute peak of this variant (core.h: int8_peak): a micro-benchmark, no data in
// memory. Each thread runs CHAINS independent accumulators through the variant's int8
// multiply-add instruction, so the instruction's throughput, not its latency, bounds the loop
// (12 chains cover a 4-5 cycle latency at two instructions a cycle). Only the instruction's own
// products count; the matmuls spend more instructions per product (decoding codes, scales,
// sums), so their share of this peak is what the roofline reports.

#include "core.h"
#include "isa.h"

#include <atomic>
#include <chrono>
#include <cstdint>

namespace specdecode {
namespace {

constexpr int CHAINS = 12;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t PRODUCTS = 64;  // per vpdpbusd on 512 bits: 16 lanes x 4 bytes

int64_t chains(int64_t iterations, int32_t seed) {
  const __m512i a = _mm512_set1_epi32(seed), b = _mm512_set1_epi32(seed + 1);
  __m512i acc[CHAINS];
  UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_epi32(c);
  for (int64_t i = 0; i < iterations; ++i)
    UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  __m512i total = acc[0];
  UNROLL for (int c = 1; c < CHAINS; ++c) total = _mm512_add_epi32(total, acc[c]);
  return _mm512_reduce_add_epi32(total);
}
#elif defined(__AVXVNNI__)
constexpr int64_t PRODUCTS = 32;  // per vpdpbusd on 256 bits

int64_t chains(int64_t iterations, int32_t seed) {
  const __m256i a = _mm256_set1_epi32(seed), b = _mm256_set1_epi32(seed + 1);
  __m256i acc[CHAINS];
  UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_set1_epi32(c);
  for (int64_t i = 0; i < iterations; ++i)
    UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_dpbusd_avx_epi32(acc[c], a, b);
  __m256i total = acc[0];
  UNROLL for (int c = 1; c < CHAINS; ++c) total = _mm256_add_epi32(total, acc[c]);
  return _mm256_extract_epi32(total, 0) + _mm256_extract_epi32(total, 7);
}
#elif defined(__AVX2__)
constexpr int64_t PRODUCTS = 32;  // per vpmaddubsw: 32 u8 x s8 products, summed in pairs

// Each chain feeds its int16 sums back as the next unsigned bytes (the values do not matter).
int64_t chains(int64_t iterations, int32_t seed) {
  const __m256i b = _mm256_set1_epi32(seed + 1);
  __m256i acc[CHAINS];
  UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_set1_epi32(seed + c);
  for (int64_t i = 0; i < iterations; ++i)
    UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_maddubs_epi16(acc[c], b);
  __m256i total = acc[0];
  UNROLL for (int c = 1; c < CHAINS; ++c) total = _mm256_add_epi16(total, acc[c]);
  return _mm256_extract_epi32(total, 0) + _mm256_extract_epi32(total, 7);
}
#elif defined(SPECDECODE_NEON)
constexpr int64_t PRODUCTS = 16;  // per sdot: 4 lanes x 4 bytes

int64_t chains(int64_t iterations, int32_t seed) {
  const int8x16_t a = vreinterpretq_s8_s32(vdupq_n_s32(seed));
  const int8x16_t b = vreinterpretq_s8_s32(vdupq_n_s32(seed + 1));
  int32x4_t acc[CHAINS];
  UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = vdupq_n_s32(c);
  for (int64_t i = 0; i < iterations; ++i)
    UNROLL for (int c = 0; c < CHAINS; ++c) acc[c] = vdotq_s32(acc[c], a, b);
  int32x4_t total = acc[0];
  UNROLL for (int c = 1; c < CHAINS; ++c) total = vaddq_s32(total, acc[c]);
  return vaddvq_s32(total);
}
#else
constexpr int64_t PRODUCTS = 1;  // one scalar multiply-add

// Each chain multiplies its own low byte, so no product is known before the loop runs.
int64_t chains(int64_t iterations, int32_t seed) {
  int32_t acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = seed + c;
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < CHAINS; ++c) acc[c] += int32_t(int8_t(acc[c])) * int8_t(seed + 1);
  int64_t total = 0;
  for (int c = 0; c < CHAINS; ++c) total += acc[c];
  return total;
}
#endif

}  // namespace

double int8_peak(int64_t iterations) {
  const int64_t threads = max_threads();
  std::atomic<int64_t> sink{0};  // the chains' results go somewhere: the loops stay
  const auto start = std::chrono::steady_clock::now();
  parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) sink += chains(iterations, int32_t(i + 1));
  });
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  const double products = double(threads) * double(iterations) * CHAINS * PRODUCTS;
  return products / took.count() / 1e9;
}

}  // namespace specdecode
