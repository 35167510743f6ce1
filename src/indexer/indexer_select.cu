// The indexer's select step (indexer_select) and the remap (indexer_remap):
// the public entry points over the kernels of indexer_select_kernels.cuh.
#include <algorithm>
#include <cstdint>

#include "core/shared_memory.h"
#include "dsa_decode/indexer.h"
#include "indexer/indexer_select_kernels.cuh"

namespace dsa {

Status indexer_select(const IndexerSelectArgs& args, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_select(args));
  const Params p = make_params(args);
  DSA_RETURN_IF_ERROR(launch_logits(p, args.plan.logits, stream));
  // The token's keys stay in shared memory up to 2^15 pools (128 KiB); the
  // limit is raised to that once per device, whatever this plan needs.
  DSA_RETURN_IF_ERROR(raise_shared_memory_limit(reinterpret_cast<const void*>(select_rows_kernel),
                                                kStagedKeys * static_cast<int>(sizeof(uint32_t)), "indexer select"));
  const int staged = static_cast<int>(std::min<int64_t>(p.logits_stride, kStagedKeys));
  return launch_pdl(select_rows_kernel, dim3(p.m), dim3(kSelectThreads), staged * sizeof(uint32_t), stream, p, staged);
}

Status indexer_remap(const IndexerRemapArgs& a, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_remap(a));
  Params p = make_row_params(a.plan, a.positions, a.token_requests, a.state);
  p.topk_positions = a.topk_positions.ptr<int32_t>();  // read only here
  p.topk_stride = a.topk_positions.stride(0);
  p.slots = a.slots.ptr<int32_t>();
  p.slots_stride = a.slots.stride(0);
  p.error_count = a.error_count;
  p.count_untrusted_tokens = true;
  return launch_pdl(remap_rows_kernel, dim3(p.m), dim3(256), 0, stream, p);
}

}  // namespace dsa
