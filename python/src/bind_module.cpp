// dsa_decode._C: the thin nanobind layer between Python and the library's
// C++ API, one file per kernel family (bind_<family>.cpp; bind_common.h has
// the rules they share).
#include "bind_common.h"

using namespace nanobind::literals;

NB_MODULE(_C, m) {
  m.doc() = "dsa-decode's C++ API for Python (use the dsa_decode package, not this module)";
  dsa_python::register_exceptions(m);
  m.def(
      "describe", [](const dsa_python::Array& a, bool fp8) { return dsa_python::to_view(a, "array", fp8).describe(); },
      "array"_a, "fp8"_a = false, "The TensorView the library would see for this array (for tests and debugging).");
  dsa_python::bind_norm(m);
  dsa_python::bind_linear(m);
  dsa_python::bind_head_gemv(m);
  dsa_python::bind_sparse_mla(m);
  dsa_python::bind_sparse_mla_v32(m);
  dsa_python::bind_rope(m);
  dsa_python::bind_indexer(m);
  dsa_python::bind_stage(m);
  dsa_python::bind_references(m);
  dsa_python::bind_checkpoint(m);
}
