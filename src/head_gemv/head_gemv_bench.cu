// head_gemv against the stock sequence at the glm5next shapes (H200: cold L2,
// graph replay, ratios from one run):
//   absorb:   q [m, H, 256] x W_UK_T [H, 256, 512] -> FP8, + the latent's cache write;
//             stock = cuBLAS bmm + static FP8 quant + concat_and_cache_mla (3 launches)
//   value_up: latent [m, H, 512] x W_UV [H, 512, 256] -> BF16; stock = cuBLAS bmm
// Rows "absorb" / "value_up" are the default path (tensor-core sums); rows
// "* (seed order)" the opt-in seed order with the tactic table's tactic.
#include <string>
#include <vector>

#include "cublas_bmm.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/head_gemv.h"
#include "dsa_decode/stock.h"
#include "harness.h"
#include "head_gemv/head_gemv_kernels.h"

namespace dsa::bench {
namespace {

constexpr int kLatent = 512;      // L
constexpr int kBlockSize = 256;   // served glm5next cache blocks
constexpr int kCacheBlocks = 64;

struct Problem {
  int heads, rows, cols, m;
  bool absorb;  // FP8 out + cache write
};

double floor_bytes(const Problem& p) {
  double bytes = 2.0 * p.heads * p.rows * p.cols  // weights
                 + 2.0 * p.m * p.heads * p.rows   // x
                 + (p.absorb ? 1.0 : 2.0) * p.m * p.heads * p.cols;
  if (p.absorb) bytes += 2.0 * p.m * kLatent + 1.0 * p.m * kLatent;  // kv read, cache write
  return bytes;
}

// Device buffers of one problem; weights in `copies` rotated copies (cold L2).
struct Buffers {
  DeviceMemory weights, x, out, out_bf16, scale, kv, cache, slots;
  int copies = 1;
  size_t weight_elems = 0;
};

Status make_buffers(const Context& ctx, const Problem& p, Buffers* b) {
  b->weight_elems = size_t(p.heads) * p.rows * p.cols;
  b->copies = cold_copies(ctx, b->weight_elems * 2);
  DSA_RETURN_IF_ERROR(b->weights.allocate(b->weight_elems * 2 * b->copies));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->weights.get(), b->weight_elems * b->copies, 1, 0.05f, ctx.stream));
  DSA_RETURN_IF_ERROR(b->x.allocate(size_t(p.m) * p.heads * p.rows * 2));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->x.get(), size_t(p.m) * p.heads * p.rows, 2, 1.0f, ctx.stream));
  DSA_RETURN_IF_ERROR(b->out.allocate(size_t(p.m) * p.heads * p.cols * 2));
  DSA_RETURN_IF_ERROR(b->out_bf16.allocate(size_t(p.m) * p.heads * p.cols * 2));
  DSA_RETURN_IF_ERROR(b->scale.allocate(sizeof(float) * 2));
  const float scales[2] = {0.0125f, 0.02f};  // q_scale, k_scale
  DSA_CUDA_RETURN(cudaMemcpy(b->scale.get(), scales, sizeof(scales), cudaMemcpyHostToDevice));
  DSA_RETURN_IF_ERROR(b->kv.allocate(size_t(p.m) * kLatent * 2));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->kv.get(), size_t(p.m) * kLatent, 3, 1.0f, ctx.stream));
  DSA_RETURN_IF_ERROR(b->cache.allocate(size_t(kCacheBlocks) * kBlockSize * kLatent));
  std::vector<int64_t> slots(p.m);
  for (int t = 0; t < p.m; ++t) slots[t] = int64_t(t) * 37 + 5;  // scattered, distinct
  DSA_RETURN_IF_ERROR(b->slots.allocate(sizeof(int64_t) * p.m));
  DSA_CUDA_RETURN(cudaMemcpy(b->slots.get(), slots.data(), sizeof(int64_t) * p.m, cudaMemcpyHostToDevice));
  DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
  return Status();
}

struct Views {
  HeadGemvArgs args;
  KvCacheWrite cache;
};

// The views for input copy i.
Views views(const Problem& p, const Buffers& b, int i) {
  Views v;
  auto* weights = b.weights.as<uint16_t>() + b.weight_elems * (i % b.copies);
  v.args.x = make_tensor(b.x.get(), DType::kBF16, {p.m, p.heads, p.rows});
  v.args.weight = make_tensor(weights, DType::kBF16, {p.heads, p.rows, p.cols});
  v.args.out = make_tensor(b.out.get(), p.absorb ? DType::kFP8E4M3 : DType::kBF16, {p.m, p.heads, p.cols});
  if (p.absorb) {
    v.args.scale = make_tensor(b.scale.as<float>(), DType::kF32, {1});
    v.cache = KvCacheWrite{make_tensor(b.kv.get(), DType::kBF16, {p.m, kLatent}),
                           make_tensor(b.cache.get(), DType::kFP8E4M3, {kCacheBlocks, kBlockSize, kLatent}),
                           make_tensor(b.slots.get(), DType::kI64, {p.m}),
                           make_tensor(b.scale.as<float>() + 1, DType::kF32, {1})};
  }
  return v;
}

Status time_fused(const Context& ctx, const Problem& p, const Buffers& b, const HeadGemvTactic* tactic, double* us) {
  return time_graph(ctx, [&](cudaStream_t stream, int i) {
    Views v = views(p, b, i);
    if (p.absorb) v.args.cache = &v.cache;
    v.args.sums = HeadGemvSums::kSeedOrder;
    return head_gemv(v.args, stream, tactic);
  }, us, std::max(20, b.copies));
}

// The default tensor-core sums (the column tile by the kernel's rule, head_gemv_mma_tile).
Status time_tensor_cores(const Context& ctx, const Problem& p, const Buffers& b, double* us) {
  return time_graph(
      ctx,
      [&](cudaStream_t stream, int i) {
        Views v = views(p, b, i);
        if (p.absorb) v.args.cache = &v.cache;
        v.args.sums = HeadGemvSums::kTensorCores;
        return head_gemv(v.args, stream);
      },
      us, std::max(20, b.copies));
}

Status time_stock(const Context& ctx, const Problem& p, const Buffers& b, cublasHandle_t handle, double* us) {
  return time_graph(ctx, [&](cudaStream_t stream, int i) {
    Views v = views(p, b, i);
    const TensorView bf16 = make_tensor(b.out_bf16.get(), DType::kBF16, {p.m, p.heads, p.cols});
    DSA_RETURN_IF_ERROR(cublas_head_bmm(handle, v.args.x, v.args.weight, p.absorb ? bf16 : v.args.out));
    if (!p.absorb) return Status();
    DSA_RETURN_IF_ERROR(stock_static_fp8_quant(bf16, v.args.out, v.args.scale, stream));
    return stock_concat_and_cache_mla(v.cache, stream);
  }, us, std::max(20, b.copies));
}

Status run(Context& ctx, Report& report) {
  CublasHandle handle;
  DSA_RETURN_IF_ERROR(handle.create(ctx.stream));
  for (bool absorb : {true, false}) {
    for (int heads : {64, 8}) {
      for (int m : {1, 2, 4, 8, 16}) {
        const Problem p{heads, absorb ? 256 : 512, absorb ? 256 * 2 : 256, m, absorb};
        Buffers b;
        DSA_RETURN_IF_ERROR(make_buffers(ctx, p, &b));
        const HeadGemvTactic table = head_gemv_tactic(p.heads, p.rows, p.cols, m);
        double tensor_us = 0, seed_us = 0, stock_us = 0;
        DSA_RETURN_IF_ERROR(time_tensor_cores(ctx, p, b, &tensor_us));
        DSA_RETURN_IF_ERROR(time_fused(ctx, p, b, nullptr, &seed_us));
        DSA_RETURN_IF_ERROR(time_stock(ctx, p, b, handle.get(), &stock_us));
        const std::string name = absorb ? "absorb" : "value_up";
        const std::vector<std::pair<std::string, double>> params = {{"H", heads}, {"m", m}};
        const std::string baseline = absorb ? "cuBLAS bmm + static FP8 quant + concat_and_cache_mla" : "cuBLAS bmm";
        Row row{name, params, tensor_us, baseline, stock_us, floor_us(ctx, floor_bytes(p))};
        row.note = "default: BF16 mma.sync, FP32 accumulators, column tile " +
                   std::to_string(head_gemv_mma_tile(p.heads, p.rows, p.cols, m));
        report.add(row);
        Row seed{name + " (seed order)", params, seed_us, baseline, stock_us, row.floor_us};
        seed.note = "opt-in HeadGemvSums::kSeedOrder, tactic " + std::to_string(table.tile) + "/" +
                    std::to_string(table.rows_per_thread);
        report.add(seed);
      }
    }
  }
  return Status();
}

}  // namespace
DSA_BENCH("head_gemv", run);
}  // namespace dsa::bench
