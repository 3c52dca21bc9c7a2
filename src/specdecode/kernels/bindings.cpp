// Python bindings of specdecode's CPU kernels (tensors.cpp, layer.cpp, and core.h's isa and
// set_amx): one definition of every function and class, compiled once (setup.py) and linked
// into every variant's module (ops.cpp), whose cores they call.

// torch/python.h: pybind11 with torch's tensor casters, without the rest of the C++ API that
// torch/extension.h adds (a quarter of this file's compile time)
#include <torch/python.h>

#include "core.h"
#include "ops.h"

#include <string>
#include <tuple>
#include <vector>

void define_kernels(pybind11::module_& m) {
  m.def("int8_linear", &int8_linear, "y = int8(x) @ w^T * scales + bias, per-token int8 x");
  m.def("bf16_linear", &bf16_linear, "y = x @ w^T + bias in bf16 with fp32 sums");
  m.def("gguf_quantize", &gguf_quantize, "int8 activations per block of 32 or 256 for the GGUF matmul");
  m.def("gguf_pack_codes", &gguf_pack_codes, "GGUF codes laid out in the kernel's tiles");
  m.def("decode_attention", &decode_attention, "per-query causal or tree attention over the cache");
  m.def("argmax", &argmax, "torch.argmax(x, -1) for fp32 or bf16 x, in one pass");
  m.def("rms_norm", &rms_norm, "weight * x / rms(x), rms in fp32, row by row");
  m.def("rope_", &rope_, "RoPE in place on the first heads of each token of x [B, T, W]");
  m.def("isa", &specdecode::isa, "the instruction sets the matmuls run on");
  m.def("int8_peak", &specdecode::int8_peak, "G int8 multiply-adds a second from registers",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("set_amx", &specdecode::set_amx, "select or leave the AMX matmul path; returns whether it is used");
  // module_local: every variant's module binds these classes; each keeps its own
  pybind11::class_<Projection>(m, "Projection", pybind11::module_local())
      .def_static("int8", &Projection::int8, "an int8_linear projection")
      .def_static("bf16", &Projection::bf16, "a bf16_linear projection")
      .def_static("gguf", &Projection::gguf, "a GGUF projection of row segments")
      .def("__call__", &Projection::operator(), "x [..., K] -> x @ W^T (+ b) [..., N]",
           pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<DecoderLayer>(m, "DecoderLayer", pybind11::module_local())
      .def(pybind11::init<c10::optional<at::Tensor>, at::Tensor, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, double, Projection, Projection, Projection,
                          Projection, int64_t, int64_t, int64_t, bool, double, int64_t,
                          double>(),
           pybind11::arg("input_norm"), pybind11::arg("mlp_in_norm"),
           pybind11::arg("attn_out_norm"), pybind11::arg("mlp_out_norm"),
           pybind11::arg("q_norm"), pybind11::arg("k_norm"), pybind11::arg("eps"),
           pybind11::arg("qkv"), pybind11::arg("o"), pybind11::arg("gate_up"),
           pybind11::arg("down"), pybind11::arg("heads"), pybind11::arg("kv_heads"),
           pybind11::arg("head_dim"), pybind11::arg("gelu"), pybind11::arg("q_scale"),
           pybind11::arg("window"), pybind11::arg("softcap"))
      .def("__call__", &DecoderLayer::operator(), "one decoder block over the cache",
           pybind11::call_guard<pybind11::gil_scoped_release>())  // other threads run meanwhile
      .def("normed", &DecoderLayer::normed, "the block from q|k|v's normed input and a residual",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
