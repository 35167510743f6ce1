// Sparse MLA decode attention at the issue's latency shapes (H in {8, 64},
// m in {1, 2, 4, 8, 16}, K = 2048) and throughput shapes (m = 128, H in
// {64, 128}), graph replay. Rows "sparse_mla_simple": the simple FP32
// kernel, the baseline; "sparse_mla": the default plan (SparseMlaPlan::kAuto);
// "sparse_mla (batch-invariant)": the opt-in plan; all against the baseline
// timed in the same run.
//
// Cold KV rows: the cache holds `rotations` disjoint regions of m * K slots and
// launch i reads region i % rotations through its own index rows (a random
// permutation of the region, so every token's K rows are distinct: the floor's
// worst case). The regions together are at least twice the L2, so every launch
// reads its KV rows from device memory, as in a model where the other layers'
// caches pass through L2 between two calls of one layer. q and the indices stay
// in L2: in the decode chain they are written by the launches just before
// (absorb, indexer).
//
// Draft pairs (rows "..., draft pairs"): with speculative decoding the
// tokens of a request attend to nearly the same entries (m = 128 is 64
// requests x 2 draft tokens), which the distinct rows above never model:
// tokens 2j and 2j + 1 share kPairShared of their K rows (the second's
// order shuffled), so a row one token brings into L2 may serve its sibling.
// The rotations count the distinct rows, so every launch still reads its
// rows from device memory once.
#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/sparse_mla.h"
#include "baselines.h"
#include "harness.h"
#include "sparse_mla/sparse_mla_plan.h"

namespace dsa::bench {
namespace {

constexpr int kLatent = kSparseMlaLatent;
constexpr int kTopK = 2048;
constexpr int kBlockSize = 256;  // served glm5next cache blocks
constexpr int kMinCacheSlots = 65536;
constexpr float kSoftmaxScale = 0.0625f;  // glm5next: 256^-0.5
constexpr double kPairShared = 0.9;       // draft pairs: the share of a token's rows its sibling reads too

struct Problem {
  int heads, m;
};

// A 64-head plan, with how many (token, group) items the GPU runs at once.
std::string describe(const SparseMlaWgmmaSplits& plan) {
  int resident = 0;
  const Status s = sparse_mla_wgmma_resident_ctas(&resident);
  return "splits " + std::to_string(plan.splits) + " (" + std::to_string(plan.clusters) + " clusters of " +
         std::to_string(plan.cluster_size) + ", " + (s.ok() ? std::to_string(resident / plan.splits) : "?") +
         " items at once, at most " + std::to_string(plan.max_chunks) + " chunks each)";
}

// Bytes one launch must move at least: q, the index rows, the distinct cache
// rows the step selects (m K when no two tokens share one: the worst case),
// the latent and the lse.
double floor_bytes(const Problem& p, double distinct_rows) {
  const double rows = double(p.m) * kTopK;
  return double(p.m) * p.heads * kLatent                                     // q, FP8
         + rows * 4                                                          // indices
         + distinct_rows * kLatent                                           // KV rows, FP8
         + double(p.m) * p.heads * kLatent * 2 + double(p.m) * p.heads * 4;  // latent BF16, lse
}

// Q.K^T and P.V over the K selected rows, as the issue counts them.
double flops(const Problem& p) { return 2.0 * p.m * p.heads * kTopK * (kLatent + kLatent); }

struct Buffers {
  DeviceMemory q, cache, indices, scales, latent, lse, counters, partials;
  int rotations = 1;
  int64_t blocks = 0;
  size_t indices_per_rotation = 0;
  size_t distinct_rows = 0;  // per launch
};

// draft_pairs: tokens 2j and 2j + 1 share kPairShared of their rows (m even).
Status make_buffers(const Context& ctx, const Problem& p, Buffers* b, bool draft_pairs = false) {
  const size_t rows = size_t(p.m) * kTopK;
  const size_t shared_rows = draft_pairs ? static_cast<size_t>(kPairShared * kTopK) : 0;  // per pair
  const size_t distinct_rows = rows - size_t(p.m / 2) * shared_rows;
  b->distinct_rows = distinct_rows;
  // Not cold_copies: its cap of 64 is for inputs copied whole; here only the
  // small index rows are per rotation, and m = 1 needs ~120 regions of 1 MB.
  b->rotations =
      std::max(1, static_cast<int>((2 * ctx.l2_bytes + distinct_rows * kLatent - 1) / (distinct_rows * kLatent)));
  const size_t slots = std::max<size_t>(kMinCacheSlots, rows * b->rotations);
  b->blocks = static_cast<int64_t>((slots + kBlockSize - 1) / kBlockSize);
  const size_t cache_bytes = size_t(b->blocks) * kBlockSize * kLatent;
  DSA_RETURN_IF_ERROR(b->cache.allocate(cache_bytes));
  DSA_RETURN_IF_ERROR(fill_random_e4m3(b->cache.get(), cache_bytes, 1, ctx.stream));
  const size_t q_bytes = size_t(p.m) * p.heads * kLatent;
  DSA_RETURN_IF_ERROR(b->q.allocate(q_bytes));
  DSA_RETURN_IF_ERROR(fill_random_e4m3(b->q.get(), q_bytes, 2, ctx.stream));

  // Region r = slots [r * rows, (r + 1) * rows), permuted: token t of rotation r
  // reads slots perm_r[t * K .. (t + 1) * K). Draft pairs: then token 2j + 1
  // reads the first shared_rows of token 2j's slots instead of its own first
  // ones, in another order.
  b->indices_per_rotation = rows;
  std::vector<int32_t> indices(rows * b->rotations);
  std::mt19937_64 rng(3);
  for (int r = 0; r < b->rotations; ++r) {
    int32_t* region = indices.data() + size_t(r) * rows;
    std::iota(region, region + rows, static_cast<int32_t>(size_t(r) * rows));
    std::shuffle(region, region + rows, rng);
    for (int j = 0; draft_pairs && 2 * j + 1 < p.m; ++j) {
      int32_t* first = region + size_t(2 * j) * kTopK;
      int32_t* second = first + kTopK;
      std::copy(first, first + shared_rows, second);
      std::shuffle(second, second + kTopK, rng);
    }
  }
  DSA_RETURN_IF_ERROR(b->indices.allocate(indices.size() * sizeof(int32_t)));
  DSA_CUDA_RETURN(cudaMemcpy(b->indices.get(), indices.data(), indices.size() * sizeof(int32_t),
                             cudaMemcpyHostToDevice));
  const float scales[2] = {0.02f, 0.02f};  // q_scale, k_scale
  DSA_RETURN_IF_ERROR(b->scales.allocate(sizeof(scales)));
  DSA_CUDA_RETURN(cudaMemcpy(b->scales.get(), scales, sizeof(scales), cudaMemcpyHostToDevice));
  DSA_RETURN_IF_ERROR(b->latent.allocate(size_t(p.m) * p.heads * kLatent * 2));
  DSA_RETURN_IF_ERROR(b->lse.allocate(size_t(p.m) * p.heads * 4));
  const int64_t counters = sparse_mla_split_counter_count(p.m, p.heads, kTopK);
  DSA_RETURN_IF_ERROR(b->counters.allocate(size_t(counters) * 4));
  DSA_CUDA_RETURN(cudaMemsetAsync(b->counters.get(), 0, size_t(counters) * 4, ctx.stream));
  const int64_t partials = sparse_mla_split_partials_count(p.m, p.heads, kTopK);
  DSA_RETURN_IF_ERROR(b->partials.allocate(size_t(std::max<int64_t>(partials, 1)) * 4));
  DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
  return Status();
}

// The views of rotation i.
SparseMlaArgs views(const Problem& p, const Buffers& b, int i) {
  SparseMlaArgs a;
  a.q = make_tensor(b.q.get(), DType::kFP8E4M3, {p.m, p.heads, kLatent});
  a.q_scale = make_tensor(b.scales.as<float>(), DType::kF32, {1});
  a.kv_cache = make_tensor(b.cache.get(), DType::kFP8E4M3, {b.blocks, kBlockSize, kLatent});
  a.k_scale = make_tensor(b.scales.as<float>() + 1, DType::kF32, {1});
  a.indices = make_tensor(b.indices.as<int32_t>() + b.indices_per_rotation * (i % b.rotations), DType::kI32,
                          {p.m, kTopK});
  a.softmax_scale = kSoftmaxScale;
  a.latent = make_tensor(b.latent.get(), DType::kBF16, {p.m, p.heads, kLatent});
  a.lse = make_tensor(b.lse.get(), DType::kF32, {p.m, p.heads});
  a.split_counters = make_tensor(b.counters.get(), DType::kI32, {sparse_mla_split_counter_count(p.m, p.heads, kTopK)});
  a.split_partials = make_tensor(b.partials.get(), DType::kF32, {int64_t(b.partials.bytes() / 4)});
  return a;
}

// sparse_mla with the given plan, as engines choose it.
auto sparse_mla_with(SparseMlaPlan plan) {
  return [plan](SparseMlaArgs a, cudaStream_t stream) {
    a.plan = plan;
    return sparse_mla(a, stream);
  };
}

// One timed configuration: `launch` runs rotation i on the stream.
template <class Launch>
Status time_rows(Context& ctx, const Problem& p, const Buffers& b, Launch&& launch, double* us) {
  return time_graph(
      ctx, [&](cudaStream_t stream, int i) { return launch(views(p, b, i), stream); }, us, std::max(20, b.rotations));
}

Status run(Context& ctx, Report& report) {
  // Latency shapes (H in {8, 64}, m <= 16), throughput shapes (m = 128: 64
  // requests x 2 draft tokens, H in {64, 128}) and, between them, m = 32 and
  // 64 at H = 64, where the launch changes shape.
  const Problem problems[] = {{8, 1},  {8, 2},  {8, 4},   {8, 8},   {8, 16},  {64, 1},   {64, 2},
                              {64, 4}, {64, 8}, {64, 16}, {64, 32}, {64, 64}, {64, 128}, {128, 128}};
  for (const Problem& p : problems) {
    Buffers b;
    DSA_RETURN_IF_ERROR(make_buffers(ctx, p, &b));
    const std::vector<std::pair<std::string, double>> params = {{"H", p.heads}, {"m", p.m}, {"K", kTopK}};
    const double floor = floor_us(ctx, floor_bytes(p, double(b.distinct_rows)));
    const std::string regions = std::to_string(b.rotations) + " KV regions of " + std::to_string(p.m * kTopK) + " rows";
    double simple_us = 0;
    DSA_RETURN_IF_ERROR(time_rows(ctx, p, b, sparse_mla_simple, &simple_us));
    Row simple{"sparse_mla_simple", params, simple_us, "", 0, floor};
    simple.tflops = flops(p) / (simple_us * 1e-6) / 1e12;
    simple.note = regions;
    report.add(simple);

    const bool wgmma = p.heads % 64 == 0;
    // Times `launch` over `rows` (rotation i through its own index rows) and
    // reports it against the simple kernel of this shape.
    auto add_row = [&](const std::string& name, auto&& launch, const std::string& note, const Buffers& rows,
                       double row_floor) -> Status {
      double us = 0;
      DSA_RETURN_IF_ERROR(time_rows(ctx, p, rows, launch, &us));
      Row row{name, params, us, "sparse_mla_simple", simple_us, row_floor};
      row.tflops = flops(p) / (us * 1e-6) / 1e12;
      row.note = note;
      report.add(row);
      return Status();
    };
    std::string note = "SparseMlaPlan::kAuto; " + regions;
    if (wgmma) {
      const int64_t items = int64_t(p.m) * (p.heads / 64);
      int resident = 0, producer_resident = 0;
      DSA_RETURN_IF_ERROR(sparse_mla_wgmma_resident_ctas(&resident));
      DSA_RETURN_IF_ERROR(sparse_mla_producer_resident_ctas(&producer_resident));
      const int max_splits = sparse_mla_wgmma_batch_max_splits(kTopK, items, resident);
      note += sparse_mla_batch_takes_producer(kTopK, items, max_splits, resident, producer_resident)
                  ? "; here the whole-row kernel"
                  : "; here " + describe(sparse_mla_wgmma_splits(kTopK, max_splits));
    }
    DSA_RETURN_IF_ERROR(add_row("sparse_mla", sparse_mla_with(SparseMlaPlan::kAuto), note, b, floor));
    DSA_RETURN_IF_ERROR(add_row("sparse_mla (batch-invariant)", sparse_mla_with(SparseMlaPlan::kBatchInvariant),
                                "SparseMlaPlan::kBatchInvariant: split points from H and K only; " + regions, b,
                                floor));
    if (wgmma && (p.m == 16 || p.m == 128)) {  // the served batches with their draft tokens' shared rows
      Buffers pairs;
      DSA_RETURN_IF_ERROR(make_buffers(ctx, p, &pairs, /*draft_pairs=*/true));
      const double pair_floor = floor_us(ctx, floor_bytes(p, double(pairs.distinct_rows)));
      const std::string pair_regions =
          std::to_string(pairs.rotations) + " KV regions of " + std::to_string(pairs.distinct_rows) +
          " distinct rows, tokens 2j and 2j + 1 sharing " + std::to_string(static_cast<int>(kPairShared * 100)) +
          "% of theirs (baseline: the simple kernel on distinct rows)";
      DSA_RETURN_IF_ERROR(add_row("sparse_mla (draft pairs)", sparse_mla_with(SparseMlaPlan::kAuto),
                                  "as sparse_mla; " + pair_regions, pairs, pair_floor));
    }
  }
  return Status();
}

}  // namespace
DSA_BENCH("sparse_mla", run);
}  // namespace dsa::bench
