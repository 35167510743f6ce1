// Baselines and probes that the benchmarks time and the tests check; built
// into dsa_baselines (linked by dsa-bench and dsa_tests), not the library.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsa_decode/indexer.h"
#include "dsa_decode/sparse_mla.h"
#include "dsa_decode/status.h"

namespace dsa {

// sparse_mla's contract on FP32 CUDA cores, one CTA per (head, token), every
// sum in a fixed order: the GPU reference and benchmark baseline of the
// tensor-core kernels. Leaves split_counters and split_partials untouched.
Status sparse_mla_simple(const SparseMlaArgs& args, cudaStream_t stream);

// indexer_select's logits kernel alone (step 6), with indexer_select's checks.
Status indexer_select_logits_only(const IndexerSelectArgs& args, cudaStream_t stream);

// indexer_select's two launches (the logits grid, then one select CTA per
// token with its shared memory) with empty kernels that only wait and
// release (PDL): the launches' share of the step's time.
Status indexer_select_launch_floor(const IndexerSelectArgs& args, cudaStream_t stream);

// The straightforward select: indexer_select's logits kernel, a CUB segmented
// radix sort per token, an expand and a remap kernel; the same rows as
// indexer_select. It needs topk_positions and a workspace of its own of
// indexer_select_baseline_workspace_bytes(plan) bytes, 256-byte aligned, not
// overlapping the other buffers.
Status indexer_select_baseline_workspace_bytes(const IndexerPlan& plan, int64_t* bytes);
Status indexer_select_baseline(const IndexerSelectArgs& args, void* baseline_workspace, int64_t baseline_workspace_bytes,
                               cudaStream_t stream);

}  // namespace dsa
