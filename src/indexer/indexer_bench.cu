// The indexer's select step (logits + top-512 + expansion + remap) against the
// straightforward baseline (same logits kernel, CUB segmented radix sort,
// separate expand and remap kernels), same run: cold L2 (rotated K-cache
// copies), graph replay. Rows "select" (the default plan) and "select (exact
// logits)" with params m, context; m distinct
// requests, each with its own pages; inputs with the prepare step's
// distributions (make_buffers).
// Rows "select dsv32" and "logits kernel alone (dsv32)": DeepSeek-V3.2's plan
// (64 heads, pool 1, top-2048) at 32k and 128k, m = 1, 4, 8 (no CUB baseline).
// Rows "indexer projections (cuBLASLt, 4 GEMMs)"
// with params m, Q, D: indexer_project at glm5next's shapes, weights cold
// (run_projections); beside each, "indexer projections (fused GEMV, one
// launch)": indexer_project_gemv on the same buffers and weight rotation,
// with the cuBLASLt row as its baseline.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/presets.h"
#include "baselines.h"
#include "harness.h"

namespace dsa::bench {
namespace {

constexpr int kBlockSize = 256;

// A uniform in (0, 1] from (index, seed): splitmix64.
__device__ float hashed_uniform(uint64_t index, uint64_t seed) {
  uint64_t z = index * 0x9E3779B97F4A7C15ull + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (static_cast<float>(z >> 40) + 1.0f) * (1.0f / 16777216.0f);
}

// Normal(0, sigma) samples (Box-Muller), as e4m3 codes when `codes`, else as
// FP32 values.
__global__ void fill_normal_kernel(void* data, size_t count, float sigma, uint64_t seed, bool codes) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    const float u1 = hashed_uniform(2 * i, seed), u2 = hashed_uniform(2 * i + 1, seed);
    const float x = sigma * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if (codes) {
      static_cast<uint8_t*>(data)[i] = num::float_to_e4m3(x);
    } else {
      static_cast<float*>(data)[i] = x;
    }
  }
}

Status fill_normal(void* data, size_t count, float sigma, uint64_t seed, bool codes, cudaStream_t stream) {
  fill_normal_kernel<<<1024, 256, 0, stream>>>(data, count, sigma, seed, codes);
  DSA_CUDA_RETURN(cudaGetLastError());
  return Status();
}

// Each page's P pool scales: powers of two 2^-9 .. 2^-7, as the prepare step
// writes (2^ceil(log2(absmax / 448))).
__global__ void fill_page_scales_kernel(uint8_t* cache, int64_t pages, int64_t page_bytes, int64_t pools_per_page,
                                        uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pages * pools_per_page;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t page = i / pools_per_page, pool = i % pools_per_page;
    const int exponent = -9 + static_cast<int>(hashed_uniform(i, seed) * 2.999f);
    reinterpret_cast<float*>(cache + page * page_bytes + pools_per_page * kIndexerDim)[pool] = ldexpf(1.0f, exponent);
  }
}

struct Buffers {
  IndexerPlan plan;
  int m = 0, copies = 1;
  int64_t width = 0, blocks = 0, page_bytes = 0, cache_bytes = 0;
  DeviceMemory k_cache, block_table, ring, workspace, baseline_workspace, positions, requests, topk, slots;
  int64_t baseline_bytes = 0;
};

// m distinct requests at position context - 1, or with `drafts` the m tokens
// of one request at positions context .. context + m - 1 (MTP draft tokens
// after `context` cached tokens, as dsa-decode runs them: the last ones score
// one pool more than a multiple of 8192).
// `shape`: heads, pool, top-k and ring of the plan (default: glm5next's; pool
// 1: DeepSeek-V3.2's, no CUB baseline).
Status make_buffers(const Context& ctx, int m, int64_t context, bool drafts, Buffers* b,
                    const IndexerPlan& shape = IndexerPlan()) {
  b->m = m;
  b->plan.heads = shape.heads;
  b->plan.pool = shape.pool;
  b->plan.topk = shape.topk;
  b->plan.ring = shape.ring;
  b->plan.max_tokens = m;
  b->plan.max_context = drafts ? context + m : context;
  b->plan.block_size = kBlockSize;
  b->width = (b->plan.max_context + kBlockSize - 1) / kBlockSize;
  b->blocks = m * b->width;
  b->page_bytes = indexer_page_bytes(b->plan);
  b->cache_bytes = b->blocks * b->page_bytes;
  b->copies = cold_copies(ctx, size_t(b->cache_bytes));
  // Inputs shaped like the prepare step's outputs, because the select's work
  // depends on how the logits spread over the radix bins (random bytes,
  // used at first, spread them over many exponents and let the select
  // stop after its first digit): K codes and q codes normal with sigma 128
  // (row absmax near 448), pool scales powers of two, signed head weights.
  DSA_RETURN_IF_ERROR(b->k_cache.allocate(size_t(b->cache_bytes) * b->copies));
  DSA_RETURN_IF_ERROR(fill_normal(b->k_cache.get(), size_t(b->cache_bytes) * b->copies, 128.0f, 11, true, ctx.stream));
  fill_page_scales_kernel<<<1024, 256, 0, ctx.stream>>>(b->k_cache.as<uint8_t>(), b->blocks * b->copies,
                                                        b->page_bytes, indexer_pools_per_page(b->plan), 13);
  DSA_CUDA_RETURN(cudaGetLastError());
  std::vector<int32_t> table(size_t(m) * b->width);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937_64(5));
  DSA_RETURN_IF_ERROR(b->block_table.allocate(table.size() * 4));
  DSA_CUDA_RETURN(cudaMemcpy(b->block_table.get(), table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  DSA_RETURN_IF_ERROR(b->ring.allocate(size_t(m) * 2 * b->plan.ring * kIndexerDim * 2));
  const int64_t workspace_bytes = indexer_workspace_layout(b->plan).bytes;
  DSA_RETURN_IF_ERROR(b->workspace.allocate(size_t(workspace_bytes)));
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(b->plan);
  DSA_RETURN_IF_ERROR(fill_normal(b->workspace.as<uint8_t>() + layout.q_fp8, size_t(m) * b->plan.heads * kIndexerDim,
                                  128.0f, 12, true, ctx.stream));
  DSA_RETURN_IF_ERROR(fill_normal(b->workspace.as<uint8_t>() + layout.head_weights, size_t(m) * b->plan.heads,
                                  1.0f / 256, 14, false, ctx.stream));
  if (b->plan.pool > 1) {
    DSA_RETURN_IF_ERROR(indexer_select_baseline_workspace_bytes(b->plan, &b->baseline_bytes));
    DSA_RETURN_IF_ERROR(b->baseline_workspace.allocate(size_t(b->baseline_bytes)));
  }
  std::vector<int64_t> positions(m, context - 1);
  std::vector<int32_t> requests(m, 0);
  if (drafts) {
    std::iota(positions.begin(), positions.end(), context);
  } else {
    std::iota(requests.begin(), requests.end(), 0);
  }
  DSA_RETURN_IF_ERROR(b->positions.allocate(size_t(m) * 8));
  DSA_CUDA_RETURN(cudaMemcpy(b->positions.get(), positions.data(), size_t(m) * 8, cudaMemcpyHostToDevice));
  DSA_RETURN_IF_ERROR(b->requests.allocate(size_t(m) * 4));
  DSA_CUDA_RETURN(cudaMemcpy(b->requests.get(), requests.data(), size_t(m) * 4, cudaMemcpyHostToDevice));
  DSA_RETURN_IF_ERROR(b->topk.allocate(size_t(m) * indexer_row_width(b->plan) * 4));
  DSA_RETURN_IF_ERROR(b->slots.allocate(size_t(m) * indexer_row_width(b->plan) * 4));
  DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
  return Status();
}

IndexerSelectArgs select_args(const Buffers& b, int i) {
  IndexerSelectArgs a;
  a.plan = b.plan;
  a.positions = make_tensor(b.positions.get(), DType::kI64, {b.m});
  a.token_requests = make_tensor(b.requests.get(), DType::kI32, {b.m});
  a.state.block_table = make_tensor(b.block_table.get(), DType::kI32, {b.m, b.width});
  a.state.ring = make_tensor(b.ring.get(), DType::kBF16, {b.m, 2, b.plan.ring, kIndexerDim});
  a.state.k_cache = make_tensor(b.k_cache.as<uint8_t>() + size_t(b.cache_bytes) * (i % b.copies), DType::kU8,
                                {b.blocks, b.page_bytes});
  a.workspace = make_tensor(b.workspace.get(), DType::kU8, {indexer_workspace_layout(b.plan).bytes});
  a.topk_positions = make_tensor(b.topk.get(), DType::kI32, {b.m, indexer_row_width(b.plan)});
  a.slots = make_tensor(b.slots.get(), DType::kI32, {b.m, indexer_row_width(b.plan)});
  return a;
}

// The projections' buffers for m tokens: the four weights in `copies` copies
// each (every launch reads another copy, so the weights come from device
// memory as in a decode step), q_c, x and the outputs one buffer each (in a
// step q_c and x come hot from the kernels before).
struct ProjectBuffers {
  int64_t m = 0, q = 0, d = 0;  // tokens, Q (q_lora_rank), D (hidden)
  int copies = 1;
  DeviceMemory wq_b, wk, weights_proj, compress_gate, q_c, x, index_q, index_k, head_weights, gate;

  int64_t wq_b_elements() const { return int64_t(kIndexerHeads) * kIndexerDim * q; }
  int64_t wk_elements() const { return int64_t(kIndexerDim) * d; }
  int64_t weights_proj_elements() const { return int64_t(kIndexerHeads) * d; }
  int64_t compress_gate_elements() const { return int64_t(kIndexerDim) * d; }
  int64_t weight_bytes() const {
    return 2 * (wq_b_elements() + wk_elements() + weights_proj_elements() + compress_gate_elements());
  }
};

Status make_project_buffers(const Context& ctx, const ModelPreset& preset, int m, ProjectBuffers* b) {
  b->m = m;
  b->q = preset.q_lora;
  b->d = preset.hidden;
  b->copies = cold_copies(ctx, size_t(b->weight_bytes()));
  // nn.Linear's initialization scale (1 / sqrt(in)); BF16 copies are 16-byte
  // aligned as long as Q and D are multiples of 8, which the API requires.
  const struct {
    DeviceMemory* memory;
    int64_t elements, in;
  } weights[] = {{&b->wq_b, b->wq_b_elements(), b->q},
                 {&b->wk, b->wk_elements(), b->d},
                 {&b->weights_proj, b->weights_proj_elements(), b->d},
                 {&b->compress_gate, b->compress_gate_elements(), b->d}};
  uint64_t seed = 21;
  for (const auto& w : weights) {
    const size_t count = size_t(w.elements) * b->copies;
    DSA_RETURN_IF_ERROR(w.memory->allocate(count * 2));
    DSA_RETURN_IF_ERROR(fill_random_bf16(w.memory->get(), count, seed++, 1.0f / std::sqrt(float(w.in)), ctx.stream));
  }
  DSA_RETURN_IF_ERROR(b->q_c.allocate(size_t(m * b->q) * 2));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->q_c.get(), size_t(m * b->q), seed++, 1.0f, ctx.stream));
  DSA_RETURN_IF_ERROR(b->x.allocate(size_t(m * b->d) * 2));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->x.get(), size_t(m * b->d), seed++, 1.0f, ctx.stream));
  DSA_RETURN_IF_ERROR(b->index_q.allocate(size_t(m) * kIndexerHeads * kIndexerDim * 2));
  DSA_RETURN_IF_ERROR(b->index_k.allocate(size_t(m) * kIndexerDim * 2));
  DSA_RETURN_IF_ERROR(b->head_weights.allocate(size_t(m) * kIndexerHeads * 4));
  DSA_RETURN_IF_ERROR(b->gate.allocate(size_t(m) * kIndexerDim * 2));
  DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
  return Status();
}

// Launch i reads weight copy i % copies.
IndexerProjectArgs project_args(const ProjectBuffers& b, int i) {
  const size_t c = size_t(i % b.copies);
  IndexerProjectArgs a;
  a.plan.max_tokens = int(b.m);
  a.q_c = make_tensor(b.q_c.get(), DType::kBF16, {b.m, b.q});
  a.x = make_tensor(b.x.get(), DType::kBF16, {b.m, b.d});
  a.wq_b = make_tensor(b.wq_b.as<uint16_t>() + c * b.wq_b_elements(), DType::kBF16,
                       {int64_t(kIndexerHeads) * kIndexerDim, b.q});
  a.wk = make_tensor(b.wk.as<uint16_t>() + c * b.wk_elements(), DType::kBF16, {kIndexerDim, b.d});
  a.weights_proj =
      make_tensor(b.weights_proj.as<uint16_t>() + c * b.weights_proj_elements(), DType::kBF16, {kIndexerHeads, b.d});
  a.compress_gate =
      make_tensor(b.compress_gate.as<uint16_t>() + c * b.compress_gate_elements(), DType::kBF16, {kIndexerDim, b.d});
  a.index_q = make_tensor(b.index_q.get(), DType::kBF16, {b.m, kIndexerHeads, kIndexerDim});
  a.index_k = make_tensor(b.index_k.get(), DType::kBF16, {b.m, kIndexerDim});
  a.head_weights = make_tensor(b.head_weights.get(), DType::kF32, {b.m, kIndexerHeads});
  a.gate = make_tensor(b.gate.get(), DType::kBF16, {b.m, kIndexerDim});
  return a;
}

// indexer_project at glm5next's Q and D, m = 1..16, one context for every m
// (as dsa-decode keeps one), and indexer_project_gemv on the same buffers.
// Floor: the four weights read once, q_c and x read, the four outputs written.
Status run_projections(Context& ctx, Report& report) {
  ModelPreset preset;
  DSA_RETURN_IF_ERROR(find_preset("glm5next", &preset));
  IndexerProjectContext context;
  DSA_RETURN_IF_ERROR(IndexerProjectContext::create(&context));
  for (int m : {1, 2, 4, 8, 16}) {
    ProjectBuffers b;
    DSA_RETURN_IF_ERROR(make_project_buffers(ctx, preset, m, &b));
    // The shape's first call builds its descriptors and asks cuBLASLt's
    // heuristic (host work the header keeps out of captures): made here,
    // uncaptured, so that no capture depends on time_graph's eager pass.
    // The plan is keyed by shape, not pointers: the weight copies share it.
    DSA_RETURN_IF_ERROR(indexer_project(project_args(b, 0), context, ctx.stream));
    DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
    const int per_graph = std::max(20, b.copies);
    double us = 0;
    DSA_RETURN_IF_ERROR(time_graph(
        ctx, [&](cudaStream_t stream, int i) { return indexer_project(project_args(b, i), context, stream); }, &us,
        per_graph));
    const double activation_bytes = 2.0 * m * (b.q + b.d);
    const double output_bytes =
        m * (kIndexerHeads * kIndexerDim * 2.0 + kIndexerDim * 2.0 + kIndexerHeads * 4.0 + kIndexerDim * 2.0);
    const std::string cublas_name = "indexer projections (cuBLASLt, 4 GEMMs)";
    Row row{cublas_name, {{"m", m}, {"Q", double(b.q)}, {"D", double(b.d)}}, us};
    row.floor_us = floor_us(ctx, double(b.weight_bytes()) + activation_bytes + output_bytes);
    row.note =
        "index_q, index_k, head_weights, gate: 4 cublasLtMatmul, the heuristic's first algorithm per shape; "
        "weights cold (" +
        std::to_string(b.copies) + " copies rotated), q_c and x one buffer";
    report.add(row);
    // time_graph's eager pass makes the GEMV's first call (its shared-memory limit) outside the capture.
    double gemv_us = 0;
    DSA_RETURN_IF_ERROR(time_graph(
        ctx, [&](cudaStream_t stream, int i) { return indexer_project_gemv(project_args(b, i), stream); }, &gemv_us,
        per_graph));
    Row gemv_row{"indexer projections (fused GEMV, one launch)", row.params, gemv_us, cublas_name, us, row.floor_us};
    gemv_row.note =
        "indexer_project_gemv: CUDA-core FP32 GEMV, a warp per 4 wq_b rows or 1 x row, one CTA per SM, weights by "
        "cp.async before the PDL wait, fixed order (bitwise reference); same buffers and weight rotation";
    report.add(gemv_row);
  }
  return Status();
}

// One timed configuration of the select step: `launch(args, stream)` runs
// rotation i's arguments.
template <class Launch>
Status time_select(const Context& ctx, const Buffers& b, Launch&& launch, double* us) {
  return time_graph(
      ctx, [&](cudaStream_t stream, int i) { return launch(select_args(b, i), stream); }, us, std::max(20, b.copies));
}

// `launch` with the plan's opt-in exact FP64 logits.
template <class Launch>
auto with_exact_logits(Launch launch) {
  return [launch](IndexerSelectArgs args, cudaStream_t stream) {
    args.plan.logits = IndexerLogits::kExact;
    return launch(args, stream);
  };
}

Status run(Context& ctx, Report& report) {
  for (int64_t context : {32768, 131072}) {
    for (int m : {1, 2, 4, 8, 16}) {
      Buffers b;
      DSA_RETURN_IF_ERROR(make_buffers(ctx, m, context, false, &b));
      double select_us = 0, baseline_us = 0, exact_us = 0, logits_us = 0;
      DSA_RETURN_IF_ERROR(time_select(ctx, b, indexer_select, &select_us));
      DSA_RETURN_IF_ERROR(time_select(
          ctx, b,
          [&](const IndexerSelectArgs& args, cudaStream_t stream) {
            return indexer_select_baseline(args, b.baseline_workspace.get(), b.baseline_bytes, stream);
          },
          &baseline_us));
      DSA_RETURN_IF_ERROR(time_select(ctx, b, with_exact_logits(indexer_select), &exact_us));
      DSA_RETURN_IF_ERROR(time_select(ctx, b, indexer_select_logits_only, &logits_us));
      // Floor: each token (its own request) reads its K cache (132 B per pool),
      // q_fp8 and weights, and writes two rows.
      const double pools = double(context / kIndexerPoolSize);
      const double bytes = m * (pools * kIndexerPoolBytes + kIndexerHeads * kIndexerDim + kIndexerHeads * 4.0 +
                                2.0 * kIndexerRowWidth * 4);
      const std::vector<std::pair<std::string, double>> params = {{"m", m}, {"context", double(context)}};
      Row row{"select", params, select_us, "logits + CUB segmented radix sort + expand + remap", baseline_us,
              floor_us(ctx, bytes)};
      row.note = "default: FP32-accumulated logits (FP16 tensor cores), radix top-512, fused expand and remap";
      report.add(row);
      Row exact{"select (exact logits)", params, exact_us, "select", select_us, row.floor_us};
      exact.note = "opt-in IndexerLogits::kExact: FP64 tensor cores";
      report.add(exact);
      Row logits_row{"logits kernel alone", params, logits_us};
      logits_row.note = "step 6 of the default select only";
      report.add(logits_row);
    }
    // MTP: one request's token and its draft tokens (dsa-decode's case).
    for (int m : {2, 4}) {
      Buffers b;
      DSA_RETURN_IF_ERROR(make_buffers(ctx, m, context, true, &b));
      double fused_us = 0, logits_us = 0;
      DSA_RETURN_IF_ERROR(time_select(ctx, b, indexer_select, &fused_us));
      DSA_RETURN_IF_ERROR(time_select(ctx, b, indexer_select_logits_only, &logits_us));
      Row row{"select (m tokens of one request: drafts)", {{"m", m}, {"context", double(context)}}, fused_us};
      row.note = "positions context .. context + m - 1 of request 0";
      report.add(row);
      Row logits_row{"logits kernel alone (drafts)", {{"m", m}, {"context", double(context)}}, logits_us};
      report.add(logits_row);
    }
  }
  // DeepSeek-V3.2's indexer (pool 1: a key per token, 64 heads, top-2048 tokens).
  IndexerPlan dsv32;
  dsv32.heads = 64;
  dsv32.pool = 1;
  dsv32.ring = 1;
  dsv32.topk = 2048;
  for (int64_t context : {32768, 131072}) {
    for (int m : {1, 4, 8}) {
      Buffers b;
      DSA_RETURN_IF_ERROR(make_buffers(ctx, m, context, false, &b, dsv32));
      double select_us = 0, logits_us = 0;
      DSA_RETURN_IF_ERROR(time_select(ctx, b, indexer_select, &select_us));
      DSA_RETURN_IF_ERROR(time_select(ctx, b, indexer_select_logits_only, &logits_us));
      const double bytes = m * (double(context) * kIndexerPoolBytes + 64.0 * kIndexerDim + 64.0 * 4 +
                                2.0 * indexer_row_width(b.plan) * 4);
      const std::vector<std::pair<std::string, double>> params = {{"m", m}, {"context", double(context)}};
      Row row{"select dsv32", params, select_us};
      row.floor_us = floor_us(ctx, bytes);
      row.note = "DeepSeek-V3.2: 64 heads, a key per token (pool 1), top-2048 tokens; FP32-accumulated logits";
      report.add(row);
      Row logits_row{"logits kernel alone (dsv32)", params, logits_us};
      report.add(logits_row);
    }
  }
  return run_projections(ctx, report);
}

}  // namespace
DSA_BENCH("indexer", run);
}  // namespace dsa::bench
