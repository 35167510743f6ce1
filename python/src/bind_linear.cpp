// linear_gemv (linear.h).
#include "bind_common.h"
#include "dsa_decode/linear.h"

namespace dsa_python {

void bind_linear(nb::module_& m) {
  m.def(
      "linear_gemv",
      [](const Array& x, const Array& weight, const Array& out, uintptr_t stream) {
        const dsa::LinearGemvArgs args{to_view(x, "x"), to_view(weight, "weight"), to_view(out, "out")};
        launch_released([&] { return dsa::linear_gemv(args, to_stream(stream)); });
      },
      "x"_a, "weight"_a, "out"_a, "stream"_a);
  m.def("linear_gemv_supports", &dsa::linear_gemv_supports, "m"_a, "k"_a);
}

}  // namespace dsa_python
