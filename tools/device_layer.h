// The synthetic layer on the GPU in the form the library's stage takes it
// (include/dsa_decode/stage.h): copies of the layer's weights, each one
// stage's DsaLayerWeights (the timings rotate stages so that every launch
// reads its weights from memory, as in a model where other layers run
// between two calls of this one); the step's inputs; the KV cache, once per
// path; the indexer's state, prefilled with the context; the step's output.
//
// Each path writes its own copy of the KV cache (DsaStepArgs::kv_cache), so
// that the caches the fused and the stock run left can be compared after
// both ran. The indexer's state is shared: both paths run indexer_prepare at
// the same positions, which rewrites the same bytes (DeviceLayer::step_args
// says why), so the checks and every timed replay see the same state.
// The checks read what a run left through the step's arguments' views.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsa_decode/indexer.h"
#include "dsa_decode/stage.h"
#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"
#include "timing.h"
#include "synthetic_layer.h"

namespace dsa::cli {

class DeviceLayer {
 public:
  // Uploads everything on `stream`: `weight_copies` copies of the weights,
  // the step's inputs, the whole `cache` (first block 0) once per path; the
  // indexer's state, zeroed, then prefilled with `indexer_history`
  // (make_indexer_history) under the shape's indexer plan; and waits for it.
  Status init(const StepShape& shape, const HostWeights& weights, const HostStepInputs& inputs,
              const IndexerTokenRows& indexer_history, const HostCache& cache, int weight_copies, cudaStream_t stream);

  // Views of weight copy `copy` (0 .. weight_copies - 1).
  DsaLayerWeights weights(int copy) const;
  size_t weight_bytes() const { return copy_bytes_; }  // one copy, alignment padding included

  // The step's arguments for `path`: the shared inputs, state and output,
  // that path's KV cache and error counter (zeroed at init).
  DsaStepArgs step_args(DsaPath path) const;

  // The prefill's error counter (untrusted values init's prefill met).
  unsigned int* prefill_error_count() const { return error_counter(kPrefill); }

 private:
  enum ErrorCounter { kFusedStep, kStockStep, kPrefill, kErrorCounters };
  unsigned int* error_counter(ErrorCounter counter) const { return error_counts_.as<unsigned int>() + counter; }
  IndexerState indexer_state() const;
  TensorView cache_view(DsaPath path) const;  // [blocks, 256, L] FP8
  Status prefill_indexer(const IndexerTokenRows& history, cudaStream_t stream);

  StepShape s_{};
  int weight_copies_ = 0;
  size_t copy_bytes_ = 0;               // bytes between two weight copies
  bench::DeviceMemory weights_;         // [weight_copies_] x every weight of the layer (DsaLayerWeights)
  bench::DeviceMemory hidden_;          // [m, D] BF16
  bench::DeviceMemory positions_;       // [m] int64
  bench::DeviceMemory token_requests_;  // [m] int32
  bench::DeviceMemory slot_mapping_;    // [m] int64
  bench::DeviceMemory cache_fused_;     // [blocks, 256, L] FP8 e4m3: the fused path's KV cache
  bench::DeviceMemory cache_stock_;     // [blocks, 256, L] FP8 e4m3: the stock path's
  bench::DeviceMemory out_;             // [m, D] BF16: the step's output (either path's)
  bench::DeviceMemory error_counts_;    // [kErrorCounters] unsigned int
  // The indexer's state, shared by both paths.
  bench::DeviceMemory indexer_block_table_;  // [indexer requests, cache blocks] int32
  bench::DeviceMemory indexer_ring_;         // [indexer requests, 2, indexer_ring(), 128] BF16
  bench::DeviceMemory indexer_k_cache_;      // [cache blocks, indexer_page_bytes()] uint8
};

}  // namespace dsa::cli
