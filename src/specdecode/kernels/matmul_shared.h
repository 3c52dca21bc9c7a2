// What every instruction set's int8 and bf16 matmul micro-kernels share (arch/<folder>/
// matmul_dot.h; the packed layout is matmul.cpp's header).
//
// Each arch folder's matmul_dot.h defines, for its instruction sets:
//   CODE_ZERO: what dot_u8s8 adds to each sum per unit of the row's weight sum: the activation
//   codes carry +128; a path that sums them as they are has 128, one that sums the signed
//   values (codes - 128) has 0;
//   INT8_DOT, BF16_DOT: what isa() names its int8 and bf16 paths;
//   dot_u8s8<T>(a, lda, b, Kp, acc): acc[g][t] lane l = sum_k (a[t][k] - 128 + CODE_ZERO) *
//   b[row g * 16 + l][k], for a u8 codes [T, lda] (lda % 4 == 0) and one packed int8 block b;
//   dot_bf16<T>(a, lda, b, Kp, acc): acc[g][t] lane l = sum_k a[t][k] * b[row g * 16 + l][k] in
//   fp32, pairs of k in order, the odd value's product first, each product rounded before its
//   addition, for a bf16 [T, lda] (lda even): every folder's bf16 sums give the same bits but
//   AVX-512 BF16's (vdpbf16ps rounds as it sums).
#pragma once

#include "core.h"
#include "tiles.h"
