// RMSNorm in one call: y = weight * dtype(x / rms(x)), rms in fp32, row by row (so a row's
// result never depends on the other rows), as the reference implementations round it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* w, int64_t D, float eps, scalar_t* y) {
  float squares = 0.f;
  for (int64_t d = 0; d < D; ++d) squares += float(x[d]) * float(x[d]);
  const float inv = 1.f / std::sqrt(squares / float(D) + eps);
  for (int64_t d = 0; d < D; ++d)
    y[d] = scalar_t(float(w[d]) * float(scalar_t(float(x[d]) * inv)));
}

}  // namespace

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
  if (x.scalar_type() == at::kBFloat16) {
    run(at::BFloat16());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm takes fp32 or bf16, got ",
                x.scalar_type());
    run(float());
  }
  return y;
}
