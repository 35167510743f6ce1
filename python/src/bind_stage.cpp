// The model presets and the DSA attention stage (presets.h, stage.h).

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "bind_common.h"
#include "bind_rope.h"
#include "dsa_decode/linear.h"
#include "dsa_decode/presets.h"
#include "dsa_decode/stage.h"

namespace dsa_python {

namespace {

// A field of a dataclass crossing as a dict, or InvalidArgument naming it.
template <class T>
T field(const nb::dict& d, const char* name) {
  const nb::object value = d[name];
  T result{};
  if (!nb::try_cast<T>(value, result)) {
    throw_invalid(name,
                  std::is_same_v<T, bool>          ? "True or False"
                  : std::is_same_v<T, std::string> ? "a str"
                  : std::is_floating_point_v<T>    ? "a float"
                                                   : "an int",
                  nb::repr(value).c_str());
  }
  return result;
}

// DsaLayerConfig's fields under dsa_decode.LayerConfig's names, one list for
// both directions: f(name, field) for each.
template <class Config, class F>
void for_each_config_field(Config& c, F&& f) {
  f("hidden_size", c.hidden_size);
  f("num_heads", c.num_heads);
  f("q_lora_rank", c.q_lora_rank);
  f("kv_lora_rank", c.kv_lora_rank);
  f("qk_nope_head_dim", c.qk_nope_head_dim);
  f("qk_rope_head_dim", c.qk_rope_head_dim);
  f("v_head_dim", c.v_head_dim);
  f("softmax_scale", c.softmax_scale);
  f("rms_norm_eps", c.rms_norm_eps);
  f("fuse_qkv_rmsnorm", c.fuse_qkv_rmsnorm);
  f("rotary_embedding", c.rotary_embedding);
  f("indexer", c.indexer);
  f("skip_topk", c.skip_topk);
  f("gate_proj", c.gate_proj);
  f("dcp_query_replicate", c.dcp_query_replicate);
  f("kv_cache_dtype", c.kv_cache_dtype);
  f("padded_heads", c.padded_heads);
  f("prefill_context_parallel", c.prefill_context_parallel);
  f("hisparse_cache", c.hisparse_cache);
  f("decode_context_parallel_size", c.decode_context_parallel_size);
}

// The layer's two rotaries (RoPE layers): a RopeConfig's fields (bind_rope.h) or None.
constexpr std::pair<const char*, std::optional<dsa::RopeConfig> dsa::DsaLayerConfig::*> kRotaries[] = {
    {"rope", &dsa::DsaLayerConfig::rope},
    {"indexer_rope", &dsa::DsaLayerConfig::indexer_rope},
};

nb::dict config_dict(const dsa::DsaLayerConfig& c) {
  nb::dict d;
  for_each_config_field(c, [&](const char* name, const auto& field) { d[name] = field; });
  for (const auto& [name, rotary] : kRotaries) {
    const std::optional<dsa::RopeConfig>& r = c.*rotary;
    d[name] = r ? nb::cast(rope_config_fields(*r)) : nb::none();
  }
  return d;
}

dsa::DsaLayerConfig layer_config(const nb::dict& d) {
  dsa::DsaLayerConfig c;
  for_each_config_field(c,
                        [&](const char* name, auto& value) { value = field<std::decay_t<decltype(value)>>(d, name); });
  positive_eps(c.rms_norm_eps, "config.rms_norm_eps");
  for (const auto& [name, rotary] : kRotaries) {
    // Absent or None: the layer has no such rotary (creation names it where a RoPE layer needs it).
    if (!d.contains(name) || d[name].is_none()) continue;
    RopeConfigFields fields;
    if (!nb::try_cast<RopeConfigFields>(d[name], fields)) {
      throw_invalid(name, "None or a dsa_decode.RopeConfig", nb::repr(d[name]).c_str());
    }
    c.*rotary = rope_config_from_fields(fields, std::string("config.") + name);
  }
  return c;
}

// The rotary part of the indexer plan the stage runs for a layer
// (dsa_stage_indexer_plan(config, plan)): rope_dims and the style's name.
nb::tuple indexer_rope_of(const dsa::DsaLayerConfig& config, const dsa::DsaStagePlan& plan) {
  const dsa::IndexerPlan p = dsa::dsa_stage_indexer_plan(config, plan);
  return nb::make_tuple(p.rope_dims, dsa::choice_name(kRopeStyleChoices, p.rope_style));
}

// The weights a stage takes (dsa_decode.WEIGHT_NAMES, in its order).
constexpr std::pair<const char*, dsa::TensorView dsa::DsaLayerWeights::*> kWeights[] = {
    {"fused_qkv_a_proj", &dsa::DsaLayerWeights::fused_qkv_a_proj},
    {"q_a_norm", &dsa::DsaLayerWeights::q_a_norm},
    {"kv_a_norm", &dsa::DsaLayerWeights::kv_a_norm},
    {"q_b_proj", &dsa::DsaLayerWeights::q_b_proj},
    {"w_uk_t", &dsa::DsaLayerWeights::w_uk_t},
    {"w_uv", &dsa::DsaLayerWeights::w_uv},
    {"o_proj", &dsa::DsaLayerWeights::o_proj},
    {"q_scale", &dsa::DsaLayerWeights::q_scale},
    {"k_scale", &dsa::DsaLayerWeights::k_scale},
    {"index_wq_b", &dsa::DsaLayerWeights::index_wq_b},
    {"index_wk", &dsa::DsaLayerWeights::index_wk},
    {"index_weights_proj", &dsa::DsaLayerWeights::index_weights_proj},
    {"index_compress_gate", &dsa::DsaLayerWeights::index_compress_gate},
    {"index_k_norm_weight", &dsa::DsaLayerWeights::index_k_norm_weight},
    {"index_k_norm_bias", &dsa::DsaLayerWeights::index_k_norm_bias},
    {"index_ape", &dsa::DsaLayerWeights::index_ape},
};

// The stage's buffers that intermediates() hands out.
constexpr std::pair<const char*, dsa::TensorView dsa::DsaStageIntermediates::*> kIntermediates[] = {
    {"qkv", &dsa::DsaStageIntermediates::qkv},
    {"q_c", &dsa::DsaStageIntermediates::q_c},
    {"kv_c", &dsa::DsaStageIntermediates::kv_c},
    {"q", &dsa::DsaStageIntermediates::q},
    {"q_fp8", &dsa::DsaStageIntermediates::q_fp8},
    {"q_absorbed", &dsa::DsaStageIntermediates::q_absorbed},
    {"k_pe", &dsa::DsaStageIntermediates::k_pe},
    {"index_q", &dsa::DsaStageIntermediates::index_q},
    {"index_k", &dsa::DsaStageIntermediates::index_k},
    {"head_weights", &dsa::DsaStageIntermediates::head_weights},
    {"gate", &dsa::DsaStageIntermediates::gate},
    {"index_logits", &dsa::DsaStageIntermediates::index_logits},
    {"indexer_workspace", &dsa::DsaStageIntermediates::indexer_workspace},
    {"topk_positions", &dsa::DsaStageIntermediates::topk_positions},
    {"slots", &dsa::DsaStageIntermediates::slots},
    {"latent", &dsa::DsaStageIntermediates::latent},
    {"lse", &dsa::DsaStageIntermediates::lse},
    {"heads", &dsa::DsaStageIntermediates::heads},
};

std::optional<std::set<int>> token_set(const nb::handle& value, const char* name, int most) {
  if (value.is_none()) return std::nullopt;
  std::set<int> tokens;
  if (!nb::hasattr(value, "__iter__")) throw_invalid(name, "None or a set of token counts", nb::repr(value).c_str());
  for (nb::handle item : value) {
    int m = 0;
    if (!nb::try_cast<int>(item, m)) throw_invalid(name, "token counts (ints)", nb::repr(item).c_str());
    if (m < 1 || m > most) throw_invalid(name, "token counts in 1.." + std::to_string(most), std::to_string(m));
    tokens.insert(m);
  }
  return tokens;
}

// dsa_decode.StagePlan as a dict (dataclasses.asdict), checked: the choice
// names, the token counts and the indexer's plan, so that a StagePlan is
// refused at construction rather than at the stage's.
dsa::DsaStagePlan stage_plan(const nb::dict& d) {
  dsa::DsaStagePlan p;
  const auto text = [&](const char* name) { return field<std::string>(d, name); };
  const auto number = [&](const char* name) { return field<int>(d, name); };
  const auto flag = [&](const char* name) { return field<bool>(d, name); };
  p.head_gemv_sums = parse_choice(dsa::kHeadGemvSumsChoices, text("head_gemv_sums"), "head_gemv_sums");
  p.indexer_logits = parse_choice(dsa::kIndexerLogitsChoices, text("indexer_logits"), "indexer_logits");
  p.attention_plan = parse_choice(dsa::kSparseMlaPlanChoices, text("attention_plan"), "attention_plan");
  p.max_tokens = number("max_tokens");
  if (p.max_tokens < 1 || p.max_tokens > dsa::kDsaStageMaxTokens) {
    throw_invalid("max_tokens", "1.." + std::to_string(dsa::kDsaStageMaxTokens) + " tokens a step",
                  std::to_string(p.max_tokens));
  }
  p.max_context = field<int64_t>(d, "max_context");
  p.ring = number("ring");
  p.block_size = number("block_size");
  p.indexer_heads = number("indexer_heads");
  p.indexer_pool = number("indexer_pool");
  p.indexer_topk = number("indexer_topk");
  p.batch_invariant = flag("batch_invariant");
  p.value_up_tokens = token_set(d["value_up_tokens"], "value_up_tokens", dsa::kDsaStageMaxTokens);
  p.projection_gemv_tokens =
      token_set(d["projection_gemv_tokens"], "projection_gemv_tokens", dsa::kLinearGemvMaxTokens);
  p.indexer_projections_cublaslt = flag("indexer_projections_cublaslt");
  p.overlap_indexer = flag("overlap_indexer");
  throw_if_error(dsa::check_dsa_stage_indexer_shape(p));
  throw_if_error(dsa::check_indexer_plan(dsa::dsa_stage_indexer_plan(p)));
  return p;
}

// Python's handle of a DsaAttentionStage. It keeps the weight arrays it was
// made from (a DLPack capsule has no other owner once imported), and runs
// one call at a time: launches release the GIL, and two threads must not
// share the stage's workspace, events and cuBLAS handle at once.
struct Stage {
  std::unique_ptr<dsa::DsaAttentionStage> stage;
  std::vector<Array> weights;
  std::mutex calls;
};

dsa::DsaStepArgs step_args(const Array& hidden, const Array& positions, const Array& token_requests,
                           const Array& slot_mapping, const Array& kv_cache, const Array& block_table,
                           const OptArray& ring, const Array& index_k_cache, const Array& out,
                           const OptArray& topk_positions, const OptArray& error_count) {
  dsa::DsaStepArgs args;
  args.hidden = to_view(hidden, "hidden");
  args.positions = to_view(positions, "positions");
  args.token_requests = to_view(token_requests, "token_requests");
  args.slot_mapping = to_view(slot_mapping, "slot_mapping");
  args.kv_cache = to_view(kv_cache, "kv_cache", true);
  args.indexer = dsa::IndexerState{to_view(block_table, "indexer.block_table"), to_view(ring, "indexer.ring"),
                                   to_view(index_k_cache, "indexer.k_cache")};
  args.topk_positions = to_view(topk_positions, "topk_positions");
  args.out = to_view(out, "out");
  args.error_count = to_counter(error_count, "error_count");
  return args;
}

// A view of a stage buffer as a DLPack array owned by the stage's Python object.
nb::object stage_array(const dsa::TensorView& v, nb::handle owner) {
  if (v.data == nullptr) return nb::none();
  nb::dlpack::dtype t;
  switch (v.dtype) {
    case dsa::DType::kBF16:
      t = {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
      break;
    case dsa::DType::kF16:
      t = {uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
      break;
    case dsa::DType::kF32:
      t = nb::dtype<float>();
      break;
    case dsa::DType::kI32:
      t = nb::dtype<int32_t>();
      break;
    case dsa::DType::kI64:
      t = nb::dtype<int64_t>();
      break;
    case dsa::DType::kFP8E4M3:  // handed out as its uint8 view
    case dsa::DType::kU8:
      t = nb::dtype<uint8_t>();
      break;
  }
  std::vector<size_t> shape(v.shape, v.shape + v.ndim);
  std::vector<int64_t> strides(v.strides, v.strides + v.ndim);
  nb::ndarray<> array(v.data, size_t(v.ndim), shape.data(), owner, strides.data(), t, nb::device::cuda::value,
                      v.device.index);
  return nb::cast(array, nb::rv_policy::reference);
}

// The step's tensors, in StepArgs._args()'s order, then error_count.
#define DSA_STEP_ARGUMENTS                                                                                  \
  "hidden"_a, "positions"_a, "token_requests"_a, "slot_mapping"_a, "kv_cache"_a, "block_table"_a, "ring"_a.none(), \
      "index_k_cache"_a, "out"_a, "topk_positions"_a.none()

}  // namespace

void bind_stage(nb::module_& m) {
  m.def(
      "layer_config",
      [](const std::string& preset, int tp, double rms_norm_eps) {
        const float eps = positive_eps(rms_norm_eps, "rms_norm_eps");
        dsa::ModelPreset whole, rank;
        throw_if_error(dsa::find_preset(preset, &whole));
        throw_if_error(dsa::per_rank(whole, tp, &rank));
        return config_dict(dsa::dsa_layer_config(rank, eps));
      },
      "preset"_a, "tp"_a, "rms_norm_eps"_a);
  m.def(
      "preset_indexer_shape",
      [](const std::string& preset) {
        dsa::ModelPreset whole;
        throw_if_error(dsa::find_preset(preset, &whole));
        const dsa::DsaStagePlan plan = dsa::dsa_stage_plan_for(whole);
        nb::dict d;
        d["indexer_heads"] = plan.indexer_heads;
        d["indexer_pool"] = plan.indexer_pool;
        d["indexer_topk"] = plan.indexer_topk;
        d["ring"] = plan.ring;
        return d;
      },
      "preset"_a, "dsa_stage_plan_for's indexer fields of a preset (its shape, RING = the pool).");
  m.def(
      "check_eps", [](double eps, const std::string& name) { positive_eps(eps, name.c_str()); }, "eps"_a, "name"_a,
      "Raises InvalidArgument naming `name` unless eps is finite and > 0.");
  m.def(
      "check_stage_plan", [](const nb::dict& plan) { stage_plan(plan); }, "plan"_a,
      "Raises InvalidArgument for a plan the stage refuses (StagePlan checks itself at construction).");
  m.def(
      "check_layer_config", [](const nb::dict& config) { layer_config(config); }, "config"_a,
      "Raises InvalidArgument for a configuration whose fields do not translate (types, eps, the rotaries).");
  m.def(
      "stage_indexer_rope",
      [](const nb::dict& config, const nb::dict& plan) { return indexer_rope_of(layer_config(config), stage_plan(plan)); },
      "config"_a, "plan"_a,
      "(rope_dims, rope_style) of dsa_stage_indexer_plan(config, plan): the layer's indexer rotary (0 for NoPE).");
  m.def(
      "stage_supports",
      [](int max_tokens, int64_t m, int64_t num_actual_tokens, int64_t num_decode_tokens) {
        dsa::DsaStagePlan plan;
        plan.max_tokens = max_tokens;
        return dsa::dsa_stage_supports(plan, m, num_actual_tokens, num_decode_tokens);
      },
      "max_tokens"_a, "m"_a, "num_actual_tokens"_a, "num_decode_tokens"_a);

  nb::class_<Stage>(m, "Stage")
      .def(
          "__init__",
          [](Stage* self, const nb::dict& config, const nb::dict& weights, const nb::dict& plan) {
            const dsa::DsaLayerConfig c = layer_config(config);
            const dsa::DsaStagePlan p = stage_plan(plan);
            // Absent weights stay empty views: create names each one missing.
            std::vector<Array> imported;
            dsa::DsaLayerWeights w;
            for (const auto& [name, field] : kWeights) {
              if (!weights.contains(name) || weights[name].is_none()) continue;
              imported.push_back(nb::cast<Array>(weights[name]));
              w.*field = to_view(imported.back(), name);
            }
            std::unique_ptr<dsa::DsaAttentionStage> stage;
            throw_if_error(dsa::DsaAttentionStage::create(c, w, p, &stage));
            new (self) Stage{std::move(stage), std::move(imported), {}};
          },
          "config"_a, "weights"_a, "plan"_a)
      .def(
          "supports",
          [](const Stage& s, int64_t m, int64_t num_actual_tokens, int64_t num_decode_tokens) {
            return s.stage->supports(m, num_actual_tokens, num_decode_tokens);
          },
          "m"_a, "num_actual_tokens"_a, "num_decode_tokens"_a)
      .def(
          "run",
          [](Stage& s, bool stock, const Array& hidden, const Array& positions, const Array& token_requests,
             const Array& slot_mapping, const Array& kv_cache, const Array& block_table, const OptArray& ring,
             const Array& index_k_cache, const Array& out, const OptArray& topk_positions, const OptArray& error_count,
             uintptr_t stream) {
            const dsa::DsaStepArgs args = step_args(hidden, positions, token_requests, slot_mapping, kv_cache,
                                                    block_table, ring, index_k_cache, out, topk_positions, error_count);
            launch_released([&] {
              const std::lock_guard<std::mutex> one_call(s.calls);
              return stock ? s.stage->stock_forward(args, to_stream(stream))
                           : s.stage->forward(args, to_stream(stream));
            });
          },
          "stock"_a, DSA_STEP_ARGUMENTS, "error_count"_a.none(), "stream"_a)
      .def(
          "run_steps",
          [](Stage& s, bool stock, size_t first, size_t count, const Array& hidden, const Array& positions,
             const Array& token_requests, const Array& slot_mapping, const Array& kv_cache, const Array& block_table,
             const OptArray& ring, const Array& index_k_cache, const Array& out, const OptArray& topk_positions,
             const OptArray& error_count, uintptr_t stream) {
            const dsa::DsaStepArgs args = step_args(hidden, positions, token_requests, slot_mapping, kv_cache,
                                                    block_table, ring, index_k_cache, out, topk_positions, error_count);
            launch_released([&] {
              const std::lock_guard<std::mutex> one_call(s.calls);
              return s.stage->run_steps(stock ? dsa::DsaPath::kStock : dsa::DsaPath::kFused, args, first, count,
                                        to_stream(stream));
            });
          },
          "stock"_a, "first"_a, "count"_a, DSA_STEP_ARGUMENTS, "error_count"_a.none(), "stream"_a)
      .def(
          "step_names",
          [](const Stage& s, bool stock, const Array& hidden, const Array& positions, const Array& token_requests,
             const Array& slot_mapping, const Array& kv_cache, const Array& block_table, const OptArray& ring,
             const Array& index_k_cache, const Array& out, const OptArray& topk_positions) {
            const dsa::DsaStepArgs args = step_args(hidden, positions, token_requests, slot_mapping, kv_cache,
                                                    block_table, ring, index_k_cache, out, topk_positions, {});
            std::vector<std::string> names;
            throw_if_error(s.stage->step_names(stock ? dsa::DsaPath::kStock : dsa::DsaPath::kFused, args, &names));
            return names;
          },
          "stock"_a, DSA_STEP_ARGUMENTS)
      .def(
          "intermediates",
          [](nb::handle self, int64_t m) {
            const Stage& s = nb::cast<const Stage&>(self);
            if (m < 1 || m > s.stage->plan().max_tokens) {
              throw_invalid("m", "1.." + std::to_string(s.stage->plan().max_tokens), std::to_string(m));
            }
            const dsa::DsaStageIntermediates v = s.stage->intermediates(m);
            nb::dict d;
            for (const auto& [name, field] : kIntermediates) d[name] = stage_array(v.*field, self);
            return d;
          },
          "m"_a)
      .def_prop_ro("max_tokens", [](const Stage& s) { return s.stage->plan().max_tokens; })
      .def_prop_ro("indexer_rope",
                   [](const Stage& s) { return indexer_rope_of(s.stage->config(), s.stage->plan()); })
      .def_prop_ro("value_up_tokens", [](const Stage& s) {
        return dsa::dsa_stage_value_up_tokens(s.stage->plan(), s.stage->config().num_heads);
      });
}

}  // namespace dsa_python
