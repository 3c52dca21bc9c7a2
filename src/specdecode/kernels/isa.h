// The vector instructions a build of the cores has, and their intrinsics' headers: x86's
// (__AVX2__, __AVX512F__, ... as the compiler defines them) and ARM64's with the dot-product
// instructions (SPECDECODE_NEON: the neon variant); and what the cores' register-blocked loops
// share (UNROLL, compile-time counts).
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define SPECDECODE_NEON 1
#include <arm_neon.h>
#endif

// Full unrolling of the kernels' small loops over registers (a tile's or a query's sums) lets
// the compiler keep every accumulator in a register.
#define UNROLL _Pragma("GCC unroll 16")

namespace specdecode {
namespace {

template <int V>
using Int = std::integral_constant<int, V>;

// Calls f(Int<n>()) for 1 <= n <= MAX: a run-time count (of tokens, heads, vectors) as a
// compile-time one.
template <int MAX, class F>
void with_count(int64_t n, const F& f) {
  if constexpr (MAX > 1) {
    if (n < MAX) return with_count<MAX - 1>(n, f);
  }
  f(Int<MAX>());
}

}  // namespace
}  // namespace specdecode
