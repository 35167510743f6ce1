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
Status sparse_mla_with_plan(const SparseMlaArgs &args, const SparseMlaSplitPlan &plan, cudaStream_t stream);

}  // namespace dsa
