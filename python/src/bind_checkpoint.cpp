// dsa_decode._C.checkpoint_layer_weights: the C++ checkpoint loader of
// `dsa-decode --weights PATH --layer N` (tools/checkpoint.h), for the Python
// loader's parity tests (dsa_decode.checkpoint reads the same files with
// NumPy; the two must give the same bits). Rank 0 only, as the C++ loader.

#include <string>
#include <vector>

#include "bind_common.h"
#include "tools/checkpoint.h"
#include "tools/synthetic_layer.h"

using namespace nanobind::literals;

namespace dsa_python {

namespace {

int shape_field(const nb::dict& d, const char* name) {
  if (!d.contains(name)) throw_invalid(std::string("shape.") + name, "an int", "no such key");
  try {
    return nb::cast<int>(d[name]);
  } catch (const nb::cast_error&) {
    throw_invalid(std::string("shape.") + name, "an int", nb::cast<std::string>(nb::repr(d[name])));
  }
}

}  // namespace

void bind_checkpoint(nb::module_& m) {
  m.def(
      "checkpoint_layer_weights",
      [](const std::vector<std::string>& paths, int layer, const nb::dict& d) {
        using dsa::cli::StepShape;
        StepShape s{};
        s.preset = "checkpoint";
        s.tp = shape_field(d, "tp");
        s.D = shape_field(d, "hidden_size");
        s.H = shape_field(d, "num_heads");
        s.Q = shape_field(d, "q_lora_rank");
        s.L = shape_field(d, "kv_lora_rank");
        s.P = shape_field(d, "qk_nope_head_dim");
        s.V = shape_field(d, "v_head_dim");
        s.per_rank.qk_rope = shape_field(d, "qk_rope_head_dim");
        s.index_heads = shape_field(d, "indexer_heads");
        s.index_pool = shape_field(d, "indexer_pool");
        s.index_topk = shape_field(d, "indexer_topk");
        s.m = 1;
        dsa::cli::HostWeights w;
        dsa::cli::CheckpointLoad load;
        dsa::Status status;
        {
          nb::gil_scoped_release release;
          status = dsa::cli::load_layer_weights(paths, layer, s, &w, &load);
        }
        throw_if_error(status);
        const size_t D = size_t(s.D), H = size_t(s.H), Q = size_t(s.Q), L = size_t(s.L), P = size_t(s.P),
                     V = size_t(s.V), HI = size_t(s.index_heads), S = size_t(s.index_pool), I = 128;
        nb::dict out;
        out["fused_qkv_a_proj"] = numpy_from(std::move(w.fused_qkv_a_proj), {Q + L, D});
        out["q_a_norm"] = numpy_from(std::move(w.q_norm_gamma), {Q});
        out["kv_a_norm"] = numpy_from(std::move(w.kv_norm_gamma), {L});
        out["q_b_proj"] = numpy_from(std::move(w.q_b_proj), {H * P, Q});
        out["w_uk_t"] = numpy_from(std::move(w.w_uk_t), {H, P, L});
        out["w_uv"] = numpy_from(std::move(w.w_uv), {H, L, V});
        out["o_proj"] = numpy_from(std::move(w.o_proj), {D, H * V});
        out["q_scale"] = numpy_from(std::vector<float>{w.q_scale}, {1});
        out["k_scale"] = numpy_from(std::vector<float>{w.k_scale}, {1});
        out["index_wq_b"] = numpy_from(std::move(w.index_wq_b), {HI * I, Q});
        out["index_wk"] = numpy_from(std::move(w.index_wk), {I, D});
        out["index_weights_proj"] = numpy_from(std::move(w.index_weights_proj), {HI, D});
        out["index_compress_gate"] = numpy_from(std::move(w.index_compress_gate), {I, D});
        out["index_k_norm_weight"] = numpy_from(std::move(w.index_k_norm_weight), {I});
        out["index_k_norm_bias"] = numpy_from(std::move(w.index_k_norm_bias), {I});
        out["index_ape"] = numpy_from(std::move(w.index_ape), {S, I});
        out["eps"] = w.eps;
        out["eps_source"] = load.eps_source;
        out["files"] = load.files;
        out["tensors"] = load.tensors;
        out["fp8_tensors"] = load.fp8_tensors;
        out["bytes"] = load.bytes;
        return out;
      },
      "paths"_a, "layer"_a, "shape"_a,
      "The C++ loader of dsa-decode --weights (tools/checkpoint.h), rank 0 of shape['tp']: the stage's weights by\n"
      "WEIGHT_NAMES as NumPy arrays (BF16 as uint16 bits), plus eps, eps_source, files, tensors, fp8_tensors and\n"
      "bytes. shape: the per-rank hidden_size, num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,\n"
      "qk_rope_head_dim, v_head_dim, and tp, indexer_heads, indexer_pool, indexer_topk. For parity tests of\n"
      "dsa_decode.load_layer_weights; raises InvalidArgument with the C++ loader's message.");
}

}  // namespace dsa_python
