// sparse_mla_v32 and its cache write: sparse MLA decode over DeepSeek-V3.2's
// 656-byte FP8 cache entries (sparse_mla_v32.h). No split buffers: the
// splits combine in distributed shared memory, so the only sizes a caller
// needs are the cache's (the constants below).
#include "bind_common.h"
#include "dsa_decode/sparse_mla_v32.h"

namespace dsa_python {

void bind_sparse_mla_v32(nb::module_& m) {
  nb::dict layout;
  layout["latent"] = dsa::kSparseMlaV32Latent;
  layout["rope"] = dsa::kSparseMlaV32Rope;
  layout["head_dim"] = dsa::kSparseMlaV32HeadDim;
  layout["group_size"] = dsa::kSparseMlaV32GroupSize;
  layout["entry_bytes"] = dsa::kSparseMlaV32EntryBytes;
  layout["scale_offset"] = dsa::kSparseMlaV32ScaleOffset;
  layout["rope_offset"] = dsa::kSparseMlaV32RopeOffset;
  layout["max_heads"] = dsa::kSparseMlaV32MaxHeads;
  layout["max_top_k"] = dsa::kSparseMlaV32MaxTopK;
  layout["max_tokens"] = dsa::kSparseMlaV32MaxTokens;
  m.attr("SPARSE_MLA_V32_LAYOUT") = layout;
  m.def(
      "sparse_mla_v32_cache_write",
      [](const Array& kv_c, const Array& k_pe, const Array& slot_mapping, const Array& kv_cache,
         const OptArray& error_count, uintptr_t stream) {
        dsa::SparseMlaV32CacheWriteArgs args;
        args.kv_c = to_view(kv_c, "kv_c");
        args.k_pe = to_view(k_pe, "k_pe");
        args.slot_mapping = to_view(slot_mapping, "slot_mapping");
        args.kv_cache = to_view(kv_cache, "kv_cache", true);  // bytes: u8 or fp8 views alike
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::sparse_mla_v32_cache_write(args, to_stream(stream)); });
      },
      "kv_c"_a, "k_pe"_a, "slot_mapping"_a, "kv_cache"_a, "error_count"_a.none(), "stream"_a);
  m.def(
      "sparse_mla_v32",
      [](const Array& q, const Array& kv_cache, const Array& indices, double softmax_scale, const Array& latent,
         const Array& lse, const OptArray& error_count, uintptr_t stream) {
        dsa::SparseMlaV32Args args;
        args.q = to_view(q, "q");
        args.kv_cache = to_view(kv_cache, "kv_cache", true);
        args.indices = to_view(indices, "indices");
        args.softmax_scale = float(softmax_scale);
        args.latent = to_view(latent, "latent");
        args.lse = to_view(lse, "lse");
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::sparse_mla_v32(args, to_stream(stream)); });
      },
      "q"_a, "kv_cache"_a, "indices"_a, "softmax_scale"_a, "latent"_a, "lse"_a, "error_count"_a.none(), "stream"_a);
}

}  // namespace dsa_python
