// The grouped heads' routine of the 256-bit (AVX2) and 128-bit (NEON) folders (attend_heads
// and heads_at_once, for attention_group_tasks.h): their attention_paths.h defines the vector
// type and its operations (Vec, W, SCORE_SUMS, VALUE_SUMS, vzero, vset, vload, vfma, vsum,
// vstore) and then includes this.
//
// For D a multiple of their W lanes: the query
// heads that share a KV head (up to MAX_HEADS at a time) attend together, with attend_one's
// arithmetic for each (the same products summed in the same order, so the same bits). Each
// key or value vector is loaded (and widened) once for all of them, NK slots are scored side
// by side (independent chains over one load of each query), and the weighted sums keep C
// vectors of each head's output in registers over all the slots, a chunk of D at a time.
// (attend_one's dot() is one chain of dependent multiply-adds per slot, and its axpy() takes
// the output through memory per slot.)
#pragma once

#include "attention_rows.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace specdecode {
namespace {

constexpr int MAX_HEADS = 4;  // query heads attending together, at most

// scores [NH, span] = qf [NH, D] . k[slot] for every slot (dot()'s sums per head).
template <int NH, typename scalar_t, typename Slots>
void score_heads(const float* qf, const scalar_t* k, const Slots& slots, int64_t D,
                 float* scores) {
  constexpr int NK = SCORE_SUMS / NH;  // slots side by side
  const int64_t span = slots.size();
  int64_t s = 0;
  for (; s + NK <= span; s += NK) {
    const scalar_t* key[NK];
    Vec acc[NH][NK];
    UNROLL for (int j = 0; j < NK; ++j) {
      key[j] = k + slots[s + j];
      UNROLL for (int i = 0; i < NH; ++i) acc[i][j] = vzero();
    }
    for (int64_t d = 0; d < D; d += W) {
      Vec qv[NH];
      UNROLL for (int i = 0; i < NH; ++i) qv[i] = vload(qf + i * D + d);
      UNROLL for (int j = 0; j < NK; ++j) {
        const Vec kv = vload(key[j] + d);
        UNROLL for (int i = 0; i < NH; ++i) acc[i][j] = vfma(qv[i], kv, acc[i][j]);
      }
    }
    UNROLL for (int i = 0; i < NH; ++i)
      UNROLL for (int j = 0; j < NK; ++j) scores[i * span + s + j] = vsum(acc[i][j]);
  }
  for (; s < span; ++s)
    for (int i = 0; i < NH; ++i) scores[i * span + s] = dot(qf + i * D, k + slots[s], D);
}

// out [NH, D] columns d0 .. d0 + C * W - 1 = the sum over the slots, in order, of
// p[i][s] * v[slot s] (axpy()'s sums per head).
template <int NH, int C, typename scalar_t, typename Slots>
void weigh_chunk(const float* p, const scalar_t* v, const Slots& slots, int64_t D, int64_t d0,
                 float* out) {
  const int64_t span = slots.size();
  Vec acc[NH][C];
  UNROLL for (int i = 0; i < NH; ++i) UNROLL for (int c = 0; c < C; ++c) acc[i][c] = vzero();
  for (int64_t s = 0; s < span; ++s) {
    Vec weight[NH];
    UNROLL for (int i = 0; i < NH; ++i) weight[i] = vset(p[i * span + s]);
    const scalar_t* value = v + slots[s] + d0;
    UNROLL for (int c = 0; c < C; ++c) {
      const Vec x = vload(value + c * W);
      UNROLL for (int i = 0; i < NH; ++i) acc[i][c] = vfma(weight[i], x, acc[i][c]);
    }
  }
  UNROLL for (int i = 0; i < NH; ++i)
    UNROLL for (int c = 0; c < C; ++c) vstore(out + i * D + d0 + c * W, acc[i][c]);
}

// out [NH, D] = the weighted sums of every head, C vectors of D at a time.
template <int NH, typename scalar_t, typename Slots>
void weigh_heads(const float* p, const scalar_t* v, const Slots& slots, int64_t D, float* out) {
  constexpr int C = VALUE_SUMS / NH;
  int64_t d0 = 0;
  for (; d0 + C * W <= D; d0 += C * W) weigh_chunk<NH, C>(p, v, slots, D, d0, out);
  if (d0 < D)  // the last, shorter chunk
    with_count<C>((D - d0) / W, [&](auto rest) {
      weigh_chunk<NH, decltype(rest)::value>(p, v, slots, D, d0, out);
    });
}

// attend_one for nh (<= MAX_HEADS) query heads q[i] that share the KV head at k, v.
template <typename scalar_t, typename Slots>
void attend_heads(int64_t nh, const scalar_t* const* q, const scalar_t* k, const scalar_t* v,
                  const Slots& slots, int64_t D, float scale, float cap, scalar_t* const* out,
                  std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t span = slots.size();
  qf.resize(nh * D);
  for (int64_t i = 0; i < nh; ++i)
    for (int64_t d = 0; d < D; ++d) qf[i * D + d] = widen(q[i][d]) * scale;
  scores.resize(nh * span);
  acc.resize(nh * D);
  with_count<MAX_HEADS>(nh, [&](auto heads) {
    constexpr int NH = decltype(heads)::value;
    score_heads<NH>(qf.data(), k, slots, D, scores.data());
    float total[NH];
    for (int i = 0; i < NH; ++i) total[i] = exp_shifted(scores.data() + i * span, span, cap);
    weigh_heads<NH>(scores.data(), v, slots, D, acc.data());
    for (int i = 0; i < NH; ++i) {
      const float inv = 1.f / total[i];
      for (int64_t d = 0; d < D; ++d) out[i][d] = scalar_t(acc[i * D + d] * inv);
    }
  });
}

// heads_at_once (attention_group_tasks.h): MAX_HEADS for D a multiple of W, either dtype.
template <typename T>
int64_t heads_at_once(int64_t D) {
  return D % W == 0 ? MAX_HEADS : 0;
}

}  // namespace
}  // namespace specdecode

#include "attention_group_tasks.h"
