// What the cores' register-blocked loops share (UNROLL, compile-time counts). The instruction
// sets themselves live in the arch folders, each of which includes its own intrinsics header.
#pragma once

#include <cstdint>
#include <type_traits>

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
