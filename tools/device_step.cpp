#include "device_step.h"

#include <algorithm>
#include <string>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/norm.h"
#include "dsa_decode/sparse_mla.h"
#include "dsa_decode/stock.h"
#include "reference_chain.h"

namespace dsa::cli {

namespace {

constexpr size_t kCopyAlignment = 256;  // what cudaMalloc gives: every copy as aligned as the first
constexpr int kPoisonByte = 0xFF;       // BF16 0xFFFF and e4m3 0xFF are NaN: an unwritten output fails its check
// Top-k rows: 0x7F7F7F7F is a slot past any cache (0xFF.. would read as -1,
// a valid "none"), so an unwritten row fails its check and the attention's.
constexpr int kPoisonSlotByte = 0x7F;

template <class T>
size_t bytes_of(const std::vector<T>& v) {
  return v.size() * sizeof(T);
}

template <class T>
Status copy_to_device(const std::vector<T>& host, bench::DeviceMemory* device, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(device->allocate(bytes_of(host)));
  DSA_CUDA_RETURN(cudaMemcpyAsync(device->get(), host.data(), bytes_of(host), cudaMemcpyHostToDevice, stream));
  return Status();
}

Status allocate_filled(size_t bytes, int byte, bench::DeviceMemory* device, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(device->allocate(bytes));
  DSA_CUDA_RETURN(cudaMemsetAsync(device->get(), byte, bytes, stream));
  return Status();
}

Status allocate_poisoned(size_t bytes, bench::DeviceMemory* device, cudaStream_t stream) {
  return allocate_filled(bytes, kPoisonByte, device, stream);
}

template <class T>
Status copy_to_host(const bench::DeviceMemory& device, std::vector<T>* host, cudaStream_t stream) {
  host->resize(device.bytes() / sizeof(T));
  DSA_CUDA_RETURN(cudaMemcpyAsync(host->data(), device.get(), bytes_of(*host), cudaMemcpyDeviceToHost, stream));
  return Status();
}

TensorView bf16(void* data, std::initializer_list<int64_t> shape) { return make_tensor(data, DType::kBF16, shape); }
TensorView fp8(void* data, std::initializer_list<int64_t> shape) { return make_tensor(data, DType::kFP8E4M3, shape); }

}  // namespace

Status ReplicatedBuffer::upload(const void* host, size_t bytes, int copies, cudaStream_t stream) {
  if (copies < 1) return invalid_argument("copies", ">= 1", std::to_string(copies));
  stride_ = (bytes + kCopyAlignment - 1) / kCopyAlignment * kCopyAlignment;
  copies_ = copies;
  DSA_RETURN_IF_ERROR(memory_.allocate(stride_ * copies));
  DSA_CUDA_RETURN(cudaMemcpyAsync(memory_.get(), host, bytes, cudaMemcpyHostToDevice, stream));
  for (int i = 1; i < copies; ++i) {
    DSA_CUDA_RETURN(cudaMemcpyAsync(copy(i), memory_.get(), bytes, cudaMemcpyDeviceToDevice, stream));
  }
  return Status();
}

void* ReplicatedBuffer::copy(int i) const { return memory_.as<char>() + (i % copies_) * stride_; }

Status DeviceStep::init(const StepShape& shape, const HostWeights& w, const HostStepInputs& in,
                        const IndexerTokenRows& indexer_history, const HostCache& cache, int weight_copies,
                        ValueUpKernel value_up, bool projections_cublaslt, cublasHandle_t handle, cudaStream_t stream) {
  if (cache.first_block != 0 || cache.blocks != shape.cache_blocks()) {
    return invalid_argument("cache", "the whole cache (" + std::to_string(shape.cache_blocks()) + " blocks from 0)",
                            std::to_string(cache.blocks) + " blocks from " + std::to_string(cache.first_block));
  }
  s_ = shape;
  handle_ = handle;
  value_up_ = value_up;
  projections_cublaslt_ = projections_cublaslt;
  eps_ = w.eps;
  DSA_RETURN_IF_ERROR(q_norm_gamma_.upload(w.q_norm_gamma.data(), bytes_of(w.q_norm_gamma), weight_copies, stream));
  DSA_RETURN_IF_ERROR(kv_norm_gamma_.upload(w.kv_norm_gamma.data(), bytes_of(w.kv_norm_gamma), weight_copies, stream));
  DSA_RETURN_IF_ERROR(q_b_proj_.upload(w.q_b_proj.data(), bytes_of(w.q_b_proj), weight_copies, stream));
  DSA_RETURN_IF_ERROR(w_uk_t_.upload(w.w_uk_t.data(), bytes_of(w.w_uk_t), weight_copies, stream));
  DSA_RETURN_IF_ERROR(w_uv_.upload(w.w_uv.data(), bytes_of(w.w_uv), weight_copies, stream));
  const std::vector<float> scales = {w.q_scale, w.k_scale};
  DSA_RETURN_IF_ERROR(copy_to_device(scales, &scales_, stream));

  DSA_RETURN_IF_ERROR(copy_to_device(in.qkv, &qkv_, stream));
  DSA_RETURN_IF_ERROR(copy_to_device(in.slot_mapping, &slot_mapping_, stream));
  DSA_RETURN_IF_ERROR(copy_to_device(cache.bytes, &cache_fused_, stream));
  DSA_RETURN_IF_ERROR(copy_to_device(cache.bytes, &cache_stock_, stream));

  const size_t m = shape.m, H = shape.H;
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * shape.Q, &q_c_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * shape.L, &kv_c_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * shape.q_width(), &q_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(m * H * shape.L, &q_fp8_fused_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * H * shape.L, &latent_fused_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(4 * m * H, &lse_fused_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * H * shape.V, &out_fused_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * H * shape.L, &q_bf16_stock_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(m * H * shape.L, &q_fp8_stock_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * H * shape.L, &latent_stock_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(4 * m * H, &lse_stock_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * H * shape.V, &out_stock_, stream));
  const int64_t counters = sparse_mla_split_counter_count(shape.m, shape.H, kTopKWidth);
  DSA_RETURN_IF_ERROR(split_counters_.allocate(size_t(counters) * sizeof(int32_t)));
  DSA_CUDA_RETURN(cudaMemsetAsync(split_counters_.get(), 0, split_counters_.bytes(), stream));
  const int64_t partials = sparse_mla_split_partials_count(shape.m, shape.H, kTopKWidth);
  if (partials > 0) DSA_RETURN_IF_ERROR(split_partials_.allocate(size_t(partials) * sizeof(float)));
  DSA_RETURN_IF_ERROR(error_counts_.allocate(kErrorCounters * sizeof(unsigned int)));
  DSA_CUDA_RETURN(cudaMemsetAsync(error_counts_.get(), 0, error_counts_.bytes(), stream));

  DSA_RETURN_IF_ERROR(copy_to_device(w.index_k_norm_weight, &index_k_norm_weight_, stream));
  DSA_RETURN_IF_ERROR(copy_to_device(w.index_k_norm_bias, &index_k_norm_bias_, stream));
  DSA_RETURN_IF_ERROR(copy_to_device(w.index_ape, &index_ape_, stream));
  DSA_RETURN_IF_ERROR(index_wq_b_.upload(w.index_wq_b.data(), bytes_of(w.index_wq_b), weight_copies, stream));
  DSA_RETURN_IF_ERROR(index_wk_.upload(w.index_wk.data(), bytes_of(w.index_wk), weight_copies, stream));
  DSA_RETURN_IF_ERROR(
      index_weights_proj_.upload(w.index_weights_proj.data(), bytes_of(w.index_weights_proj), weight_copies, stream));
  DSA_RETURN_IF_ERROR(index_compress_gate_.upload(w.index_compress_gate.data(), bytes_of(w.index_compress_gate),
                                                  weight_copies, stream));
  DSA_RETURN_IF_ERROR(copy_to_device(in.hidden, &hidden_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * kIndexerHeads * kIndexerDim, &index_q_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * kIndexerDim, &index_k_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(4 * m * kIndexerHeads, &index_head_weights_, stream));
  DSA_RETURN_IF_ERROR(allocate_poisoned(2 * m * kIndexerDim, &index_gate_, stream));
  DSA_RETURN_IF_ERROR(IndexerProjectContext::create(&indexer_project_context_));
  DSA_RETURN_IF_ERROR(copy_to_device(in.positions, &positions_, stream));
  DSA_RETURN_IF_ERROR(copy_to_device(in.token_requests, &token_requests_, stream));
  const std::vector<int32_t> block_table = make_indexer_block_table(shape);
  DSA_RETURN_IF_ERROR(copy_to_device(block_table, &indexer_block_table_, stream));
  // Zeroed, as the CPU reference's state starts: the whole states compare.
  const size_t ring_bytes = size_t(shape.indexer_requests()) * 2 * kIndexerRing * kIndexerDim * sizeof(uint16_t);
  DSA_RETURN_IF_ERROR(allocate_filled(ring_bytes, 0, &indexer_ring_, stream));
  DSA_RETURN_IF_ERROR(allocate_filled(size_t(shape.cache_blocks()) * kIndexerPageBytes, 0, &indexer_k_cache_, stream));
  const IndexerPlan plan = shape.indexer_plan();
  DSA_RETURN_IF_ERROR(check_indexer_plan(plan));
  DSA_RETURN_IF_ERROR(allocate_poisoned(size_t(indexer_workspace_layout(plan).bytes), &indexer_workspace_, stream));
  int64_t baseline_bytes = 0;
  DSA_RETURN_IF_ERROR(indexer_select_baseline_workspace_bytes(plan, &baseline_bytes));
  DSA_RETURN_IF_ERROR(select_baseline_workspace_.allocate(size_t(baseline_bytes)));
  const size_t row_bytes = m * kTopKWidth * sizeof(int32_t);
  DSA_RETURN_IF_ERROR(allocate_filled(row_bytes, kPoisonSlotByte, &topk_slots_fused_, stream));
  DSA_RETURN_IF_ERROR(allocate_filled(row_bytes, kPoisonSlotByte, &topk_slots_stock_, stream));
  DSA_RETURN_IF_ERROR(allocate_filled(row_bytes, kPoisonSlotByte, &topk_positions_stock_, stream));
  DSA_RETURN_IF_ERROR(prefill_indexer(indexer_history, stream));
  // The host vectors (`scales`, `block_table` too) and the prefill's device
  // rows must outlive the copies and launches that read them.
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  return Status();
}

// indexer_prefill of each indexer request over the context rows before its
// first token (StepShape), on the device copy of `history`.
Status DeviceStep::prefill_indexer(const IndexerTokenRows& history, cudaStream_t stream) {
  bench::DeviceMemory index_k, gate;
  DSA_RETURN_IF_ERROR(copy_to_device(history.index_k, &index_k, stream));
  DSA_RETURN_IF_ERROR(copy_to_device(history.gate, &gate, stream));
  for (int request = 0; request < s_.indexer_requests(); ++request) {
    const int64_t tokens = s_.indexer_prefill_tokens(request);
    if (tokens == 0) continue;  // no context: the state starts empty
    IndexerPrefillArgs args;
    args.plan = s_.indexer_plan();
    args.index_k = bf16(index_k.get(), {tokens, kIndexerDim});
    args.gate = bf16(gate.get(), {tokens, kIndexerDim});
    args.k_norm_weight = make_tensor(index_k_norm_weight_.get(), DType::kF32, {kIndexerDim});
    args.k_norm_bias = make_tensor(index_k_norm_bias_.get(), DType::kF32, {kIndexerDim});
    args.ape = make_tensor(index_ape_.get(), DType::kF32, {kIndexerPoolSize, kIndexerDim});
    args.request = request;
    args.state = indexer_state();
    args.error_count = error_counter(kIndexerState);
    DSA_RETURN_IF_ERROR(indexer_prefill(args, stream));
  }
  // index_k and gate are freed on return: wait for the launches that read them.
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  return Status();
}

TensorView DeviceStep::q_view() const { return bf16(q_.get(), {s_.m, s_.H, s_.P}); }

TensorView DeviceStep::cache_view(void* data) const { return fp8(data, {s_.cache_blocks(), kCacheBlockSize, s_.L}); }

KvCacheWrite DeviceStep::cache_write(void* cache, unsigned int* error_count) const {
  return KvCacheWrite{bf16(kv_c_.get(), {s_.m, s_.L}), cache_view(cache),
                      make_tensor(slot_mapping_.get(), DType::kI64, {s_.m}),
                      make_tensor(scales_.as<float>() + 1, DType::kF32, {1}), error_count};
}

IndexerState DeviceStep::indexer_state() const {
  const int64_t requests = s_.indexer_requests();
  return IndexerState{make_tensor(indexer_block_table_.get(), DType::kI32, {requests, s_.cache_blocks()}),
                      bf16(indexer_ring_.get(), {requests, 2, kIndexerRing, kIndexerDim}),
                      make_tensor(indexer_k_cache_.get(), DType::kU8, {s_.cache_blocks(), kIndexerPageBytes})};
}

IndexerSelectArgs DeviceStep::indexer_select_args(void* slots, void* topk_positions,
                                                  unsigned int* error_count) const {
  IndexerSelectArgs args;
  args.plan = s_.indexer_plan();
  args.positions = make_tensor(positions_.get(), DType::kI64, {s_.m});
  args.token_requests = make_tensor(token_requests_.get(), DType::kI32, {s_.m});
  args.state = indexer_state();
  args.workspace = make_tensor(indexer_workspace_.get(), DType::kU8, {int64_t(indexer_workspace_.bytes())});
  if (topk_positions != nullptr) args.topk_positions = make_tensor(topk_positions, DType::kI32, {s_.m, kTopKWidth});
  args.slots = make_tensor(slots, DType::kI32, {s_.m, kTopKWidth});
  args.error_count = error_count;
  return args;
}

// cuBLAS runs on the stream its handle is bound to, whatever the caller
// passes: a mismatch would silently break the order of the chain.
Status DeviceStep::check_cublas_stream(cudaStream_t stream) const {
  cudaStream_t bound = nullptr;
  DSA_CUBLAS_RETURN(cublasGetStream(handle_, &bound));
  if (bound != stream) {
    return invalid_argument("stream", "the stream the cuBLAS handle is bound to", "another stream");
  }
  return Status();
}

Status DeviceStep::norm(cudaStream_t stream, int copy) const {
  return qkv_rmsnorm(bf16(qkv_.get(), {s_.m, s_.qkv_width()}), bf16(q_norm_gamma_.copy(copy), {s_.Q}),
                     bf16(kv_norm_gamma_.copy(copy), {s_.L}), eps_, bf16(q_c_.get(), {s_.m, s_.Q}),
                     bf16(kv_c_.get(), {s_.m, s_.L}), stream);
}

// q [m, H*P] = q_c [m, Q] x W^T with W [H*P, Q] row-major (nn.Linear), as
// PyTorch runs F.linear. Column-major, that is q^T [H*P, m] = W [H*P, Q] x
// q_c^T [Q, m]: W row-major is a column-major [Q, H*P] matrix (ld Q) taken
// transposed; q_c row-major is column-major [Q, m] (ld Q); q row-major is
// column-major [H*P, m] (ld H*P).
Status DeviceStep::q_b_proj(cudaStream_t stream, int copy) const {
  DSA_RETURN_IF_ERROR(check_cublas_stream(stream));
  const float one = 1.0f, zero = 0.0f;
  const int n_out = static_cast<int>(s_.q_width());
  DSA_CUBLAS_RETURN(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, /*m=*/n_out, /*n=*/s_.m, /*k=*/s_.Q, &one,  //
                                 q_b_proj_.copy(copy), CUDA_R_16BF, /*lda=*/s_.Q,                            //
                                 q_c_.get(), CUDA_R_16BF, /*ldb=*/s_.Q,                                       //
                                 &zero, q_.get(), CUDA_R_16BF, /*ldc=*/n_out,                                 //
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status();
}

Status DeviceStep::fused_absorb(cudaStream_t stream, int copy) const {
  const KvCacheWrite write = cache_write(cache_fused_.get(), error_counter(kFusedCacheWrite));
  HeadGemvArgs args;
  args.x = q_view();
  args.weight = bf16(w_uk_t_.copy(copy), {s_.H, s_.P, s_.L});
  args.out = fp8(q_fp8_fused_.get(), {s_.m, s_.H, s_.L});
  args.scale = make_tensor(scales_.get(), DType::kF32, {1});
  args.cache = &write;
  args.sums = s_.head_gemv_sums;
  return head_gemv(args, stream);  // the table's tactic, absorb_tactic(s_), which the check's reference takes
}

// index_q, index_k, head_weights and gate of the step's q_c and hidden states.
Status DeviceStep::indexer_project(cudaStream_t stream, int copy) const {
  IndexerProjectArgs args;
  args.plan = s_.indexer_plan();
  args.q_c = bf16(q_c_.get(), {s_.m, s_.Q});
  args.x = bf16(hidden_.get(), {s_.m, s_.D});
  args.wq_b = bf16(index_wq_b_.copy(copy), {kIndexerHeads * kIndexerDim, s_.Q});
  args.wk = bf16(index_wk_.copy(copy), {kIndexerDim, s_.D});
  args.weights_proj = bf16(index_weights_proj_.copy(copy), {kIndexerHeads, s_.D});
  args.compress_gate = bf16(index_compress_gate_.copy(copy), {kIndexerDim, s_.D});
  args.index_q = bf16(index_q_.get(), {s_.m, kIndexerHeads, kIndexerDim});
  args.index_k = bf16(index_k_.get(), {s_.m, kIndexerDim});
  args.head_weights = make_tensor(index_head_weights_.get(), DType::kF32, {s_.m, kIndexerHeads});
  args.gate = bf16(index_gate_.get(), {s_.m, kIndexerDim});
  if (projections_cublaslt_) return dsa::indexer_project(args, indexer_project_context_, stream);
  return indexer_project_gemv(args, stream);
}

// Both chains run this launch at the same positions, and the timings replay
// it many times, on one shared state. That is sound because prepare at
// positions it already ran at rewrites the same bytes (the reference's steps
// 1-4, include/dsa_decode/indexer.h): the q quant and the folded weights
// depend on the step's own rows only; stashing puts the same LayerNormed k and
// gate into the same ring slots; a pool completing at position p reads the
// rows of p-3..p, which are this step's tokens (just restashed) or the up to
// three rows before the request's first token, which no token of the step
// overwrites (the ring rule: a request's step tokens and the three before them
// fit the ring without wrapping), so it writes the same pooled bytes to the
// same page entry. Select only reads the state. Hence no restore between runs.
Status DeviceStep::indexer_prepare(cudaStream_t stream, int /*copy: no weights*/) const {
  IndexerPrepareArgs args;
  args.plan = s_.indexer_plan();
  args.index_q = bf16(index_q_.get(), {s_.m, kIndexerHeads, kIndexerDim});
  args.index_k = bf16(index_k_.get(), {s_.m, kIndexerDim});
  args.head_weights = make_tensor(index_head_weights_.get(), DType::kF32, {s_.m, kIndexerHeads});
  args.gate = bf16(index_gate_.get(), {s_.m, kIndexerDim});
  args.k_norm_weight = make_tensor(index_k_norm_weight_.get(), DType::kF32, {kIndexerDim});
  args.k_norm_bias = make_tensor(index_k_norm_bias_.get(), DType::kF32, {kIndexerDim});
  args.ape = make_tensor(index_ape_.get(), DType::kF32, {kIndexerPoolSize, kIndexerDim});
  args.positions = make_tensor(positions_.get(), DType::kI64, {s_.m});
  args.token_requests = make_tensor(token_requests_.get(), DType::kI32, {s_.m});
  args.state = indexer_state();
  args.workspace = make_tensor(indexer_workspace_.get(), DType::kU8, {int64_t(indexer_workspace_.bytes())});
  args.error_count = error_counter(kIndexerState);
  return dsa::indexer_prepare(args, stream);
}

// The fused attention needs the slots only: no request-local positions.
Status DeviceStep::fused_indexer_select(cudaStream_t stream, int /*copy: no weights*/) const {
  return indexer_select(indexer_select_args(topk_slots_fused_.get(), nullptr, error_counter(kFusedIndexerSelect)),
                        stream);
}

// The baseline remaps from the positions, so it writes them too.
Status DeviceStep::stock_indexer_select(cudaStream_t stream, int /*copy: no weights*/) const {
  const IndexerSelectArgs args =
      indexer_select_args(topk_slots_stock_.get(), topk_positions_stock_.get(), error_counter(kStockIndexerSelect));
  return indexer_select_baseline(args, select_baseline_workspace_.get(),
                                 static_cast<int64_t>(select_baseline_workspace_.bytes()), stream);
}

// q_fp8 [m, H, L] and the cache attend over the top-k slots [m, 2176] into
// latent [m, H, L] BF16 and lse [m, H] f32.
Status DeviceStep::attention(void* q_fp8, void* cache, void* topk_slots, void* latent, void* lse,
                             unsigned int* error_count, cudaStream_t stream) const {
  SparseMlaArgs args;
  args.q = fp8(q_fp8, {s_.m, s_.H, s_.L});
  args.q_scale = make_tensor(scales_.get(), DType::kF32, {1});
  args.kv_cache = cache_view(cache);
  args.k_scale = make_tensor(scales_.as<float>() + 1, DType::kF32, {1});
  args.indices = make_tensor(topk_slots, DType::kI32, {s_.m, kTopKWidth});
  args.softmax_scale = attention_softmax_scale(s_);
  args.latent = bf16(latent, {s_.m, s_.H, s_.L});
  args.lse = make_tensor(lse, DType::kF32, {s_.m, s_.H});
  args.split_counters = make_tensor(split_counters_.get(), DType::kI32,
                                    {int64_t(split_counters_.bytes() / sizeof(int32_t))});
  if (split_partials_.bytes() > 0) {
    args.split_partials = make_tensor(split_partials_.get(), DType::kF32,
                                      {int64_t(split_partials_.bytes() / sizeof(float))});
  }
  args.error_count = error_count;
  args.splits = s_.attention_splits;
  return sparse_mla(args, stream);
}

Status DeviceStep::fused_attention(cudaStream_t stream, int /*copy: no weights*/) const {
  return attention(q_fp8_fused_.get(), cache_fused_.get(), topk_slots_fused_.get(), latent_fused_.get(),
                   lse_fused_.get(), error_counter(kFusedAttention), stream);
}

Status DeviceStep::value_up_bmm(void* latent, void* out, cudaStream_t stream, int copy) const {
  DSA_RETURN_IF_ERROR(check_cublas_stream(stream));
  return cublas_head_bmm(handle_, bf16(latent, {s_.m, s_.H, s_.L}), bf16(w_uv_.copy(copy), {s_.H, s_.L, s_.V}),
                         bf16(out, {s_.m, s_.H, s_.V}));
}

Status DeviceStep::fused_value_up(cudaStream_t stream, int copy) const {
  if (value_up_ == ValueUpKernel::kCublasBmm) return value_up_bmm(latent_fused_.get(), out_fused_.get(), stream, copy);
  HeadGemvArgs args;
  args.x = bf16(latent_fused_.get(), {s_.m, s_.H, s_.L});
  args.weight = bf16(w_uv_.copy(copy), {s_.H, s_.L, s_.V});
  args.out = bf16(out_fused_.get(), {s_.m, s_.H, s_.V});
  args.sums = s_.head_gemv_sums;
  return head_gemv(args, stream);  // the table's tactic, value_up_tactic(s_)
}

Status DeviceStep::stock_cache_write(cudaStream_t stream, int /*copy: no weights*/) const {
  return stock_concat_and_cache_mla(cache_write(cache_stock_.get(), error_counter(kStockCacheWrite)), stream);
}

Status DeviceStep::stock_absorb_bmm(cudaStream_t stream, int copy) const {
  DSA_RETURN_IF_ERROR(check_cublas_stream(stream));
  return cublas_head_bmm(handle_, q_view(), bf16(w_uk_t_.copy(copy), {s_.H, s_.P, s_.L}),
                         bf16(q_bf16_stock_.get(), {s_.m, s_.H, s_.L}));
}

Status DeviceStep::stock_fp8_quant(cudaStream_t stream, int /*copy: no weights*/) const {
  return stock_static_fp8_quant(bf16(q_bf16_stock_.get(), {s_.m, s_.H, s_.L}),
                                fp8(q_fp8_stock_.get(), {s_.m, s_.H, s_.L}),
                                make_tensor(scales_.get(), DType::kF32, {1}), stream);
}

// What stock engines issue before a split-K attention whose counters do not
// reset themselves.
Status DeviceStep::stock_counter_memset(cudaStream_t stream, int /*copy: no weights*/) const {
  DSA_CUDA_RETURN(cudaMemsetAsync(split_counters_.get(), 0, split_counters_.bytes(), stream));
  return Status();
}

Status DeviceStep::stock_attention(cudaStream_t stream, int /*copy: no weights*/) const {
  return attention(q_fp8_stock_.get(), cache_stock_.get(), topk_slots_stock_.get(), latent_stock_.get(),
                   lse_stock_.get(), error_counter(kStockAttention), stream);
}

Status DeviceStep::stock_value_up_bmm(cudaStream_t stream, int copy) const {
  return value_up_bmm(latent_stock_.get(), out_stock_.get(), stream, copy);
}

Status DeviceStep::download(cudaStream_t stream, StepOutputs* out) const {
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  DSA_CUDA_RETURN(cudaGetLastError());
  DSA_RETURN_IF_ERROR(copy_to_host(q_c_, &out->q_c, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(kv_c_, &out->kv_c, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(q_, &out->q, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(index_q_, &out->indexer_projections.index_q, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(index_k_, &out->indexer_projections.index_k, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(index_head_weights_, &out->indexer_projections.head_weights, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(index_gate_, &out->indexer_projections.gate, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(q_fp8_fused_, &out->q_fp8_fused, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(q_fp8_stock_, &out->q_fp8_stock, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(latent_fused_, &out->latent_fused, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(latent_stock_, &out->latent_stock, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(lse_fused_, &out->lse_fused, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(lse_stock_, &out->lse_stock, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(out_fused_, &out->out_fused, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(out_stock_, &out->out_stock, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(cache_fused_, &out->cache_fused, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(cache_stock_, &out->cache_stock, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(topk_slots_fused_, &out->topk_slots_fused, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(topk_slots_stock_, &out->topk_slots_stock, stream));
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(s_.indexer_plan());
  out->indexer_logits.resize(size_t(s_.m) * layout.logits_stride);
  DSA_CUDA_RETURN(cudaMemcpyAsync(out->indexer_logits.data(), indexer_workspace_.as<char>() + layout.logits,
                                  bytes_of(out->indexer_logits), cudaMemcpyDeviceToHost, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(indexer_ring_, &out->indexer_ring, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(indexer_k_cache_, &out->indexer_k_cache, stream));
  std::vector<unsigned int> counts;
  DSA_RETURN_IF_ERROR(copy_to_host(error_counts_, &counts, stream));
  std::vector<int32_t> split_counters;
  DSA_RETURN_IF_ERROR(copy_to_host(split_counters_, &split_counters, stream));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  out->skipped_slots_fused = counts[kFusedCacheWrite];
  out->skipped_slots_stock = counts[kStockCacheWrite];
  out->bad_indices_fused = counts[kFusedAttention];
  out->bad_indices_stock = counts[kStockAttention];
  out->indexer_state_errors = counts[kIndexerState];
  out->indexer_select_errors_fused = counts[kFusedIndexerSelect];
  out->indexer_select_errors_stock = counts[kStockIndexerSelect];
  out->counters_zero = std::all_of(split_counters.begin(), split_counters.end(), [](int32_t c) { return c == 0; });
  return Status();
}

}  // namespace dsa::cli
