// The tensor-core sparse MLA kernel with an explicit split plan, for the
// benchmark (to measure plans against each other) and the tests (to check
// that a plan is validated). Engines call sparse_mla, which uses
// sparse_mla_split_plan(H, K).
#pragma once

#include <cuda_runtime.h>

#include "dsa_decode/sparse_mla.h"

namespace dsa {

// Errors name `plan` when it does not cover the heads or the entries of
// `args`, or breaks a limit of SparseMlaSplitPlan.
Status sparse_mla_with_plan(const SparseMlaArgs& args, const SparseMlaSplitPlan& plan, cudaStream_t stream);

// How many clusters of `plan` the current device can run at once
// (cudaOccupancyMaxActiveClusters); 0 means the plan cannot launch there.
Status sparse_mla_max_active_clusters(const SparseMlaSplitPlan& plan, int heads, int top_k, int* clusters);

}  // namespace dsa
