// qkv_rmsnorm (norm.h).
#include "bind_common.h"
#include "dsa_decode/norm.h"

namespace dsa_python {

namespace {

// The norm's C++ check takes q_size and kv_size from the weights and blames
// qkv when they do not add up to its width. Where both outputs agree with
// qkv, the weight that disagrees with its output is the wrong one.
void blame_a_weight_that_disagrees(const Array& qkv, const Array& q_weight, const Array& kv_weight, const Array& q_out,
                                   const Array& kv_out) {
  if (qkv.ndim() != 2 || q_weight.ndim() != 1 || kv_weight.ndim() != 1 || q_out.ndim() != 2 || kv_out.ndim() != 2) {
    return;  // ranks: the C++ check names each
  }
  const int64_t width = int64_t(qkv.shape(1)), q_size = int64_t(q_out.shape(1)), kv_size = int64_t(kv_out.shape(1));
  if (q_size + kv_size != width) return;
  const auto blame = [&](const char* name, const Array& weight, int64_t size, const char* out_name) {
    if (int64_t(weight.shape(0)) == size) return;
    throw_invalid(name,
                  "[" + std::to_string(size) + "] (" + out_name + "'s columns, and qkv's " + std::to_string(width) +
                      " = " + std::to_string(q_size) + " + " + std::to_string(kv_size) + ")",
                  describe_array(weight));
  };
  blame("q_weight", q_weight, q_size, "q_out");
  blame("kv_weight", kv_weight, kv_size, "kv_out");
}

}  // namespace

void bind_norm(nb::module_& m) {
  m.def(
      "qkv_rmsnorm",
      [](const Array& qkv, const Array& q_weight, const Array& kv_weight, double eps, const Array& q_out,
         const Array& kv_out, uintptr_t stream) {
        const float eps_value = positive_eps(eps, "eps");
        blame_a_weight_that_disagrees(qkv, q_weight, kv_weight, q_out, kv_out);
        const dsa::TensorView qkv_view = to_view(qkv, "qkv"), q_weight_view = to_view(q_weight, "q_weight"),
                              kv_weight_view = to_view(kv_weight, "kv_weight"), q_out_view = to_view(q_out, "q_out"),
                              kv_out_view = to_view(kv_out, "kv_out");
        launch_released([&] {
          return dsa::qkv_rmsnorm(qkv_view, q_weight_view, kv_weight_view, eps_value, q_out_view, kv_out_view,
                                  to_stream(stream));
        });
      },
      "qkv"_a, "q_weight"_a, "kv_weight"_a, "eps"_a, "q_out"_a, "kv_out"_a, "stream"_a);
}

}  // namespace dsa_python
