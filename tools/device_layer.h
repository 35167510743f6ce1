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
//
// The stage exposes every product the checks read but one: the select's
// logits, which the check of FP32-accumulated logits needs, stay in its
// workspace. So the layer can replay the indexer's prepare and select through
// the same library calls on the stage's own projections into a workspace of
// its own: the same kernels on the same inputs give the same bits, and the
// checks show that they did (the replay's slots against the stage's).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "dsa_decode/indexer.h"
#include "dsa_decode/stage.h"
#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"
#include "harness.h"
#include "synthetic_layer.h"

namespace dsa::cli {

// The indexer's prepare and select replayed on the stage's projections.
struct IndexerSelectReplay {
  std::vector<float> logits;   // [m, indexer_workspace_layout(plan).logits_stride]: the select's logits
  std::vector<int32_t> slots;  // [m, 2176] int32: the select's rows of KV slots
  unsigned int errors = 0;     // untrusted values prepare and select met
};

class DeviceLayer {
 public:
  // Uploads everything on `stream`: `weight_copies` copies of the weights,
  // the step's inputs, the whole `cache` (first block 0) once per path; the
  // indexer's state, zeroed, then prefilled with `indexer_history`
  // (make_indexer_history) under `plan`'s indexer plan; and waits for it.
  // `plan` is the stages': the select replay follows its indexer plan.
  Status init(const StepShape& shape, const HostWeights& weights, const HostStepInputs& inputs,
              const IndexerTokenRows& indexer_history, const HostCache& cache, const DsaStagePlan& plan,
              int weight_copies, cudaStream_t stream);

  int weight_copies() const { return weight_copies_; }
  // Views of weight copy `copy` (0 .. weight_copies() - 1).
  DsaLayerWeights weights(int copy) const;
  size_t weight_bytes() const { return copy_bytes_; }  // one copy, alignment padding included

  // The step's arguments for `path`: the shared inputs, state and output,
  // that path's KV cache and error counter.
  DsaStepArgs step_args(DsaPath path) const;

  // Zeroes the error counters (the paths', the prefill's, the select replay's).
  Status clear_error_counts(cudaStream_t stream);
  // Waits for `stream`, then reads back.
  Status download_cache(DsaPath path, cudaStream_t stream, std::vector<uint8_t>* cache) const;  // whole cache
  Status download_indexer_state(cudaStream_t stream, std::vector<uint16_t>* ring, std::vector<uint8_t>* k_cache) const;
  Status download_out(cudaStream_t stream, std::vector<uint16_t>* out) const;  // [m, D]
  Status path_errors(DsaPath path, cudaStream_t stream, unsigned int* count) const;
  Status prefill_errors(cudaStream_t stream, unsigned int* count) const;
  // Fills the step's output with `byte` (0xFF: BF16 NaN, so an unwritten output fails its check).
  Status fill_out(int byte, cudaStream_t stream);

  // indexer prepare and select, as the stage calls them, from the stage's
  // projections (`stage`'s index_q, index_k, head_weights and gate, read in
  // place) with weight copy 0, into the layer's own workspace: under
  // FP32-accumulated logits only (the plan init took), the one case whose
  // check reads the logits, so the only one the workspace is made for.
  // Prepare rewrites the state's bytes at the same positions (step_args says
  // why that leaves the state as it was).
  Status replay_indexer_select(const DsaStageIntermediates& stage, cudaStream_t stream, IndexerSelectReplay* out);

 private:
  enum ErrorCounter { kFusedStep, kStockStep, kPrefill, kReplay, kErrorCounters };
  unsigned int* error_counter(ErrorCounter counter) const { return error_counts_.as<unsigned int>() + counter; }
  IndexerState indexer_state() const;
  TensorView cache_view(DsaPath path) const;  // [blocks, 256, L] FP8
  Status prefill_indexer(const IndexerTokenRows& history, cudaStream_t stream);

  StepShape s_{};
  IndexerPlan indexer_plan_{};
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
  bench::DeviceMemory indexer_ring_;         // [indexer requests, 2, kIndexerRing, 128] BF16
  bench::DeviceMemory indexer_k_cache_;      // [cache blocks, kIndexerPageBytes] uint8
  // The select replay's own buffers (under FP32-accumulated logits).
  bench::DeviceMemory replay_workspace_;  // [indexer_workspace_layout(plan).bytes] uint8
  bench::DeviceMemory replay_slots_;      // [m, 2176] int32
};

}  // namespace dsa::cli
