// dsa_decode.reference: the library's CPU references, NumPy in and out (BF16
// as its bits in uint16, FP8 e4m3 as its codes in uint8).

#include <string>
#include <vector>

#include "bind_common.h"
#include "dsa_decode/head_gemv.h"
#include "head_gemv/head_gemv_reference.h"
#include "linear/linear_reference.h"
#include "norm/norm_reference.h"

namespace dsa_python {

namespace {

constexpr const char* kBf16Bits = "uint16 (BF16 bits)";

std::string sizes(std::initializer_list<std::string> dims) {
  std::string s = "[";
  for (const std::string& d : dims) s += (s.size() == 1 ? "" : ", ") + d;
  return s + "]";
}

// `a` has `rank` dimensions, else InvalidArgument naming `name` and `layout`.
void check_rank(const Array& a, const char* name, size_t rank, const std::string& layout) {
  if (a.ndim() != rank) throw_invalid(name, layout, describe_array(a));
}

// `a`'s dimension `dim` is `size` (the `symbol` of `layout`, from `source`), else InvalidArgument.
void check_size(const Array& a, const char* name, size_t dim, int64_t size, const std::string& layout,
                const char* symbol, const char* source) {
  if (int64_t(a.shape(dim)) != size) {
    throw_invalid(name, layout + " with " + symbol + " = " + std::to_string(size) + " (" + source + ")",
                  describe_array(a));
  }
}

}  // namespace

void bind_references(nb::module_& parent) {
  nb::module_ ref = parent.def_submodule("reference", "The library's CPU references, for bitwise comparisons");
  ref.def(
      "linear_gemv",
      [](const Array& x, const Array& weight) {
        check_rank(x, "x", 2, "[m, k] BF16 bits");
        check_rank(weight, "weight", 2, "[n, k] BF16 bits");
        const int64_t m = int64_t(x.shape(0)), k = int64_t(x.shape(1)), n = int64_t(weight.shape(0));
        check_size(weight, "weight", 1, k, "[n, k]", "k", "x's columns");
        if (k % 8 != 0) throw_invalid("x", "[m, k] with k a multiple of 8", describe_array(x));
        const uint16_t* xp = host_data<uint16_t>(x, "x", kBf16Bits);
        const uint16_t* wp = host_data<uint16_t>(weight, "weight", kBf16Bits);
        std::vector<uint16_t> out = dsa::reference::linear_gemv(std::vector<uint16_t>(xp, xp + m * k), m, k,
                                                                std::vector<uint16_t>(wp, wp + n * k), n);
        return numpy_from(std::move(out), {size_t(m), size_t(n)});
      },
      "x"_a, "weight"_a, "linear_gemv's fixed order: [m, k] x [n, k]^T BF16 bits (uint16) -> [m, n] BF16 bits");

  ref.def(
      "qkv_rmsnorm",
      [](const Array& qkv, const Array& q_weight, const Array& kv_weight, double eps) {
        const float eps_value = positive_eps(eps, "eps");
        check_rank(qkv, "qkv", 2, "[m, q_size + kv_size] BF16 bits");
        check_rank(q_weight, "q_weight", 1, "[q_size] BF16 bits");
        check_rank(kv_weight, "kv_weight", 1, "[kv_size] BF16 bits");
        const int64_t m = int64_t(qkv.shape(0)), width = int64_t(qkv.shape(1));
        const int64_t q_size = int64_t(q_weight.shape(0)), kv_size = int64_t(kv_weight.shape(0));
        if (q_size + kv_size != width) {
          // qkv's row is the data; which of the two weights splits it wrongly
          // its width alone cannot tell.
          throw_invalid("q_weight, kv_weight",
                        "[q_size] and [kv_size] with q_size + kv_size = " + std::to_string(width) + ", qkv's columns",
                        describe_array(q_weight) + " and " + describe_array(kv_weight) +
                            " (q_size + kv_size = " + std::to_string(q_size + kv_size) + ")");
        }
        const uint16_t* xp = host_data<uint16_t>(qkv, "qkv", kBf16Bits);
        const uint16_t* qw = host_data<uint16_t>(q_weight, "q_weight", kBf16Bits);
        const uint16_t* kw = host_data<uint16_t>(kv_weight, "kv_weight", kBf16Bits);
        std::vector<uint16_t> q_out(size_t(m * q_size)), kv_out(size_t(m * kv_size));
        dsa::reference::qkv_rmsnorm(xp, width, qw, kw, int(m), int(q_size), int(kv_size), eps_value, q_out.data(),
                                    kv_out.data());
        return nb::make_tuple(numpy_from(std::move(q_out), {size_t(m), size_t(q_size)}),
                              numpy_from(std::move(kv_out), {size_t(m), size_t(kv_size)}));
      },
      "qkv"_a, "q_weight"_a, "kv_weight"_a, "eps"_a,
      "qkv_rmsnorm's order (BF16 bits as uint16): -> (q_out [m, q_size], kv_out [m, kv_size])");

  ref.def(
      "head_gemv",
      [](const Array& x, const Array& weight, std::optional<float> fp8_scale) {
        check_rank(x, "x", 3, "[m, H, I] BF16 bits");
        check_rank(weight, "weight", 3, "[H, I, J] BF16 bits");
        const int m = int(x.shape(0)), heads = int(x.shape(1)), rows = int(x.shape(2)), cols = int(weight.shape(2));
        const std::string layout = sizes({"H", "I", "J"});
        check_size(weight, "weight", 0, heads, layout, "H", "x's heads");
        check_size(weight, "weight", 1, rows, layout, "I", "x's rows");
        dsa::reference::HeadGemvHost a;
        a.x = host_data<uint16_t>(x, "x", kBf16Bits);
        a.x_token_stride = int64_t(heads) * rows;
        a.weight = host_data<uint16_t>(weight, "weight", kBf16Bits);
        a.weight_head_stride = int64_t(rows) * cols;
        a.weight_row_stride = cols;
        a.m = m;
        a.heads = heads;
        a.rows = rows;
        a.cols = cols;
        const dsa::HeadGemvTactic tactic = dsa::head_gemv_tactic(heads, rows, cols, m);
        const std::vector<size_t> shape{size_t(m), size_t(heads), size_t(cols)};
        if (fp8_scale) return nb::cast(numpy_from(dsa::reference::head_gemv_fp8(a, tactic, *fp8_scale), shape));
        return nb::cast(numpy_from(dsa::reference::head_gemv_bf16(a, tactic), shape));
      },
      "x"_a, "weight"_a, "fp8_scale"_a.none() = nb::none(),
      "head_gemv's seed order (sums=\"seed-order\") with the table's tactic: BF16 bits (uint16) in; BF16 bits out, "
      "or e4m3 codes (uint8) when fp8_scale is given");
}

}  // namespace dsa_python
