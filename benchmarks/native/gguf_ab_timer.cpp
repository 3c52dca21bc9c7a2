// One build of the GGUF kernel's timing function (benchmarks/gguf_ab.py compiles it, with the
// kernel, once per checkout, renaming namespace specdecode and TIMER per build by -D).
#include "core.h"
#include <chrono>
#include <vector>
#include <random>
#include <algorithm>
namespace specdecode {
void parallel_for(int64_t b, int64_t e, int64_t,
                  const std::function<void(int64_t, int64_t)>& f) {
  f(b, e);
}
int64_t max_threads() { return 1; }
}
using namespace specdecode;
// Seconds per gguf_matmul call of layout li (Q4_K, Q6_K, Q4_0, Q8_0) on an [N, K] weight of
// random codes at T tokens, one thread: the best of `reps` timings of 10 calls.
double TIMER(int li, int T, int reps, int64_t N, int64_t K) {
  static const GgufLayout layouts[] = {
      {4, 32, 8, 0, 1}, {6, 16, 16, 32, 0}, {4, 32, 1, 8, 0}, {8, 32, 1, 128, 0}};
  const GgufLayout L = layouts[li];
  const int64_t B = L.superblock_values(), nsb = K / B, tiles = N / 16;
  const int64_t bytes = tiles * nsb * L.superblock_bytes();
  static std::vector<uint8_t> w[4];  // per layout, made again for a weight of another size
  std::mt19937 rng(li);
  if (int64_t(w[li].size()) != bytes) {  // small codes and scales: no fp16 NaN or infinity
    w[li].resize(bytes);
    for (auto& b : w[li]) b = rng() & 0x3F;
  }
  std::vector<float> x(T * K);
  for (auto& v : x) v = float(int(rng() % 200) - 100) / 37.f;
  std::vector<int8_t> x8(T * K); std::vector<float> dx(T * K / 32), sx(T * K / 32);
  std::vector<int16_t> b16(T * K / 16), b32(T * K / 32);
  gguf_quantize(x.data(), T, K, B, x8.data(), dx.data(), sx.data(), b16.data(), b32.data());
  GgufActs a{x8.data(), dx.data(), sx.data(), b16.data(), b32.data(), K};
  std::vector<float> y(T * N);
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < 10; ++c) gguf_matmul(a, T, w[li].data(), tiles, L, nullptr, N, y.data(), N);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - t0;
    best = std::min(best, took.count() / 10);
  }
  return best;
}
