// sparse_mla_v32 at DeepSeek-V3.2's shapes (dsa-bench --bench sparse_mla_v32):
// H = 128 (TP1) and 16 (TP8), m in {1, 2, 4, 8, 16, 64, 128}, K = 2048,
// graph replay, rows "sparse_mla_v32" with the byte floor and TFLOPS; and one
// row of the cache write ("sparse_mla_v32 cache_write", m tokens).
//
// Cold cache entries: the cache holds `rotations` disjoint regions of m * K
// slots and launch i reads region i % rotations through its own index rows (a
// random permutation of the region: every token's K entries distinct, the
// floor's worst case); the regions together are at least twice the L2. q and
// the indices stay in L2 (in the decode chain the launches just before write
// them). The cache is filled by the cache-write kernel from random BF16 rows.
// The comparison with FlashMLA's sparse FP8 decode on the same inputs belongs
// to the peers benchmark (bench/peers).
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/sparse_mla_v32.h"
#include "harness.h"
#include "sparse_mla_v32/sparse_mla_v32_plan.h"

namespace dsa::bench {
namespace {

constexpr int kLatent = kSparseMlaV32Latent;
constexpr int kDim = kSparseMlaV32HeadDim;
constexpr int kEntry = kSparseMlaV32EntryBytes;
constexpr int kTopK = 2048;
constexpr int kBlockSize = 64;  // vLLM's fp8_ds_mla block size
constexpr size_t kMinCacheSlots = 65536;
constexpr float kSoftmaxScale = 0.13523f;  // dsv32

struct Problem {
  int heads, m;
};

// q + indices + the distinct entries (656 bytes each, m K of them when no two
// tokens share one) + latent + lse. Each 16-head group reads its entries again
// (from L2): that traffic is not in the floor.
double floor_bytes(const Problem& p) {
  return double(p.m) * p.heads * kDim * 2 + double(p.m) * kTopK * 4 + double(p.m) * kTopK * kEntry +
         double(p.m) * p.heads * kLatent * 2 + double(p.m) * p.heads * 4;
}

// Q.K^T over 576 dims and P.V over 512 per selected entry and head.
double flops(const Problem& p) { return 2.0 * p.m * p.heads * kTopK * (kDim + kLatent); }

struct Buffers {
  DeviceMemory q, cache, indices, latent, lse, kv_c, k_pe, slots;
  int rotations = 1;
  int64_t blocks = 0;
  size_t rows = 0;  // m K, per rotation
};

Status make_buffers(const Context& ctx, const Problem& p, Buffers* b) {
  b->rows = size_t(p.m) * kTopK;
  b->rotations = std::max(1, static_cast<int>((2 * ctx.l2_bytes + b->rows * kEntry - 1) / (b->rows * kEntry)));
  const size_t slots = std::max(kMinCacheSlots, b->rows * b->rotations);
  b->blocks = static_cast<int64_t>((slots + kBlockSize - 1) / kBlockSize);
  const size_t capacity = size_t(b->blocks) * kBlockSize;
  DSA_RETURN_IF_ERROR(b->cache.allocate(capacity * kEntry));
  // Fill the cache with the cache-write kernel, 65535 tokens a launch.
  constexpr size_t kWriteTokens = kSparseMlaV32MaxTokens;
  DSA_RETURN_IF_ERROR(b->kv_c.allocate(kWriteTokens * kLatent * 2));
  DSA_RETURN_IF_ERROR(b->k_pe.allocate(kWriteTokens * kSparseMlaV32Rope * 2));
  DSA_RETURN_IF_ERROR(b->slots.allocate(kWriteTokens * 8));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->kv_c.get(), kWriteTokens * kLatent, 11, 2.0f, ctx.stream));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->k_pe.get(), kWriteTokens * kSparseMlaV32Rope, 12, 1.0f, ctx.stream));
  for (size_t first = 0; first < capacity; first += kWriteTokens) {
    const size_t count = std::min(kWriteTokens, capacity - first);
    std::vector<int64_t> slot_mapping(count);
    std::iota(slot_mapping.begin(), slot_mapping.end(), int64_t(first));
    DSA_CUDA_RETURN(cudaMemcpy(b->slots.get(), slot_mapping.data(), count * 8, cudaMemcpyHostToDevice));
    SparseMlaV32CacheWriteArgs w;
    w.kv_c = make_tensor(b->kv_c.get(), DType::kBF16, {int64_t(count), kLatent});
    w.k_pe = make_tensor(b->k_pe.get(), DType::kBF16, {int64_t(count), kSparseMlaV32Rope});
    w.slot_mapping = make_tensor(b->slots.get(), DType::kI64, {int64_t(count)});
    w.kv_cache = make_tensor(b->cache.get(), DType::kU8, {b->blocks, kBlockSize, kEntry});
    DSA_RETURN_IF_ERROR(sparse_mla_v32_cache_write(w, ctx.stream));
    DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
  }
  const size_t q_values = size_t(p.m) * p.heads * kDim;
  DSA_RETURN_IF_ERROR(b->q.allocate(q_values * 2));
  // q ~ U(-0.05, 0.05): scores of a few units with keys of a few units.
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->q.get(), q_values, 13, 0.05f, ctx.stream));
  std::vector<int32_t> indices(b->rows * b->rotations);
  std::mt19937_64 rng(3);
  for (int r = 0; r < b->rotations; ++r) {
    int32_t* region = indices.data() + size_t(r) * b->rows;
    std::iota(region, region + b->rows, static_cast<int32_t>(size_t(r) * b->rows));
    std::shuffle(region, region + b->rows, rng);
  }
  DSA_RETURN_IF_ERROR(b->indices.allocate(indices.size() * 4));
  DSA_CUDA_RETURN(cudaMemcpy(b->indices.get(), indices.data(), indices.size() * 4, cudaMemcpyHostToDevice));
  DSA_RETURN_IF_ERROR(b->latent.allocate(size_t(p.m) * p.heads * kLatent * 2));
  DSA_RETURN_IF_ERROR(b->lse.allocate(size_t(p.m) * p.heads * 4));
  DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
  return Status();
}

SparseMlaV32Args views(const Problem& p, const Buffers& b, int i) {
  SparseMlaV32Args a;
  a.q = make_tensor(b.q.get(), DType::kBF16, {p.m, p.heads, kDim});
  a.kv_cache = make_tensor(b.cache.get(), DType::kU8, {b.blocks, kBlockSize, kEntry});
  a.indices = make_tensor(b.indices.as<int32_t>() + b.rows * (i % b.rotations), DType::kI32, {p.m, kTopK});
  a.softmax_scale = kSoftmaxScale;
  a.latent = make_tensor(b.latent.get(), DType::kBF16, {p.m, p.heads, kLatent});
  a.lse = make_tensor(b.lse.get(), DType::kF32, {p.m, p.heads});
  return a;
}

Status run(Context& ctx, Report& report) {
  for (const int heads : {128, 16}) {
    for (const int m : {1, 2, 4, 8, 16, 64, 128}) {
      const Problem p{heads, m};
      Buffers b;
      DSA_RETURN_IF_ERROR(make_buffers(ctx, p, &b));
      double us = 0;
      DSA_RETURN_IF_ERROR(time_graph(
          ctx, [&](cudaStream_t stream, int i) { return sparse_mla_v32(views(p, b, i), stream); }, &us,
          std::max(20, b.rotations)));
      const SparseMlaV32Plan plan = sparse_mla_v32_plan(m, heads, kTopK, ctx.sm_count, kSparseMlaV32MaxSplits);
      Row row{"sparse_mla_v32", {{"H", heads}, {"m", m}, {"K", kTopK}}, us, "", 0, floor_us(ctx, floor_bytes(p))};
      row.tflops = flops(p) / (us * 1e-6) / 1e12;
      row.note = std::to_string(plan.head_groups) + " groups x " + std::to_string(plan.splits) + " splits of " +
                 std::to_string(plan.rows_per_split) + " rows; " + std::to_string(b.rotations) + " KV regions";
      report.add(row);
    }
  }
  // The cache write of m tokens (kv_c, k_pe and slot_mapping in L2, entries written once).
  for (const int m : {1, 4, 16}) {
    Buffers b;
    DSA_RETURN_IF_ERROR(make_buffers(ctx, {16, 1}, &b));
    std::vector<int64_t> slot_mapping(m);
    std::iota(slot_mapping.begin(), slot_mapping.end(), int64_t(0));
    DSA_CUDA_RETURN(cudaMemcpy(b.slots.get(), slot_mapping.data(), m * 8, cudaMemcpyHostToDevice));
    SparseMlaV32CacheWriteArgs w;
    w.kv_c = make_tensor(b.kv_c.get(), DType::kBF16, {m, kLatent});
    w.k_pe = make_tensor(b.k_pe.get(), DType::kBF16, {m, kSparseMlaV32Rope});
    w.slot_mapping = make_tensor(b.slots.get(), DType::kI64, {m});
    w.kv_cache = make_tensor(b.cache.get(), DType::kU8, {b.blocks, kBlockSize, kEntry});
    double us = 0;
    DSA_RETURN_IF_ERROR(time_graph(ctx, [&](cudaStream_t stream, int) { return sparse_mla_v32_cache_write(w, stream); },
                                   &us));
    const double bytes = double(m) * (kLatent * 2 + kSparseMlaV32Rope * 2 + 8 + kEntry);
    report.add(Row{"sparse_mla_v32 cache_write", {{"m", m}}, us, "", 0, floor_us(ctx, bytes)});
  }
  return Status();
}

DSA_BENCH("sparse_mla_v32", run);

}  // namespace
}  // namespace dsa::bench
