// What the torch bindings share (tensors.cpp, layer.cpp): the one dtype switch (the kernels
// take fp32 or bf16), a tensor's data as the cores' element type, and a matmul's output shape.
#pragma once

#include <ATen/ATen.h>

#include "core.h"

#include <type_traits>
#include <vector>

static_assert(sizeof(specdecode::BFloat16) == sizeof(at::BFloat16), "the same 16 bits");

// Calls run(float()) or run(specdecode::BFloat16()) by `type`; any other dtype is an error
// naming `op`.
template <class Run>
void fp32_or_bf16(at::ScalarType type, const char* op, const Run& run) {
  if (type == at::kBFloat16) {
    run(specdecode::BFloat16());
  } else {
    TORCH_CHECK(type == at::kFloat, op, " takes fp32 or bf16, got ", type);
    run(float());
  }
}

// t's data as T* (specdecode::BFloat16 for a bf16 tensor: the same bits as at::BFloat16).
template <typename T>
T* data(const at::Tensor& t) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, specdecode::BFloat16>)
    return reinterpret_cast<T*>(t.data_ptr<at::BFloat16>());
  else
    return t.data_ptr<std::remove_const_t<T>>();
}

// x's shape [..., K] with the last dimension N: the shape of y = x @ W^T.
inline std::vector<int64_t> out_shape(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return shape;
}
