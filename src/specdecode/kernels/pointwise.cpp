// Small per-row ops in one call each, where torch needs several: RMSNorm and RoPE. Row by row,
// so a row's result never depends on the other rows; rounded as the torch code they replace.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "dispatch.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* w, int64_t D, float eps, scalar_t* y) {
  float squares = 0.f;
  for (int64_t d = 0; d < D; ++d) squares += float(x[d]) * float(x[d]);
  const float inv = 1.f / std::sqrt(squares / float(D) + eps);
  for (int64_t d = 0; d < D; ++d)
    y[d] = scalar_t(float(w[d]) * float(scalar_t(float(x[d]) * inv)));
}

// One token's `heads` heads of D values, rotated in place (rotate-half convention):
// y = r(r(x * r(c)) + r(rot(x) * r(s))), r = rounding to scalar_t, rot(x) = [-x2, x1].
template <typename scalar_t>
void rope_row(scalar_t* x, const float* cos, const float* sin, int64_t heads, int64_t D,
              std::vector<float>& old) {
  const int64_t half = D / 2;
  old.resize(D);
  for (int64_t h = 0; h < heads; ++h, x += D) {
    for (int64_t d = 0; d < D; ++d) old[d] = float(x[d]);
    for (int64_t d = 0; d < D; ++d) {
      const float rotated = d < half ? -old[d + half] : old[d - half];
      const float a = float(scalar_t(old[d] * float(scalar_t(cos[d]))));
      const float b = float(scalar_t(rotated * float(scalar_t(sin[d]))));
      x[d] = scalar_t(a + b);
    }
  }
}

}  // namespace

// RoPE in place on the first `heads` heads of every token: x [B, T, W] contiguous, W >= heads * D
// (a fused q/k/v projection's output: q and k heads first); cos, sin fp32 [B, T, D].
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.is_contiguous(),
              "x must be a contiguous 3-D CPU tensor");
  const int64_t tokens = x.size(0) * x.size(1), D = cos.size(-1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * D &&
                  sin.numel() == tokens * D && D % 2 == 0 && heads * D <= x.size(2),
              "cos and sin must be contiguous fp32 [B, T, D] (D even) for x ", x.sizes(),
              " and ", heads, " heads");
  const int64_t W = x.size(2);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto run = [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> old;  // one head's values before rotation
      for (int64_t i = begin; i < end; ++i)
        rope_row(xp + i * W, cp + i * D, sp + i * D, heads, D, old);
    });
  };
  fp32_or_bf16(x.scalar_type(), "rope_", run);
}

// x [..., D] and weight [D] of one dtype (fp32 or bf16) -> [..., D].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu(), "specdecode kernels run on the CPU");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D && weight.scalar_type() == x.scalar_type(),
              "weight must be [", D, "] in x's dtype, got ", weight.sizes(), " ",
              weight.scalar_type());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = xc.numel() / D;
  auto run = [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(xp + r * D, wp, D, float(eps), yp + r * D);
    });
  };
  fp32_or_bf16(x.scalar_type(), "rms_norm", run);
  return y;
}
