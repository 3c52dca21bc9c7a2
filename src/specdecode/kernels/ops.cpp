// A variant's Python module (setup.py builds one per variant, kernels/variants.py): its name,
// the digest of its sources, and the bindings (bindings.cpp, compiled once for all variants)
// of this variant's cores.

#include <pybind11/pybind11.h>

// setup.py names each build (kernels/variants.py) and records the digest of its sources, as
// bare words that SPECDECODE_QUOTE makes strings.
#define SPECDECODE_QUOTE_(x) #x
#define SPECDECODE_QUOTE(x) SPECDECODE_QUOTE_(x)
#ifndef SPECDECODE_VARIANT
#define SPECDECODE_VARIANT unnamed
#endif
#ifndef SPECDECODE_SOURCE_HASH
#define SPECDECODE_SOURCE_HASH none
#endif

void define_kernels(pybind11::module_& m);  // bindings.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  define_kernels(m);
  m.attr("variant") = SPECDECODE_QUOTE(SPECDECODE_VARIANT);
  m.attr("source_hash") = SPECDECODE_QUOTE(SPECDECODE_SOURCE_HASH);
}
