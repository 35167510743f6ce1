// The DSA indexer's plan and steps (indexer.h): glm5next's pooled keys and
// DeepSeek-V3.2's (pool 1, RoPE of the first rope_dims dims by a cos/sin table).

#include <tuple>

#include "bind_common.h"
#include "dsa_decode/indexer.h"

namespace dsa_python {

namespace {

// dsa_decode.IndexerPlan as it crosses: (max_tokens, max_context, ring,
// block_size, logits, heads, pool, topk, rope_dims, rope_style), one argument
// of every indexer function.
using IndexerPlanFields = std::tuple<int, int64_t, int, int, std::string, int, int, int, int, std::string>;

// plan.rope_style by name: the names of ROPE_STYLES (bind_rope.cpp), in
// IndexerPlan's order (its default, RopeStyle::kHalfSplit, first).
constexpr dsa::Choice<dsa::RopeStyle> kIndexerRopeStyleChoices[] = {{dsa::RopeStyle::kHalfSplit, "half-split"},
                                                                    {dsa::RopeStyle::kInterleaved, "interleaved"}};

// The plan, checked (names first, then check_indexer_plan's rules).
dsa::IndexerPlan indexer_plan(const IndexerPlanFields& fields) {
  dsa::IndexerPlan plan;
  plan.max_tokens = std::get<0>(fields);
  plan.max_context = std::get<1>(fields);
  plan.ring = std::get<2>(fields);
  plan.block_size = std::get<3>(fields);
  plan.logits = parse_choice(dsa::kIndexerLogitsChoices, std::get<4>(fields), "logits");
  plan.heads = std::get<5>(fields);
  plan.pool = std::get<6>(fields);
  plan.topk = std::get<7>(fields);
  plan.rope_dims = std::get<8>(fields);
  plan.rope_style = parse_choice(kIndexerRopeStyleChoices, std::get<9>(fields), "rope_style");
  throw_if_error(dsa::check_indexer_plan(plan));
  return plan;
}

// ring may be None: pool 1 keeps no ring (check_indexer_* name it when a pooled plan needs it).
dsa::IndexerState indexer_state(const Array& block_table, const OptArray& ring, const Array& k_cache) {
  return dsa::IndexerState{to_view(block_table, "state.block_table"), to_view(ring, "state.ring"),
                           to_view(k_cache, "state.k_cache")};
}

}  // namespace

void bind_indexer(nb::module_& m) {
  m.attr("INDEXER_LOGITS") = choice_names(dsa::kIndexerLogitsChoices);
  m.attr("INDEXER_ROPE_STYLES") = choice_names(kIndexerRopeStyleChoices);
  m.def(
      "check_indexer_plan", [](const IndexerPlanFields& fields) { indexer_plan(fields); }, "plan"_a,
      "Raises InvalidArgument for a plan the indexer refuses (IndexerPlan checks itself at construction).");
  m.def(
      "indexer_workspace_bytes",
      [](const IndexerPlanFields& fields) { return dsa::indexer_workspace_layout(indexer_plan(fields)).bytes; },
      "plan"_a);
  m.def(
      "indexer_shape",
      [](const IndexerPlanFields& fields) {
        const dsa::IndexerPlan plan = indexer_plan(fields);
        nb::dict d;
        d["top_pools"] = dsa::indexer_top_pools(plan);
        d["row_width"] = dsa::indexer_row_width(plan);
        d["pools_per_page"] = dsa::indexer_pools_per_page(plan);
        d["page_bytes"] = dsa::indexer_page_bytes(plan);
        d["tokens_per_request"] = dsa::indexer_tokens_per_request(plan);
        const dsa::IndexerWorkspaceLayout layout = dsa::indexer_workspace_layout(plan);
        d["logits_stride"] = layout.logits_stride;
        d["q_fp8_offset"] = layout.q_fp8;
        d["head_weights_offset"] = layout.head_weights;
        d["logits_offset"] = layout.logits;
        return d;
      },
      "plan"_a,
      "The shapes indexer.h derives from a checked plan (indexer_row_width, ..., indexer_workspace_layout's offsets).");
  m.def(
      "indexer_ring_for",
      [](int pool, int tokens_per_request) { return dsa::indexer_ring_for(pool, tokens_per_request); }, "pool"_a,
      "tokens_per_request"_a, "indexer.h's indexer_ring_for: pool, 2 * pool, or 0 when even 2 * pool is too small.");

  m.def(
      "indexer_project",
      [](const IndexerPlanFields& plan, const Array& q_c, const Array& x, const Array& wq_b, const Array& wk,
         const Array& weights_proj, const OptArray& compress_gate, const Array& index_q, const Array& index_k,
         const Array& head_weights, const OptArray& gate, uintptr_t stream) {
        dsa::IndexerProjectArgs args;
        args.plan = indexer_plan(plan);
        args.q_c = to_view(q_c, "q_c");
        args.x = to_view(x, "x");
        args.wq_b = to_view(wq_b, "wq_b");
        args.wk = to_view(wk, "wk");
        args.weights_proj = to_view(weights_proj, "weights_proj");
        args.compress_gate = to_view(compress_gate, "compress_gate");
        args.index_q = to_view(index_q, "index_q");
        args.index_k = to_view(index_k, "index_k");
        args.head_weights = to_view(head_weights, "head_weights");
        args.gate = to_view(gate, "gate");
        launch_released([&] { return dsa::indexer_project_gemv(args, to_stream(stream)); });
      },
      // compress_gate and gate: None at pool 1 (DeepSeek-V3.2's indexer has no pool gate).
      "plan"_a, "q_c"_a, "x"_a, "wq_b"_a, "wk"_a, "weights_proj"_a, "compress_gate"_a.none(), "index_q"_a,
      "index_k"_a, "head_weights"_a, "gate"_a.none(), "stream"_a);

  m.def(
      "indexer_prepare",
      [](const IndexerPlanFields& plan, const Array& index_q, const Array& index_k, const Array& head_weights,
         const OptArray& gate, const Array& k_norm_weight, const Array& k_norm_bias, const OptArray& ape,
         const Array& positions, const Array& token_requests, const Array& block_table, const OptArray& ring_cache,
         const Array& k_cache, const Array& workspace, const OptArray& error_count, const OptArray& cos_sin,
         uintptr_t stream) {
        dsa::IndexerPrepareArgs args;
        args.plan = indexer_plan(plan);
        args.index_q = to_view(index_q, "index_q");
        args.index_k = to_view(index_k, "index_k");
        args.head_weights = to_view(head_weights, "head_weights");
        args.gate = to_view(gate, "gate");
        args.k_norm_weight = to_view(k_norm_weight, "k_norm_weight");
        args.k_norm_bias = to_view(k_norm_bias, "k_norm_bias");
        args.ape = to_view(ape, "ape");
        args.positions = to_view(positions, "positions");
        args.token_requests = to_view(token_requests, "token_requests");
        args.state = indexer_state(block_table, ring_cache, k_cache);
        args.workspace = to_view(workspace, "workspace");
        args.error_count = to_counter(error_count, "error_count");
        args.cos_sin = to_view(cos_sin, "cos_sin");
        launch_released([&] { return dsa::indexer_prepare(args, to_stream(stream)); });
      },
      "plan"_a, "index_q"_a, "index_k"_a, "head_weights"_a, "gate"_a.none(), "k_norm_weight"_a, "k_norm_bias"_a,
      "ape"_a.none(), "positions"_a, "token_requests"_a, "block_table"_a, "ring_cache"_a.none(), "k_cache"_a,
      "workspace"_a, "error_count"_a.none(), "cos_sin"_a.none(), "stream"_a);

  m.def(
      "indexer_select",
      [](const IndexerPlanFields& plan, const Array& positions, const Array& token_requests, const Array& block_table,
         const OptArray& ring_cache, const Array& k_cache, const Array& workspace, const Array& slots,
         const OptArray& topk_positions, const OptArray& error_count, uintptr_t stream) {
        dsa::IndexerSelectArgs args;
        args.plan = indexer_plan(plan);
        args.positions = to_view(positions, "positions");
        args.token_requests = to_view(token_requests, "token_requests");
        args.state = indexer_state(block_table, ring_cache, k_cache);
        args.workspace = to_view(workspace, "workspace");
        args.slots = to_view(slots, "slots");
        args.topk_positions = to_view(topk_positions, "topk_positions");
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::indexer_select(args, to_stream(stream)); });
      },
      "plan"_a, "positions"_a, "token_requests"_a, "block_table"_a, "ring_cache"_a.none(), "k_cache"_a, "workspace"_a,
      "slots"_a, "topk_positions"_a.none(), "error_count"_a.none(), "stream"_a);

  m.def(
      "indexer_remap",
      [](const IndexerPlanFields& plan, const Array& positions, const Array& token_requests, const Array& block_table,
         const OptArray& ring_cache, const Array& k_cache, const Array& topk_positions, const Array& slots,
         const OptArray& error_count, uintptr_t stream) {
        dsa::IndexerRemapArgs args;
        args.plan = indexer_plan(plan);
        args.positions = to_view(positions, "positions");
        args.token_requests = to_view(token_requests, "token_requests");
        args.state = indexer_state(block_table, ring_cache, k_cache);
        args.topk_positions = to_view(topk_positions, "topk_positions");
        args.slots = to_view(slots, "slots");
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::indexer_remap(args, to_stream(stream)); });
      },
      "plan"_a, "positions"_a, "token_requests"_a, "block_table"_a, "ring_cache"_a.none(), "k_cache"_a, "topk_positions"_a,
      "slots"_a, "error_count"_a.none(), "stream"_a);

  m.def(
      "indexer_prefill",
      [](const IndexerPlanFields& plan, const Array& index_k, const OptArray& gate, const Array& k_norm_weight,
         const Array& k_norm_bias, const OptArray& ape, int request, const Array& block_table,
         const OptArray& ring_cache, const Array& k_cache, const OptArray& error_count, const OptArray& cos_sin,
         uintptr_t stream) {
        dsa::IndexerPrefillArgs args;
        args.plan = indexer_plan(plan);
        args.index_k = to_view(index_k, "index_k");
        args.gate = to_view(gate, "gate");
        args.k_norm_weight = to_view(k_norm_weight, "k_norm_weight");
        args.k_norm_bias = to_view(k_norm_bias, "k_norm_bias");
        args.ape = to_view(ape, "ape");
        args.request = request;
        args.state = indexer_state(block_table, ring_cache, k_cache);
        args.error_count = to_counter(error_count, "error_count");
        args.cos_sin = to_view(cos_sin, "cos_sin");
        launch_released([&] { return dsa::indexer_prefill(args, to_stream(stream)); });
      },
      "plan"_a, "index_k"_a, "gate"_a.none(), "k_norm_weight"_a, "k_norm_bias"_a, "ape"_a.none(), "request"_a,
      "block_table"_a, "ring_cache"_a.none(), "k_cache"_a, "error_count"_a.none(), "cos_sin"_a.none(), "stream"_a);
}

}  // namespace dsa_python
