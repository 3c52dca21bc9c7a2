// The int8 compute peak of this variant (core.h: int8_peak): a micro-benchmark, no data in
// memory. Each thread runs CHAINS independent accumulators through the variant's int8
// multiply-add instruction (its arch folder's peak_chains.h), so the instruction's throughput,
// not its latency, bounds the loop. Only the instruction's own products count; the matmuls
// spend more instructions per product (decoding codes, scales, sums), so their share of this
// peak is what the roofline reports.

#include "core.h"
#include "peak_chains.h"  // this variant's: its arch folder (setup.py)
#include "peak_shared.h"

#include <atomic>
#include <chrono>
#include <cstdint>

namespace specdecode {

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
