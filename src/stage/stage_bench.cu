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
//
// DeepSeek-V3.2 (dsv32, a RoPE layer) at TP1 (H = 128) and TP8 (H = 16),
// context 32k, m = 1, 2, 4, 8, 16, one request per token: rows
// `attention_half dsv32` and `whole_stage dsv32` (fused against the stock
// path with the same select and attention, `floor_us` on the whole stage:
// every weight once, each token's 2048 selected 656-byte entries and its
// indexer's 132-byte keys over the context), and at m = 1, 16 each step of
// each path alone ("fused step dsv32: <name>", "stock step dsv32: <name>").
// Its 656-byte KV cache holds entries of random latents (the cache write's),
// its unpooled indexer's K cache the prefill of random rows with the
// indexer's rotary; KV blocks of 64 tokens (vLLM's for V3.2).
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
#include "dsa_decode/rope.h"
#include "dsa_decode/sparse_mla_v32.h"
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

// One weight of a layer copy: BF16 uniform in [-scale, scale) (stddev
// scale / sqrt(3): linear(in) keeps a projection's outputs near unit scale),
// F32 filled with scale.
struct WeightPart {
  TensorView* view;
  DType dtype;
  std::vector<int64_t> shape;
  float scale;
};

float linear(int64_t in) { return std::sqrt(3.0f / float(in)); }

// All parts in one allocation (each 256-byte aligned), filled, their views set.
Status allocate_parts(const std::vector<WeightPart>& parts, uint64_t seed, bench::DeviceMemory* memory, size_t* bytes,
                      cudaStream_t stream) {
  std::vector<size_t> offsets, counts;
  for (const WeightPart& p : parts) {
    size_t count = 1;
    for (int64_t s : p.shape) count *= size_t(s);
    counts.push_back(count);
    offsets.push_back(*bytes);
    *bytes += (count * dtype_size(p.dtype) + 255) / 256 * 256;
  }
  DSA_RETURN_IF_ERROR(memory->allocate(*bytes));
  for (size_t i = 0; i < parts.size(); ++i) {
    const WeightPart& p = parts[i];
    char* data = memory->as<char>() + offsets[i];
    if (p.dtype == DType::kBF16) {
      DSA_RETURN_IF_ERROR(bench::fill_random_bf16(data, counts[i], seed + i, p.scale, stream));
    } else {
      DSA_RETURN_IF_ERROR(fill_f32(reinterpret_cast<float*>(data), counts[i], p.scale, stream));
    }
    *p.view = p.shape.size() == 1   ? make_tensor(data, p.dtype, {p.shape[0]})
              : p.shape.size() == 2 ? make_tensor(data, p.dtype, {p.shape[0], p.shape[1]})
                                    : make_tensor(data, p.dtype, {p.shape[0], p.shape[1], p.shape[2]});
  }
  return Status();
}

// One copy of a layer's weights in one allocation.
struct Weights {
  bench::DeviceMemory memory;
  DsaLayerWeights views;
  size_t bytes = 0;

  // The indexer's weights at the plan's shape (indexer_heads, indexer_pool).
  Status make(int64_t H, const DsaStagePlan& plan, uint64_t seed, cudaStream_t stream) {
    const int64_t HI = plan.indexer_heads, S = plan.indexer_pool;
    DsaLayerWeights& w = views;
    const std::vector<WeightPart> parts = {
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
    return allocate_parts(parts, seed, &memory, &bytes, stream);
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

// ---------------------------------------------------------------- dsv32 (RoPE)

constexpr int kRopeBlock = 64;  // vLLM's KV block for DeepSeek-V3.2 (FlashMLA's pages)
constexpr int64_t kRopeContext = 32768;

// One copy of a RoPE layer's weights in one allocation (the views the stage
// reads at R > 0: no static scales, pool gate or ape).
struct RopeWeights {
  bench::DeviceMemory memory;
  DsaLayerWeights views;
  size_t bytes = 0;

  Status make(const DsaLayerConfig& c, const DsaStagePlan& plan, uint64_t seed, cudaStream_t stream) {
    const int64_t D = c.hidden_size, H = c.num_heads, Q = c.q_lora_rank, L = c.kv_lora_rank, P = c.qk_nope_head_dim,
                  R = c.qk_rope_head_dim, V = c.v_head_dim, HI = plan.indexer_heads;
    DsaLayerWeights& w = views;
    const std::vector<WeightPart> parts = {
        {&w.fused_qkv_a_proj, DType::kBF16, {Q + L + R, D}, linear(D)},
        {&w.q_a_norm, DType::kBF16, {Q}, 1.0f},
        {&w.kv_a_norm, DType::kBF16, {L}, 1.0f},
        {&w.q_b_proj, DType::kBF16, {H * (P + R), Q}, linear(Q)},
        {&w.w_uk_t, DType::kBF16, {H, P, L}, linear(P)},
        {&w.w_uv, DType::kBF16, {H, L, V}, linear(L)},
        {&w.o_proj, DType::kBF16, {D, H * V}, linear(H * V)},
        {&w.index_wq_b, DType::kBF16, {HI * kIndexerDim, Q}, linear(Q)},
        {&w.index_wk, DType::kBF16, {kIndexerDim, D}, linear(D)},
        {&w.index_weights_proj, DType::kBF16, {HI, D}, linear(D)},
        {&w.index_k_norm_weight, DType::kF32, {kIndexerDim}, 1.0f},
        {&w.index_k_norm_bias, DType::kF32, {kIndexerDim}, 0.0f},
    };
    return allocate_parts(parts, seed, &memory, &bytes, stream);
  }
};

// m requests of `context` cached tokens each, one decode token per request,
// over the 656-byte KV cache and the unpooled indexer's K cache (no ring).
struct RopeCaches {
  int m = 0;
  int64_t D = 0, context = 0, width = 0, blocks = 0, page_bytes = 0;
  bench::DeviceMemory hidden, out, positions, token_requests, slot_mapping, block_table, kv_cache, k_cache, errors,
      table;

  Status make(int tokens, int64_t cached, const DsaLayerConfig& config, const DsaLayerWeights& w,
              const DsaStagePlan& plan, cudaStream_t stream) {
    m = tokens;
    D = config.hidden_size;
    context = cached;
    width = (context + 1 + kRopeBlock - 1) / kRopeBlock;
    blocks = m * width;
    const IndexerPlan indexer_plan = dsa_stage_indexer_plan(config, plan);
    page_bytes = indexer_page_bytes(indexer_plan);
    std::vector<int64_t> host_positions(m, context), host_slots(m);
    std::vector<int32_t> host_requests(m), host_table(size_t(m) * width);
    for (int r = 0; r < m; ++r) {
      host_requests[r] = r;
      for (int64_t b = 0; b < width; ++b) host_table[r * width + b] = static_cast<int32_t>(r * width + b);
      host_slots[r] = host_table[r * width + context / kRopeBlock] * int64_t(kRopeBlock) + context % kRopeBlock;
    }
    DSA_RETURN_IF_ERROR(hidden.allocate(size_t(m) * D * 2));
    DSA_RETURN_IF_ERROR(bench::fill_random_bf16(hidden.get(), size_t(m) * D, 0x68696464 + m, 1.7f, stream));
    DSA_RETURN_IF_ERROR(out.allocate(size_t(m) * D * 2));
    DSA_RETURN_IF_ERROR(Caches::upload(host_positions, &positions, stream));
    DSA_RETURN_IF_ERROR(Caches::upload(host_requests, &token_requests, stream));
    DSA_RETURN_IF_ERROR(Caches::upload(host_slots, &slot_mapping, stream));
    DSA_RETURN_IF_ERROR(Caches::upload(host_table, &block_table, stream));
    DSA_RETURN_IF_ERROR(errors.allocate(sizeof(unsigned int)));
    DSA_CUDA_RETURN(cudaMemsetAsync(errors.get(), 0, errors.bytes(), stream));
    // The KV cache: every entry the cache write's of random latents and RoPE values (stddev ~0.3: scores of
    // unit spread), written in chunks from one random source.
    const int64_t slots = blocks * kRopeBlock;
    DSA_RETURN_IF_ERROR(kv_cache.allocate(size_t(slots) * kSparseMlaV32EntryBytes));
    {
      constexpr int64_t kChunk = 32768;  // tokens a cache write takes: at most kSparseMlaV32MaxTokens
      bench::DeviceMemory source, slot_ids;
      const int64_t chunk = std::min(kChunk, slots);
      DSA_RETURN_IF_ERROR(source.allocate(size_t(chunk) * kSparseMlaV32HeadDim * 2));
      DSA_RETURN_IF_ERROR(
          bench::fill_random_bf16(source.get(), size_t(chunk) * kSparseMlaV32HeadDim, 0x6b76 + m, 0.5f, stream));
      std::vector<int64_t> ids(static_cast<size_t>(slots));
      for (int64_t i = 0; i < slots; ++i) ids[size_t(i)] = i;
      DSA_RETURN_IF_ERROR(Caches::upload(ids, &slot_ids, stream));
      const TensorView cache = make_tensor(kv_cache.get(), DType::kU8, {blocks, kRopeBlock, kSparseMlaV32EntryBytes});
      for (int64_t first = 0; first < slots; first += chunk) {
        const int64_t n = std::min(chunk, slots - first);
        SparseMlaV32CacheWriteArgs a;
        a.kv_c = make_strided(source.get(), DType::kBF16, {n, kSparseMlaV32Latent}, {kSparseMlaV32HeadDim, 1});
        a.k_pe = make_strided(source.as<uint16_t>() + kSparseMlaV32Latent, DType::kBF16, {n, kSparseMlaV32Rope},
                              {kSparseMlaV32HeadDim, 1});
        a.slot_mapping = make_tensor(slot_ids.as<int64_t>() + first, DType::kI64, {n});
        a.kv_cache = cache;
        a.error_count = errors.as<unsigned int>();
        DSA_RETURN_IF_ERROR(sparse_mla_v32_cache_write(a, stream));
      }
      DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
    }
    // The indexer's rotary table (the one the stage builds for itself) and every request's context keys.
    {
      std::vector<float> host(size_t(plan.max_context) * config.indexer_rope->rope_dim);
      DSA_RETURN_IF_ERROR(rope_cos_sin_table(*config.indexer_rope, 0, plan.max_context, host.data()));
      DSA_RETURN_IF_ERROR(Caches::upload(host, &table, stream));
    }
    DSA_RETURN_IF_ERROR(k_cache.allocate(size_t(blocks) * page_bytes));
    DSA_CUDA_RETURN(cudaMemsetAsync(k_cache.get(), 0, k_cache.bytes(), stream));
    bench::DeviceMemory rows;
    DSA_RETURN_IF_ERROR(rows.allocate(size_t(context) * kIndexerDim * 2));
    DSA_RETURN_IF_ERROR(bench::fill_random_bf16(rows.get(), size_t(context) * kIndexerDim, 0x726f7773, 1.7f, stream));
    for (int r = 0; r < m; ++r) {
      IndexerPrefillArgs a;
      a.plan = indexer_plan;
      a.index_k = make_tensor(rows.get(), DType::kBF16, {context, kIndexerDim});
      a.k_norm_weight = w.index_k_norm_weight;
      a.k_norm_bias = w.index_k_norm_bias;
      a.request = r;
      a.state = indexer();
      a.error_count = errors.as<unsigned int>();
      a.cos_sin = make_tensor(table.get(), DType::kF32, {plan.max_context, config.indexer_rope->rope_dim});
      DSA_RETURN_IF_ERROR(indexer_prefill(a, stream));
    }
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
    return Status();
  }

  IndexerState indexer() const {
    return IndexerState{make_tensor(block_table.get(), DType::kI32, {m, width}), TensorView(),
                        make_tensor(k_cache.get(), DType::kU8, {blocks, page_bytes})};
  }

  DsaStepArgs args() const {
    DsaStepArgs a;
    a.hidden = make_tensor(hidden.get(), DType::kBF16, {m, D});
    a.positions = make_tensor(positions.get(), DType::kI64, {m});
    a.token_requests = make_tensor(token_requests.get(), DType::kI32, {m});
    a.slot_mapping = make_tensor(slot_mapping.get(), DType::kI64, {m});
    a.kv_cache = make_tensor(kv_cache.get(), DType::kU8, {blocks, kRopeBlock, kSparseMlaV32EntryBytes});
    a.indexer = indexer();
    a.out = make_tensor(out.get(), DType::kBF16, {m, D});
    a.error_count = errors.as<unsigned int>();
    return a;
  }
};

Status bench_stage_dsv32(bench::Context& ctx, bench::Report& report) {
  ModelPreset preset;
  DSA_RETURN_IF_ERROR(find_preset("dsv32", &preset));
  for (int tp : {1, 8}) {
    ModelPreset rank;
    DSA_RETURN_IF_ERROR(per_rank(preset, tp, &rank));
    const DsaLayerConfig config = dsa_layer_config(rank, 1e-6f);
    DsaStagePlan plan = dsa_stage_plan_for(rank);  // 64 heads, pool 1, top-2048, no ring
    plan.block_size = kRopeBlock;
    plan.max_context = kRopeContext + 1;
    const int64_t H = config.num_heads;
    RopeWeights first;
    DSA_RETURN_IF_ERROR(first.make(config, plan, 0x7633 + tp, ctx.stream));
    const int copies = bench::cold_copies(ctx, first.bytes);
    std::vector<RopeWeights> weights(copies);
    weights[0] = std::move(first);
    for (int c = 1; c < copies; ++c) {
      DSA_RETURN_IF_ERROR(weights[c].make(config, plan, 0x7633 + tp + 100 * c, ctx.stream));
    }
    DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
    std::shared_ptr<DsaStageWorkspace> workspace;
    DSA_RETURN_IF_ERROR(DsaStageWorkspace::create(config, plan, &workspace));
    std::vector<std::unique_ptr<DsaAttentionStage>> stages(copies);
    for (int c = 0; c < copies; ++c) {
      DSA_RETURN_IF_ERROR(DsaAttentionStage::create(config, weights[c].views, plan, &stages[c], workspace));
    }
    const IndexerPlan indexer = dsa_stage_indexer_plan(config, plan);
    for (int m : {1, 2, 4, 8, 16}) {
      RopeCaches caches;
      DSA_RETURN_IF_ERROR(caches.make(m, kRopeContext, config, weights[0].views, plan, ctx.stream));
      const DsaStepArgs args = caches.args();
      std::vector<std::string> fused_steps, stock_steps;
      DSA_RETURN_IF_ERROR(stages[0]->step_names(DsaPath::kFused, args, &fused_steps));
      DSA_RETURN_IF_ERROR(stages[0]->step_names(DsaPath::kStock, args, &stock_steps));
      const auto timed = [&](DsaPath path, size_t first_step, size_t count, double* us) {
        return bench::time_graph(
            ctx,
            [&](cudaStream_t stream, int i) {
              return stages[i % copies]->run_steps(path, args, first_step, count, stream);
            },
            us, std::max(copies, 4), 20);
      };
      double fused_whole = 0, stock_whole = 0, fused_half = 0, stock_half = 0;
      DSA_RETURN_IF_ERROR(timed(DsaPath::kFused, 0, fused_steps.size(), &fused_whole));
      DSA_RETURN_IF_ERROR(timed(DsaPath::kStock, 0, stock_steps.size(), &stock_whole));
      DSA_RETURN_IF_ERROR(timed(DsaPath::kFused, 1, fused_steps.size() - 2, &fused_half));
      DSA_RETURN_IF_ERROR(timed(DsaPath::kStock, 1, stock_steps.size() - 2, &stock_half));
      const std::vector<std::pair<std::string, double>> params = {
          {"H", double(H)}, {"m", double(m)}, {"context", double(kRopeContext)}};
      const std::string value_up = fused_steps[fused_steps.size() - 2];
      report.add(bench::Row{"attention_half dsv32", params, fused_half,
                            "stock_forward (same select and attention), norm .. value_up", stock_half, 0, 0,
                            "DeepSeek-V3.2: rope_absorb, 656-byte cache, indexer pool 1; " + value_up});
      // The memory floor: every weight once, each token's selected 656-byte entries and, past K tokens, its
      // indexer K cache scan (a 132-byte key per token).
      const double step_bytes =
          double(weights[0].bytes) +
          double(m) * (double(indexer_row_width(indexer)) * kSparseMlaV32EntryBytes +
                       (kRopeContext + 1 > indexer.topk ? double(kRopeContext + 1) * kIndexerPoolBytes : 0));
      report.add(bench::Row{"whole_stage dsv32", params, fused_whole, "stock_forward (same select and attention)",
                            stock_whole, bench::floor_us(ctx, step_bytes), 0,
                            "DeepSeek-V3.2: rope_absorb, 656-byte cache, indexer pool 1; " + value_up});
      if (m == 1 || m == 16) {
        for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
          const std::vector<std::string>& names = path == DsaPath::kFused ? fused_steps : stock_steps;
          for (size_t i = 0; i < names.size(); ++i) {
            double us = 0;
            DSA_RETURN_IF_ERROR(timed(path, i, 1, &us));
            report.add(bench::Row{
                std::string(path == DsaPath::kFused ? "fused step dsv32: " : "stock step dsv32: ") + names[i], params,
                us, "", 0, 0, 0, ""});
          }
        }
      }
    }
  }
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
  return bench_stage_dsv32(ctx, report);
}

DSA_BENCH("stage", bench_stage);

}  // namespace
}  // namespace dsa
