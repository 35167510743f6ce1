// The stage, fused (forward) against stock (stock_forward), in the same run:
// glm5next at TP1 (H = 64) and TP8 (H = 8), contexts 32k and 128k, m = 1, 2,
// 4, 8, 16, one request per token. Rows (DESIGN.md section 4):
// `attention_half` (norm through value-up: every step but qkv_a_proj and
// o_proj) and `whole_stage`; at 32k and m = 1, 16 also each step of each
// path alone ("fused step: <name>", "stock step: <name>"); the stock path
// runs the same select and attention as the fused one, so the ratios are what
// the fusion buys. Also against the fused path with the indexer on the
// caller's stream (`*_overlap`: what its own stream saves), with cuBLASLt
// projections (`whole_stage_gemv_projections`) and the batch-invariant plan
// (`whole_stage_batch_invariant`: what invariance costs);
// and both rows again with the caller's top-k rows in both paths
// (`*_caller_topk`: the indexer does not run, only the remap). Cold L2: as many stages as it takes for their
// weight copies to be twice the L2, replayed in turn; each request's KV rows
// are its own (16 MiB at 32k), so the selected rows come from memory too.
// Random weights at unit-output scales and random caches (the indexer's
// prefilled from random rows): the times do not depend on the values.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/launch.cuh"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/stage.h"
#include "harness.h"

namespace dsa {
namespace {

constexpr int64_t kD = 4096, kQ = 1536, kL = 512, kP = 256, kV = 256;  // glm5next
constexpr int kBlock = 256;

__global__ void fill_f32_kernel(float* values, size_t count, float value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    values[i] = value;
  }
}

Status fill_f32(float* values, size_t count, float value, cudaStream_t stream) {
  fill_f32_kernel<<<64, 256, 0, stream>>>(values, count, value);
  return cuda_status(cudaGetLastError(), "fill_f32_kernel");
}

// One copy of a layer's weights in one allocation.
struct Weights {
  bench::DeviceMemory memory;
  DsaLayerWeights views;
  size_t bytes = 0;

  // The indexer's weights at the plan's shape (indexer_heads, indexer_pool).
  Status make(int64_t H, const DsaStagePlan& plan, uint64_t seed, cudaStream_t stream) {
    const int64_t HI = plan.indexer_heads, S = plan.indexer_pool;
    struct Part {
      TensorView* view;
      DType dtype;
      std::vector<int64_t> shape;
      float scale;  // uniform [-scale, scale): stddev scale / sqrt(3); in^-0.5 keeps outputs near unit scale
    };
    const auto linear = [](int64_t in) { return std::sqrt(3.0f / float(in)); };
    DsaLayerWeights& w = views;
    const std::vector<Part> parts = {
        {&w.fused_qkv_a_proj, DType::kBF16, {kQ + kL, kD}, linear(kD)},
        {&w.q_a_norm, DType::kBF16, {kQ}, 1.0f},
        {&w.kv_a_norm, DType::kBF16, {kL}, 1.0f},
        {&w.q_b_proj, DType::kBF16, {H * kP, kQ}, linear(kQ)},
        {&w.w_uk_t, DType::kBF16, {H, kP, kL}, linear(kP)},
        {&w.w_uv, DType::kBF16, {H, kL, kV}, linear(kL)},
        {&w.o_proj, DType::kBF16, {kD, H * kV}, linear(H * kV)},
        {&w.q_scale, DType::kF32, {1}, 0.01f},
        {&w.k_scale, DType::kF32, {1}, 0.01f},
        {&w.index_wq_b, DType::kBF16, {HI * kIndexerDim, kQ}, linear(kQ)},
        {&w.index_wk, DType::kBF16, {kIndexerDim, kD}, linear(kD)},
        {&w.index_weights_proj, DType::kBF16, {HI, kD}, linear(kD)},
        {&w.index_compress_gate, DType::kBF16, {kIndexerDim, kD}, linear(kD)},
        {&w.index_k_norm_weight, DType::kF32, {kIndexerDim}, 1.0f},
        {&w.index_k_norm_bias, DType::kF32, {kIndexerDim}, 0.0f},
        {&w.index_ape, DType::kF32, {S, kIndexerDim}, 0.0f},
    };
    std::vector<size_t> offsets;
    for (const Part& p : parts) {
      size_t count = 1;
      for (int64_t s : p.shape) count *= size_t(s);
      offsets.push_back(bytes);
      bytes += (count * dtype_size(p.dtype) + 255) / 256 * 256;
    }
    DSA_RETURN_IF_ERROR(memory.allocate(bytes));
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& p = parts[i];
      char* data = memory.as<char>() + offsets[i];
      size_t count = 1;
      for (int64_t s : p.shape) count *= size_t(s);
      if (p.dtype == DType::kBF16) {
        DSA_RETURN_IF_ERROR(bench::fill_random_bf16(data, count, seed + i, p.scale, stream));
      } else {
        DSA_RETURN_IF_ERROR(fill_f32(reinterpret_cast<float*>(data), count, p.scale, stream));
      }
      *p.view = p.shape.size() == 1   ? make_tensor(data, p.dtype, {p.shape[0]})
                : p.shape.size() == 2 ? make_tensor(data, p.dtype, {p.shape[0], p.shape[1]})
                                      : make_tensor(data, p.dtype, {p.shape[0], p.shape[1], p.shape[2]});
    }
    return Status();
  }
};

// m requests of `context` cached tokens each, one decode token per request.
struct Caches {
  int m;
  int64_t context, width, blocks, page_bytes, ring_rows;
  bench::DeviceMemory hidden, out, positions, token_requests, slot_mapping, block_table, kv_cache, ring, k_cache, rows,
      errors;

  Status make(int tokens, int64_t cached, const DsaLayerWeights& w, const DsaStagePlan& plan, cudaStream_t stream) {
    m = tokens;
    context = cached;
    width = (context + 1 + kBlock - 1) / kBlock;
    blocks = m * width;
    page_bytes = indexer_page_bytes(dsa_stage_indexer_plan(plan));
    ring_rows = plan.ring;
    std::vector<int64_t> host_positions(m, context), host_slots(m);
    std::vector<int32_t> host_requests(m), host_table(size_t(m) * width);
    for (int r = 0; r < m; ++r) {
      host_requests[r] = r;
      for (int64_t b = 0; b < width; ++b) host_table[r * width + b] = static_cast<int32_t>(r * width + b);
      host_slots[r] = host_table[r * width + context / kBlock] * int64_t(kBlock) + context % kBlock;
    }
    DSA_RETURN_IF_ERROR(hidden.allocate(size_t(m) * kD * 2));
    DSA_RETURN_IF_ERROR(bench::fill_random_bf16(hidden.get(), size_t(m) * kD, 0x68696464 + m, 1.7f, stream));
    DSA_RETURN_IF_ERROR(out.allocate(size_t(m) * kD * 2));
    DSA_RETURN_IF_ERROR(upload(host_positions, &positions, stream));
    DSA_RETURN_IF_ERROR(upload(host_requests, &token_requests, stream));
    DSA_RETURN_IF_ERROR(upload(host_slots, &slot_mapping, stream));
    DSA_RETURN_IF_ERROR(upload(host_table, &block_table, stream));
    DSA_RETURN_IF_ERROR(kv_cache.allocate(size_t(blocks) * kBlock * kL));
    DSA_RETURN_IF_ERROR(bench::fill_random_e4m3(kv_cache.get(), kv_cache.bytes(), 0x6b76 + m, stream));
    DSA_RETURN_IF_ERROR(ring.allocate(size_t(m) * 2 * plan.ring * kIndexerDim * 2));
    DSA_CUDA_RETURN(cudaMemsetAsync(ring.get(), 0, ring.bytes(), stream));
    DSA_RETURN_IF_ERROR(k_cache.allocate(size_t(blocks) * page_bytes));
    DSA_CUDA_RETURN(cudaMemsetAsync(k_cache.get(), 0, k_cache.bytes(), stream));
    DSA_RETURN_IF_ERROR(errors.allocate(sizeof(unsigned int)));
    DSA_CUDA_RETURN(cudaMemsetAsync(errors.get(), 0, errors.bytes(), stream));
    // Every request's context through the indexer's prefill, from one set of random rows.
    DSA_RETURN_IF_ERROR(rows.allocate(size_t(context) * kIndexerDim * 2 * 2));
    DSA_RETURN_IF_ERROR(
        bench::fill_random_bf16(rows.get(), size_t(context) * kIndexerDim * 2, 0x726f7773, 1.7f, stream));
    for (int r = 0; r < m; ++r) {
      IndexerPrefillArgs a;
      a.plan = dsa_stage_indexer_plan(plan);
      a.index_k = make_tensor(rows.get(), DType::kBF16, {context, kIndexerDim});
      a.gate = make_tensor(rows.as<uint16_t>() + context * kIndexerDim, DType::kBF16, {context, kIndexerDim});
      a.k_norm_weight = w.index_k_norm_weight;
      a.k_norm_bias = w.index_k_norm_bias;
      a.ape = w.index_ape;
      a.request = r;
      a.state = indexer();
      a.error_count = errors.as<unsigned int>();
      DSA_RETURN_IF_ERROR(indexer_prefill(a, stream));
    }
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
    return Status();
  }

  template <class T>
  static Status upload(const std::vector<T>& host, bench::DeviceMemory* device, cudaStream_t stream) {
    DSA_RETURN_IF_ERROR(device->allocate(host.size() * sizeof(T)));
    DSA_CUDA_RETURN(
        cudaMemcpyAsync(device->get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
    return cudaStreamSynchronize(stream) == cudaSuccess ? Status() : cuda_status(cudaGetLastError(), "upload");
  }

  IndexerState indexer() const {
    return IndexerState{make_tensor(block_table.get(), DType::kI32, {m, width}),
                        make_tensor(ring.get(), DType::kBF16, {m, 2, ring_rows, kIndexerDim}),
                        make_tensor(k_cache.get(), DType::kU8, {blocks, page_bytes})};
  }

  DsaStepArgs args() const {
    DsaStepArgs a;
    a.hidden = make_tensor(hidden.get(), DType::kBF16, {m, kD});
    a.positions = make_tensor(positions.get(), DType::kI64, {m});
    a.token_requests = make_tensor(token_requests.get(), DType::kI32, {m});
    a.slot_mapping = make_tensor(slot_mapping.get(), DType::kI64, {m});
    a.kv_cache = make_tensor(kv_cache.get(), DType::kFP8E4M3, {blocks, kBlock, kL});
    a.indexer = indexer();
    a.out = make_tensor(out.get(), DType::kBF16, {m, kD});
    a.error_count = errors.as<unsigned int>();
    return a;
  }
};

Status glm5next(int tp, DsaLayerConfig* config) {
  ModelPreset preset, rank;
  DSA_RETURN_IF_ERROR(find_preset("glm5next", &preset));
  DSA_RETURN_IF_ERROR(per_rank(preset, tp, &rank));
  *config = dsa_layer_config(rank, 1e-6f);
  return Status();
}

Status bench_stage(bench::Context& ctx, bench::Report& report) {
  DsaStagePlan plan;
  plan.max_context = 131072 + 1;
  for (int tp : {1, 8}) {
    const int64_t H = 64 / tp;
    Weights first;
    DSA_RETURN_IF_ERROR(first.make(H, plan, 0x7374 + tp, ctx.stream));
    const int copies = bench::cold_copies(ctx, first.bytes);
    std::vector<Weights> weights(copies);
    weights[0] = std::move(first);
    for (int c = 1; c < copies; ++c) DSA_RETURN_IF_ERROR(weights[c].make(H, plan, 0x7374 + tp + 100 * c, ctx.stream));
    DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
    // `stages`: the default plan. `variants`: the fused path with the indexer
    // on the caller's stream (no overlap), the stock path with the fused
    // select. `cublaslt`: every projection through cuBLASLt.
    DsaStagePlan variant_plan = plan, cublaslt_plan = plan, invariant_plan = plan;
    variant_plan.overlap_indexer = false;
    cublaslt_plan.projection_gemv_tokens = std::set<int>{};
    invariant_plan.batch_invariant = true;
    std::vector<std::unique_ptr<DsaAttentionStage>> stages(copies), variants(copies), cublaslt(copies),
        invariant(copies);
    DsaLayerConfig config;
    DSA_RETURN_IF_ERROR(glm5next(tp, &config));
    // One workspace for all of them, as a model's layers on one stream share one.
    std::shared_ptr<DsaStageWorkspace> workspace;
    DSA_RETURN_IF_ERROR(DsaStageWorkspace::create(config, plan, &workspace));
    for (int c = 0; c < copies; ++c) {
      DSA_RETURN_IF_ERROR(DsaAttentionStage::create(config, weights[c].views, plan, &stages[c], workspace));
      DSA_RETURN_IF_ERROR(DsaAttentionStage::create(config, weights[c].views, variant_plan, &variants[c], workspace));
      DSA_RETURN_IF_ERROR(DsaAttentionStage::create(config, weights[c].views, cublaslt_plan, &cublaslt[c], workspace));
      DSA_RETURN_IF_ERROR(
          DsaAttentionStage::create(config, weights[c].views, invariant_plan, &invariant[c], workspace));
    }
    for (int64_t context : {int64_t{32768}, int64_t{131072}}) {
      for (int m : {1, 2, 4, 8, 16}) {
        Caches caches;
        DSA_RETURN_IF_ERROR(caches.make(m, context, weights[0].views, plan, ctx.stream));
        const DsaStepArgs args = caches.args();
        std::vector<std::string> fused_steps, stock_steps;
        DSA_RETURN_IF_ERROR(stages[0]->step_names(DsaPath::kFused, args, &fused_steps));
        DSA_RETURN_IF_ERROR(stages[0]->step_names(DsaPath::kStock, args, &stock_steps));
        // [first, first + count) of each path's steps on `step`, stage i % copies of `set`.
        const auto timed_on = [&](const std::vector<std::unique_ptr<DsaAttentionStage>>& set, const DsaStepArgs& step,
                                  DsaPath path, size_t first, size_t count, double* us) {
          return bench::time_graph(
              ctx,
              [&](cudaStream_t stream, int i) { return set[i % copies]->run_steps(path, step, first, count, stream); },
              us, std::max(copies, 4), 20);
        };
        // Both paths of `set` on `step`, whole and without the first (qkv_a_proj) and the last (o_proj) step.
        struct PathTimes {
          double fused_whole = 0, stock_whole = 0, fused_half = 0, stock_half = 0;
        };
        const auto time_paths = [&](const std::vector<std::unique_ptr<DsaAttentionStage>>& set, const DsaStepArgs& step,
                                    PathTimes* t) {
          std::vector<std::string> fused, stock;
          DSA_RETURN_IF_ERROR(set[0]->step_names(DsaPath::kFused, step, &fused));
          DSA_RETURN_IF_ERROR(set[0]->step_names(DsaPath::kStock, step, &stock));
          DSA_RETURN_IF_ERROR(timed_on(set, step, DsaPath::kFused, 0, fused.size(), &t->fused_whole));
          DSA_RETURN_IF_ERROR(timed_on(set, step, DsaPath::kStock, 0, stock.size(), &t->stock_whole));
          DSA_RETURN_IF_ERROR(timed_on(set, step, DsaPath::kFused, 1, fused.size() - 2, &t->fused_half));
          return timed_on(set, step, DsaPath::kStock, 1, stock.size() - 2, &t->stock_half);
        };
        PathTimes t, v, c;
        DSA_RETURN_IF_ERROR(time_paths(stages, args, &t));
        DSA_RETURN_IF_ERROR(time_paths(variants, args, &v));
        DSA_RETURN_IF_ERROR(time_paths(cublaslt, args, &c));
        std::vector<std::string> invariant_steps;
        DSA_RETURN_IF_ERROR(invariant[0]->step_names(DsaPath::kFused, args, &invariant_steps));
        double invariant_us = 0;
        DSA_RETURN_IF_ERROR(timed_on(invariant, args, DsaPath::kFused, 0, invariant_steps.size(), &invariant_us));
        const std::vector<std::pair<std::string, double>> params = {
            {"H", double(H)}, {"m", double(m)}, {"context", double(context)}};
        const std::string value_up = fused_steps[fused_steps.size() - 2];
        report.add(bench::Row{"attention_half", params, t.fused_half,
                              "stock_forward (same select and attention), norm .. value_up", t.stock_half, 0, 0,
                              value_up});
        // The memory floor: every weight once, each token's selected KV rows and, past K tokens, its indexer
        // K cache scan (the activations are a few hundred KiB).
        const IndexerPlan indexer = dsa_stage_indexer_plan(plan);
        const double step_bytes =
            double(weights[0].bytes) +
            double(m) * (double(indexer_row_width(indexer)) * kL +
                         (context + 1 > indexer.topk ? double(context + 1) / indexer.pool * kIndexerPoolBytes : 0));
        report.add(bench::Row{"whole_stage", params, t.fused_whole, "stock_forward (same select and attention)",
                              t.stock_whole, bench::floor_us(ctx, step_bytes), 0, value_up});
        // What batch invariance costs: the fused path under plan.batch_invariant against the default.
        report.add(bench::Row{"whole_stage_batch_invariant", params, invariant_us, "forward (default plan)",
                              t.fused_whole, 0, 0, "batch_invariant"});
        // What the indexer's own stream saves: the same fused path with the indexer after the absorb.
        report.add(bench::Row{"attention_half_overlap", params, t.fused_half,
                              "forward with the indexer on the caller's stream, norm .. value_up", v.fused_half, 0, 0,
                              value_up});
        report.add(bench::Row{"whole_stage_overlap", params, t.fused_whole,
                              "forward with the indexer on the caller's stream", v.fused_whole, 0, 0, value_up});
        // What linear_gemv saves: the same fused path with every projection through cuBLASLt.
        report.add(bench::Row{"whole_stage_gemv_projections", params, t.fused_whole,
                              "forward with cuBLASLt projections", c.fused_whole, 0, 0,
                              fused_steps.front() + ", " + fused_steps.back()});
        // The same step with the caller's top-k rows (MTP draft steps 1+; also the stage without the
        // indexer): the rows the stock path's select kept, remapped by both paths.
        {
          DSA_RETURN_IF_ERROR(stages[0]->stock_forward(args, ctx.stream));
          bench::DeviceMemory caller_rows;
          const TensorView chosen = stages[0]->intermediates(m).topk_positions;
          DSA_RETURN_IF_ERROR(caller_rows.allocate(size_t(chosen.numel()) * sizeof(int32_t)));
          DSA_CUDA_RETURN(cudaMemcpyAsync(caller_rows.get(), chosen.data, caller_rows.bytes(), cudaMemcpyDeviceToDevice,
                                          ctx.stream));
          DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
          DsaStepArgs with_rows = args;
          with_rows.topk_positions = make_tensor(caller_rows.get(), DType::kI32, {m, chosen.size(1)});
          PathTimes same_rows;
          DSA_RETURN_IF_ERROR(time_paths(stages, with_rows, &same_rows));
          report.add(bench::Row{"attention_half_caller_topk", params, same_rows.fused_half,
                                "stock_forward with the same rows, norm .. value_up", same_rows.stock_half, 0, 0,
                                value_up});
          report.add(bench::Row{"whole_stage_caller_topk", params, same_rows.fused_whole,
                                "stock_forward with the same rows", same_rows.stock_whole, 0, 0, value_up});
        }
        // Where the time goes: each step of each path alone (its inputs as the previous steps left them), at
        // the two ends of m, 32k.
        if (context == 32768 && (m == 1 || m == 16)) {
          for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
            const std::vector<std::string>& names = path == DsaPath::kFused ? fused_steps : stock_steps;
            for (size_t i = 0; i < names.size(); ++i) {
              double us = 0;
              DSA_RETURN_IF_ERROR(timed_on(stages, args, path, i, 1, &us));
              report.add(bench::Row{std::string(path == DsaPath::kFused ? "fused step: " : "stock step: ") + names[i],
                                    params, us, "", 0, 0, 0, ""});
            }
          }
        }
      }
    }
  }
  return Status();
}

DSA_BENCH("stage", bench_stage);

}  // namespace
}  // namespace dsa
