// Internal entry points of the select step that the benchmark times on their
// own (not part of the public API, include/dsa_decode/indexer.h).
#pragma once

#include <cuda_runtime.h>

#include "dsa_decode/indexer.h"
#include "dsa_decode/status.h"

namespace dsa {

// The logits kernel alone (step 6: the exact FP64-tensor-core dots into the
// workspace's logits rows), with indexer_select's checks; the rest of
// indexer_select is the one-CTA-per-token radix select, so the benchmark
// splits the step's time between the two.
Status indexer_select_logits_only(const IndexerSelectArgs& args, cudaStream_t stream);

// indexer_select's two launches (logits grid, then one select CTA per token
// with its shared memory) with empty kernels that only wait and release
// (PDL): the launches' share of the step's time.
Status indexer_select_launch_floor(const IndexerSelectArgs& args, cudaStream_t stream);

}  // namespace dsa
