// The vector instructions a build of the cores has, and their intrinsics' headers: x86's
// (__AVX2__, __AVX512F__, ... as the compiler defines them) and ARM64's with the dot-product
// instructions (SPECDECODE_NEON: the neon variant).
#pragma once

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
