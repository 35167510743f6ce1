// The indexer select step's probes and baseline, for the benchmark and the
// tests (declared in baselines.h): the logits kernel alone, the step's two
// launches with empty kernels, and the straightforward select: the same
// logits kernel, a key kernel, cub::DeviceSegmentedRadixSort::
// SortPairsDescending (stable, so equal keys keep the lower pool first), an
// expand kernel (sorts the 512 chosen pools by index through ranks) and the
// remap kernel.
#include <cub/device/device_segmented_radix_sort.cuh>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "baselines.h"
#include "core/shared_memory.h"
#include "dsa_decode/indexer.h"
#include "indexer/indexer_select_kernels.cuh"

namespace dsa {
namespace {

// Keys, values and segment bounds for the segmented sort: token t's segment is
// [t * stride, t * stride + n).
__global__ void __launch_bounds__(256) baseline_keys_kernel(const __grid_constant__ Params p) {
  pdl_wait();
  pdl_release_dependents();
  const int t = blockIdx.y;
  int64_t request = 0;
  const int64_t n = scored_pools(p, token_context(p, t, &request, false));
  const int64_t begin = t * p.logits_stride;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    p.segment_begin[t] = static_cast<int>(begin);
    p.segment_end[t] = static_cast<int>(begin + n);
  }
  for (int64_t pool = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; pool < n; pool += int64_t(gridDim.x) * blockDim.x) {
    p.keys_in[begin + pool] = order_key(p.logits[begin + pool]);
    p.values_in[begin + pool] = static_cast<int32_t>(pool);
  }
}

// Positions from the sorted pools: the first K / S in (key desc, index asc)
// order, placed by their rank in pool index order.
__global__ void __launch_bounds__(kIndexerMaxTopPools) baseline_expand_kernel(const __grid_constant__ Params p) {
  __shared__ int32_t chosen[kIndexerMaxTopPools];
  pdl_wait();
  pdl_release_dependents();
  const int t = blockIdx.x;
  int64_t request = 0;
  const int64_t context = token_context(p, t, &request, true);
  const int64_t n = scored_pools(p, context);
  int32_t* row = p.topk_positions + t * p.topk_stride;
  if (n == 0) {
    for (int c = threadIdx.x; c < p.row_width; c += blockDim.x) row[c] = c < context ? c : -1;
    return;
  }
  const int count = n < p.top_pools ? static_cast<int>(n) : p.top_pools;  // n >= K / S here
  const int i = threadIdx.x;
  if (i < count) chosen[i] = p.values_out[t * p.logits_stride + i];
  __syncthreads();
  if (i < count) {
    const int32_t pool = chosen[i];
    int rank = 0;
    for (int j = 0; j < count; ++j) rank += chosen[j] < pool;
    for (int j = 0; j < p.pool; ++j) row[rank * p.pool + j] = pool * p.pool + j;
  }
  const int64_t tail_start = context / p.pool * p.pool;
  for (int c = p.topk + threadIdx.x; c < p.row_width; c += blockDim.x) {
    const int64_t position = tail_start + (c - p.topk);
    row[c] = position < context ? static_cast<int32_t>(position) : -1;
  }
}

// Baseline workspace: keys in/out, values in/out [max_tokens, stride] each,
// segment begin/end [max_tokens] each, then CUB's temporary storage.
struct BaselineLayout {
  int64_t keys_in, keys_out, values_in, values_out, begin, end, temp, bytes;
  size_t temp_bytes;
};

int64_t align256(int64_t v) { return (v + 255) / 256 * 256; }

Status baseline_layout(const IndexerPlan& plan, BaselineLayout* layout) {
  DSA_RETURN_IF_ERROR(check_indexer_plan(plan));
  const int64_t items = int64_t(plan.max_tokens) * indexer_workspace_layout(plan).logits_stride;
  const int64_t array = align256(items * 4);
  layout->keys_in = 0;
  layout->keys_out = layout->keys_in + array;
  layout->values_in = layout->keys_out + array;
  layout->values_out = layout->values_in + array;
  layout->begin = layout->values_out + array;
  layout->end = layout->begin + align256(plan.max_tokens * 4);
  layout->temp = layout->end + align256(plan.max_tokens * 4);
  layout->temp_bytes = 0;
  DSA_CUDA_RETURN(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, layout->temp_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(items),
      plan.max_tokens, static_cast<const int*>(nullptr), static_cast<const int*>(nullptr), 0, 32, nullptr));
  layout->bytes = layout->temp + align256(static_cast<int64_t>(layout->temp_bytes));
  return Status();
}

// A launch with none of its kernel's work: only the PDL wait and release.
__global__ void empty_pdl_kernel() {
  pdl_wait();
  pdl_release_dependents();
}

}  // namespace

Status indexer_select_logits_only(const IndexerSelectArgs& args, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_select(args));
  return launch_logits(make_params(args), args.plan.logits, stream);
}

Status indexer_select_launch_floor(const IndexerSelectArgs& args, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_select(args));
  const Params p = make_params(args);
  DSA_RETURN_IF_ERROR(launch_pdl(empty_pdl_kernel, logits_grid(p), dim3(kLogitThreads), 0, stream));
  const int staged = static_cast<int>(std::min<int64_t>(p.logits_stride, kStagedKeys));
  DSA_RETURN_IF_ERROR(raise_shared_memory_limit(reinterpret_cast<const void*>(empty_pdl_kernel),
                                                kStagedKeys * static_cast<int>(sizeof(uint32_t)),
                                                "indexer select launch floor"));
  return launch_pdl(empty_pdl_kernel, dim3(p.m), dim3(kSelectThreads), staged * sizeof(uint32_t), stream);
}

Status indexer_select_baseline_workspace_bytes(const IndexerPlan& plan, int64_t* bytes) {
  BaselineLayout layout;
  DSA_RETURN_IF_ERROR(baseline_layout(plan, &layout));
  *bytes = layout.bytes;
  return Status();
}

Status indexer_select_baseline(const IndexerSelectArgs& args, void* baseline_workspace,
                               int64_t baseline_workspace_bytes, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_select(args));
  if (args.topk_positions.data == nullptr) {
    return invalid_argument("topk_positions", "present (the baseline's remap reads it)", "absent");
  }
  BaselineLayout layout;
  DSA_RETURN_IF_ERROR(baseline_layout(args.plan, &layout));
  const TensorView baseline =
      make_tensor(baseline_workspace, DType::kU8, {std::max<int64_t>(baseline_workspace_bytes, 0)});
  DSA_RETURN_IF_ERROR(check_present(baseline, "baseline_workspace"));
  if (baseline_workspace_bytes < layout.bytes) {
    return invalid_argument("baseline_workspace",
                            "at least indexer_select_baseline_workspace_bytes(plan) = " + std::to_string(layout.bytes) +
                                " bytes",
                            std::to_string(baseline_workspace_bytes) + " bytes");
  }
  DSA_RETURN_IF_ERROR(check_aligned(baseline, "baseline_workspace", 256));
  for (const auto& [other, name] : {std::pair{&args.workspace, "workspace"}, {&args.slots, "slots"},
                                    {&args.topk_positions, "topk_positions"}, {&args.state.k_cache, "k_cache"}}) {
    DSA_RETURN_IF_ERROR(check_no_overlap(baseline, "baseline_workspace", *other, name));
  }
  uint8_t* w = static_cast<uint8_t*>(baseline_workspace);
  Params p = make_params(args);
  p.keys_in = reinterpret_cast<uint32_t*>(w + layout.keys_in);
  p.values_in = reinterpret_cast<int32_t*>(w + layout.values_in);
  p.values_out = reinterpret_cast<int32_t*>(w + layout.values_out);
  p.segment_begin = reinterpret_cast<int*>(w + layout.begin);
  p.segment_end = reinterpret_cast<int*>(w + layout.end);
  DSA_RETURN_IF_ERROR(launch_logits(p, args.plan.logits, stream));
  const unsigned key_blocks = static_cast<unsigned>((p.logits_stride + 255) / 256);
  DSA_RETURN_IF_ERROR(launch_pdl(baseline_keys_kernel, dim3(key_blocks, p.m), dim3(256), 0, stream, p));
  size_t temp_bytes = layout.temp_bytes;
  DSA_CUDA_RETURN(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      w + layout.temp, temp_bytes, p.keys_in, reinterpret_cast<uint32_t*>(w + layout.keys_out), p.values_in,
      p.values_out, static_cast<int>(int64_t(p.m) * p.logits_stride), p.m, p.segment_begin, p.segment_end, 0, 32,
      stream));
  DSA_RETURN_IF_ERROR(launch_pdl(baseline_expand_kernel, dim3(p.m), dim3(kIndexerMaxTopPools), 0, stream, p));
  return launch_pdl(remap_rows_kernel, dim3(p.m), dim3(256), 0, stream, p);
}

}  // namespace dsa
