// Python bindings of specdecode's CPU kernels (matmul.cpp, gguf.cpp, attention.cpp, pointwise.cpp).

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& w_sum, const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias, int64_t N);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gguf_quantize(
    const at::Tensor& x, int64_t block);
at::Tensor gguf_pack_codes(const at::Tensor& q, int64_t bits, int64_t sub, int64_t subs);
void gguf_linear(const at::Tensor& x8, const at::Tensor& dx, const at::Tensor& sx,
                 const at::Tensor& bsum16, const at::Tensor& bsum32, const at::Tensor& w,
                 int64_t bits, int64_t sub, int64_t subs, int64_t off, int64_t mins, int64_t N,
                 const c10::optional<at::Tensor>& bias, at::Tensor& y, int64_t offset);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& tree_starts,
                            const c10::optional<at::Tensor>& tree_mask);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);
std::string isa();
bool set_amx(bool wanted);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "y = int8(x) @ w^T * scales + bias, per-token int8 x");
  m.def("bf16_linear", &bf16_linear, "y = x @ w^T + bias in bf16 with fp32 sums");
  m.def("gguf_quantize", &gguf_quantize, "int8 activations per block of 32 or 256 for gguf_linear");
  m.def("gguf_pack_codes", &gguf_pack_codes, "GGUF codes laid out in the kernel's tiles");
  m.def("gguf_linear", &gguf_linear, "y[:, offset:offset+N] = x @ w^T + bias, w in GGUF blocks");
  m.def("decode_attention", &decode_attention, "per-query causal or tree attention over the cache");
  m.def("rms_norm", &rms_norm, "weight * x / rms(x), rms in fp32, row by row");
  m.def("rope_", &rope_, "RoPE in place on the first heads of each token of x [B, T, W]");
  m.def("isa", &isa, "the instruction sets the matmuls run on");
  m.def("set_amx", &set_amx, "select or leave the AMX matmul path; returns whether it is used");
}
