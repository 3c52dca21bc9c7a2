// The one dtype switch of specdecode's kernels: they take fp32 or bf16.
#pragma once

#include <ATen/ATen.h>

// Calls run(float()) or run(at::BFloat16()) by `type`; any other dtype is an error naming `op`.
template <class Run>
void fp32_or_bf16(at::ScalarType type, const char* op, const Run& run) {
  if (type == at::kBFloat16) {
    run(at::BFloat16());
  } else {
    TORCH_CHECK(type == at::kFloat, op, " takes fp32 or bf16, got ", type);
    run(float());
  }
}
