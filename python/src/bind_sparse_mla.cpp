// sparse_mla, its split buffers and its plans (sparse_mla.h).
#include "bind_common.h"
#include "dsa_decode/sparse_mla.h"

namespace dsa_python {

void bind_sparse_mla(nb::module_& m) {
  m.attr("ATTENTION_PLANS") = choice_names(dsa::kSparseMlaPlanChoices);
  m.def(
      "sparse_mla",
      [](const Array& q, const Array& q_scale, const Array& kv_cache, const Array& k_scale, const Array& indices,
         float softmax_scale, const Array& latent, const Array& lse, const Array& split_counters,
         const OptArray& split_partials, const std::string& plan, const OptArray& error_count, uintptr_t stream) {
        dsa::SparseMlaArgs args;
        args.plan = parse_choice(dsa::kSparseMlaPlanChoices, plan, "plan");
        args.q = to_view(q, "q", true);
        args.q_scale = to_view(q_scale, "q_scale");
        args.kv_cache = to_view(kv_cache, "kv_cache", true);
        args.k_scale = to_view(k_scale, "k_scale");
        args.indices = to_view(indices, "indices");
        args.softmax_scale = softmax_scale;
        args.latent = to_view(latent, "latent");
        args.lse = to_view(lse, "lse");
        args.split_counters = to_view(split_counters, "split_counters");
        args.split_partials = to_view(split_partials, "split_partials");
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::sparse_mla(args, to_stream(stream)); });
      },
      "q"_a, "q_scale"_a, "kv_cache"_a, "k_scale"_a, "indices"_a, "softmax_scale"_a, "latent"_a, "lse"_a,
      "split_counters"_a, "split_partials"_a.none(), "plan"_a, "error_count"_a.none(), "stream"_a);
  m.def("sparse_mla_split_counter_count", &dsa::sparse_mla_split_counter_count, "m"_a, "heads"_a, "top_k"_a);
  m.def("sparse_mla_split_partials_count", &dsa::sparse_mla_split_partials_count, "m"_a, "heads"_a, "top_k"_a);
}

}  // namespace dsa_python
