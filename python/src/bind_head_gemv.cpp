// head_gemv, its fused KV-cache write and its sums (head_gemv.h).
#include "bind_common.h"
#include "dsa_decode/head_gemv.h"

namespace dsa_python {

void bind_head_gemv(nb::module_& m) {
  m.attr("HEAD_GEMV_SUMS") = choice_names(dsa::kHeadGemvSumsChoices);
  m.def(
      "head_gemv",
      [](const Array& x, const Array& weight, const Array& out, const OptArray& scale, const OptArray& cache_kv,
         const OptArray& cache, const OptArray& slot_mapping, const OptArray& k_scale,
         const OptArray& cache_error_count, const std::string& sums, bool release_dependents_early, uintptr_t stream) {
        dsa::HeadGemvArgs args;
        args.sums = parse_choice(dsa::kHeadGemvSumsChoices, sums, "sums");
        args.x = to_view(x, "x");
        args.weight = to_view(weight, "weight");
        const nb::dlpack::dtype bfloat16{uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
        if (scale && out.dtype() == bfloat16) {
          throw_invalid("scale", "None for a bfloat16 out (a scale quantizes an FP8 out)", describe_array(*scale));
        }
        args.out = to_view(out, "out", /*fp8=*/scale.has_value());  // the FP8 out takes the quant's scale
        args.scale = to_view(scale, "scale");
        args.release_dependents_early = release_dependents_early;
        dsa::KvCacheWrite write;
        if (cache) {
          write.kv = to_view(cache_kv, "cache.kv");
          write.cache = to_view(cache, "cache.cache", true);
          write.slot_mapping = to_view(slot_mapping, "cache.slot_mapping");
          write.k_scale = to_view(k_scale, "cache.k_scale");
          write.error_count = to_counter(cache_error_count, "cache.error_count");
          args.cache = &write;
        }
        launch_released([&] { return dsa::head_gemv(args, to_stream(stream)); });
      },
      "x"_a, "weight"_a, "out"_a, "scale"_a.none(), "cache_kv"_a.none(), "cache"_a.none(), "slot_mapping"_a.none(),
      "k_scale"_a.none(), "cache_error_count"_a.none(), "sums"_a, "release_dependents_early"_a, "stream"_a);
}

}  // namespace dsa_python
