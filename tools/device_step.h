// The synthetic layer and one decode step's buffers on the GPU, and every
// launch of the two chains:
//   fused: norm -> q_b_proj -> head_gemv absorb (FP8 out + cache write) -> indexer_project -> indexer_prepare
//          -> indexer_select -> sparse_mla -> value-up (head_gemv, or for token counts outside
//          --value-up-tokens the stock path's cuBLAS bmm into the fused path's output)
//   stock: norm -> q_b_proj -> indexer_project -> indexer_prepare -> indexer_select_baseline (CUB sort)
//          -> concat_and_cache_mla -> cuBLAS bmm -> static FP8 quant -> counter memset -> sparse_mla -> cuBLAS bmm
// norm, q_b_proj, indexer_project and indexer_prepare are shared (same
// buffers, same launches). The two paths write their own outputs and their
// own copy of the KV cache, so they can be compared after both ran. The
// indexer (include/dsa_decode/indexer.h) runs where the seed's stage and
// vLLM run it, after the absorb and after q_b_proj: its projections
// (indexer_project_gemv, or indexer_project's cuBLASLt GEMMs) of the norm's q_c and the synthetic hidden
// states, then prepare and select over a state that init prefills with the
// context's drawn rows (StepShape); each path's select writes the top-k
// slots its attention reads. Both paths
// share the indexer's state: prepare run again at the same positions writes
// the same bytes (DeviceStep::indexer_prepare says why), so the checks and
// every timed replay see the same state. No stock Hopper kernel takes this
// cache format (the seed's attention is Blackwell-only), so the stock chain
// runs the same sparse_mla on its own q and cache, after the counter memset
// stock engines issue before their attention.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "dsa_decode/head_gemv.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"
#include "harness.h"
#include "options.h"
#include "reference_chain.h"
#include "synthetic_layer.h"

namespace dsa::cli {

// Identical copies of one weight, so that timed launches can rotate through
// more bytes than the L2 holds (each launch then reads its weights from memory,
// as in a model where the other layers run between two calls of this one).
class ReplicatedBuffer {
 public:
  Status upload(const void* host, size_t bytes, int copies, cudaStream_t stream);
  void* copy(int i) const;

 private:
  bench::DeviceMemory memory_;
  size_t stride_ = 0;  // bytes between copies, 256-byte aligned
  int copies_ = 1;
};

// What the checks read back after a run.
struct StepOutputs {
  std::vector<uint16_t> q_c, kv_c, q;  // shared: [m, Q], [m, L], [m, H*P]
  IndexerProjections indexer_projections;         // shared: indexer_project's
  std::vector<uint8_t> q_fp8_fused, q_fp8_stock;  // [m, H, L]
  std::vector<uint16_t> latent_fused, latent_stock;  // [m, H, L] BF16, the attention's outputs
  std::vector<float> lse_fused, lse_stock;            // [m, H]
  std::vector<uint16_t> out_fused, out_stock;     // [m, H, V]
  std::vector<uint8_t> cache_fused, cache_stock;  // whole caches
  std::vector<int32_t> topk_slots_fused, topk_slots_stock;  // [m, 2176] the selects' rows of KV slots
  std::vector<float> indexer_logits;                        // [m, logits_stride] the last select's workspace logits
  std::vector<uint16_t> indexer_ring;    // [indexer requests, 2, kIndexerRing, 128] BF16
  std::vector<uint8_t> indexer_k_cache;  // [cache blocks, kIndexerPageBytes]
  unsigned int skipped_slots_fused = 0, skipped_slots_stock = 0;  // the cache writes' error counters
  unsigned int bad_indices_fused = 0, bad_indices_stock = 0;      // the attentions' error counters
  unsigned int indexer_state_errors = 0;  // the prefill's and prepare's error counter
  unsigned int indexer_select_errors_fused = 0, indexer_select_errors_stock = 0;
  bool counters_zero = false;  // the split counters after the run
};

class DeviceStep {
 public:
  // Uploads everything on `stream`, prefills the indexer's state with
  // `indexer_history` (make_indexer_history) and waits for it. `cache` is the
  // whole cache (first block 0); `handle` is bound to `stream`
  // (bench::CublasHandle). `value_up` is the kernel fused_value_up runs;
  // `projections_cublaslt` makes indexer_project run the four cuBLASLt GEMMs
  // instead of the one GEMV launch.
  Status init(const StepShape& shape, const HostWeights& weights, const HostStepInputs& inputs,
              const IndexerTokenRows& indexer_history, const HostCache& cache, int weight_copies,
              ValueUpKernel value_up, bool projections_cublaslt, cublasHandle_t handle, cudaStream_t stream);

  // The launches, on `stream` (the handle's), reading weight copy `copy % weight_copies`.
  Status norm(cudaStream_t stream, int copy) const;
  Status q_b_proj(cudaStream_t stream, int copy) const;
  Status fused_absorb(cudaStream_t stream, int copy) const;  // FP8 q + cache write, one launch
  Status indexer_project(cudaStream_t stream, int copy) const;  // one GEMV launch, or four cuBLASLt GEMMs
  Status indexer_prepare(cudaStream_t stream, int copy) const;
  Status fused_indexer_select(cudaStream_t stream, int copy) const;
  Status fused_attention(cudaStream_t stream, int copy) const;
  Status fused_value_up(cudaStream_t stream, int copy) const;
  Status stock_cache_write(cudaStream_t stream, int copy) const;
  Status stock_absorb_bmm(cudaStream_t stream, int copy) const;
  Status stock_fp8_quant(cudaStream_t stream, int copy) const;
  Status stock_indexer_select(cudaStream_t stream, int copy) const;  // the CUB-sort baseline
  Status stock_counter_memset(cudaStream_t stream, int copy) const;
  Status stock_attention(cudaStream_t stream, int copy) const;
  Status stock_value_up_bmm(cudaStream_t stream, int copy) const;

  // Waits for `stream`, then copies every output back.
  Status download(cudaStream_t stream, StepOutputs* out) const;

 private:
  TensorView q_view() const;                // [m, H, P] BF16
  TensorView cache_view(void* data) const;  // [blocks, 256, L] FP8
  KvCacheWrite cache_write(void* cache, unsigned int* error_count) const;
  IndexerState indexer_state() const;
  // Select arguments writing `slots` (and `topk_positions` unless null) [m, 2176].
  IndexerSelectArgs indexer_select_args(void* slots, void* topk_positions, unsigned int* error_count) const;
  Status attention(void* q_fp8, void* cache, void* topk_slots, void* latent, void* lse, unsigned int* error_count,
                   cudaStream_t stream) const;
  Status check_cublas_stream(cudaStream_t stream) const;
  // latent [m, H, L] x W_UV into out [m, H, V] through cuBLAS, as the stock path runs it.
  Status value_up_bmm(void* latent, void* out, cudaStream_t stream, int copy) const;
  Status prefill_indexer(const IndexerTokenRows& history, cudaStream_t stream);

  // Entries of error_counts_.
  enum ErrorCounter {
    kFusedCacheWrite,
    kStockCacheWrite,
    kFusedAttention,
    kStockAttention,
    kIndexerState,  // prefill and prepare
    kFusedIndexerSelect,
    kStockIndexerSelect,
    kErrorCounters
  };
  unsigned int* error_counter(ErrorCounter counter) const { return error_counts_.as<unsigned int>() + counter; }

  StepShape s_{};
  cublasHandle_t handle_ = nullptr;
  ValueUpKernel value_up_ = ValueUpKernel::kHeadGemv;
  bool projections_cublaslt_ = false;
  float eps_ = 0;
  ReplicatedBuffer q_norm_gamma_, kv_norm_gamma_, q_b_proj_, w_uk_t_, w_uv_;
  bench::DeviceMemory scales_;  // [q_scale, k_scale] f32
  bench::DeviceMemory qkv_, q_c_, kv_c_, q_, slot_mapping_;
  bench::DeviceMemory q_fp8_fused_, latent_fused_, lse_fused_, out_fused_, cache_fused_;
  bench::DeviceMemory q_bf16_stock_, q_fp8_stock_, latent_stock_, lse_stock_, out_stock_, cache_stock_;
  bench::DeviceMemory split_counters_;  // sparse_mla's, zero between launches
  bench::DeviceMemory split_partials_;  // sparse_mla's clusters' results for the last one
  bench::DeviceMemory error_counts_;    // [kErrorCounters] unsigned int
  // The indexer: parameters, the step's inputs, the shared state and workspace, each path's rows.
  bench::DeviceMemory index_k_norm_weight_, index_k_norm_bias_, index_ape_;
  ReplicatedBuffer index_wq_b_, index_wk_, index_weights_proj_, index_compress_gate_;
  bench::DeviceMemory hidden_;  // x [m, D], the projections' input
  bench::DeviceMemory index_q_, index_k_, index_head_weights_, index_gate_, positions_, token_requests_;
  // Mutable: indexer_project keeps each shape's cuBLASLt plan in it (host
  // memory, made on the first call), which the const launches may add to.
  mutable IndexerProjectContext indexer_project_context_;
  bench::DeviceMemory indexer_block_table_, indexer_ring_, indexer_k_cache_, indexer_workspace_;
  bench::DeviceMemory select_baseline_workspace_;
  bench::DeviceMemory topk_slots_fused_, topk_slots_stock_, topk_positions_stock_;
};

}  // namespace dsa::cli
