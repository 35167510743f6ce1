#include "device_layer.h"

#include <initializer_list>
#include <string>
#include <vector>

#include "device_buffers.h"
#include "dsa_decode/cuda_check.h"

namespace dsa::cli {

namespace {

constexpr size_t kWeightAlignment = 256;  // what cudaMalloc gives: every weight of every copy as aligned

TensorView bf16(void* data, std::initializer_list<int64_t> shape) { return make_tensor(data, DType::kBF16, shape); }

// Every weight of the layer in one copy's order: the DsaLayerWeights field,
// its dtype and shape, and its host values. `visit(field, dtype, shape, host)`.
template <class Visit>
void for_each_weight(const StepShape& s, const HostWeights& w, Visit&& visit) {
  const int64_t D = s.D, H = s.H, Q = s.Q, L = s.L, P = s.P, V = s.V;
  const int64_t index_rows = int64_t{s.index_heads} * kIndexerDim;
  visit(&DsaLayerWeights::fused_qkv_a_proj, DType::kBF16, {Q + L, D}, w.fused_qkv_a_proj.data());
  visit(&DsaLayerWeights::q_a_norm, DType::kBF16, {Q}, w.q_norm_gamma.data());
  visit(&DsaLayerWeights::kv_a_norm, DType::kBF16, {L}, w.kv_norm_gamma.data());
  visit(&DsaLayerWeights::q_b_proj, DType::kBF16, {H * P, Q}, w.q_b_proj.data());
  visit(&DsaLayerWeights::w_uk_t, DType::kBF16, {H, P, L}, w.w_uk_t.data());
  visit(&DsaLayerWeights::w_uv, DType::kBF16, {H, L, V}, w.w_uv.data());
  visit(&DsaLayerWeights::o_proj, DType::kBF16, {D, H * V}, w.o_proj.data());
  visit(&DsaLayerWeights::q_scale, DType::kF32, {1}, &w.q_scale);
  visit(&DsaLayerWeights::k_scale, DType::kF32, {1}, &w.k_scale);
  visit(&DsaLayerWeights::index_wq_b, DType::kBF16, {index_rows, Q}, w.index_wq_b.data());
  visit(&DsaLayerWeights::index_wk, DType::kBF16, {kIndexerDim, D}, w.index_wk.data());
  visit(&DsaLayerWeights::index_weights_proj, DType::kBF16, {int64_t{s.index_heads}, D}, w.index_weights_proj.data());
  visit(&DsaLayerWeights::index_compress_gate, DType::kBF16, {kIndexerDim, D}, w.index_compress_gate.data());
  visit(&DsaLayerWeights::index_k_norm_weight, DType::kF32, {kIndexerDim}, w.index_k_norm_weight.data());
  visit(&DsaLayerWeights::index_k_norm_bias, DType::kF32, {kIndexerDim}, w.index_k_norm_bias.data());
  visit(&DsaLayerWeights::index_ape, DType::kF32, {int64_t{s.index_pool}, kIndexerDim}, w.index_ape.data());
}

size_t aligned(size_t bytes) { return (bytes + kWeightAlignment - 1) / kWeightAlignment * kWeightAlignment; }

size_t element_count(std::initializer_list<int64_t> shape) {
  size_t count = 1;
  for (int64_t d : shape) count *= size_t(d);
  return count;
}

using WeightField = TensorView DsaLayerWeights::*;

}  // namespace

Status DeviceLayer::init(const StepShape& shape, const HostWeights& w, const HostStepInputs& in,
                         const IndexerTokenRows& indexer_history, const HostCache& cache, int weight_copies,
                         cudaStream_t stream) {
  if (cache.first_block != 0 || cache.blocks != shape.cache_blocks()) {
    return invalid_argument("cache", "the whole cache (" + std::to_string(shape.cache_blocks()) + " blocks from 0)",
                            std::to_string(cache.blocks) + " blocks from " + std::to_string(cache.first_block));
  }
  if (weight_copies < 1) return invalid_argument("weight_copies", ">= 1", std::to_string(weight_copies));
  s_ = shape;
  weight_copies_ = weight_copies;

  // Copy 0 from the host, weight by weight; the others copied from it on the device.
  copy_bytes_ = 0;
  for_each_weight(s_, w, [&](WeightField, DType dtype, std::initializer_list<int64_t> dims, const void*) {
    copy_bytes_ += aligned(element_count(dims) * dtype_size(dtype));
  });
  DSA_RETURN_IF_ERROR(weights_.allocate(copy_bytes_ * size_t(weight_copies)));
  size_t offset = 0;
  Status uploaded;
  for_each_weight(s_, w, [&](WeightField, DType dtype, std::initializer_list<int64_t> dims, const void* host) {
    const size_t bytes = element_count(dims) * dtype_size(dtype);
    if (uploaded.ok()) {
      uploaded = cuda_status(cudaMemcpyAsync(weights_.as<char>() + offset, host, bytes, cudaMemcpyHostToDevice, stream),
                             "weight upload");
    }
    offset += aligned(bytes);
  });
  DSA_RETURN_IF_ERROR(uploaded);
  for (int copy = 1; copy < weight_copies; ++copy) {
    DSA_CUDA_RETURN(cudaMemcpyAsync(weights_.as<char>() + size_t(copy) * copy_bytes_, weights_.get(), copy_bytes_,
                                    cudaMemcpyDeviceToDevice, stream));
  }

  DSA_RETURN_IF_ERROR(upload(in.hidden, &hidden_, stream));
  DSA_RETURN_IF_ERROR(upload(in.positions, &positions_, stream));
  DSA_RETURN_IF_ERROR(upload(in.token_requests, &token_requests_, stream));
  DSA_RETURN_IF_ERROR(upload(in.slot_mapping, &slot_mapping_, stream));
  DSA_RETURN_IF_ERROR(upload(cache.bytes, &cache_fused_, stream));
  DSA_RETURN_IF_ERROR(upload(cache.bytes, &cache_stock_, stream));
  DSA_RETURN_IF_ERROR(out_.allocate(size_t(s_.m) * s_.D * sizeof(uint16_t)));
  DSA_RETURN_IF_ERROR(allocate_filled(kErrorCounters * sizeof(unsigned int), 0, &error_counts_, stream));

  const std::vector<int32_t> block_table = make_indexer_block_table(s_);
  DSA_RETURN_IF_ERROR(upload(block_table, &indexer_block_table_, stream));
  // Zeroed, as the CPU reference's state starts: the whole states compare.
  const size_t ring_bytes = size_t(s_.indexer_requests()) * 2 * s_.indexer_ring() * kIndexerDim * sizeof(uint16_t);
  DSA_RETURN_IF_ERROR(allocate_filled(ring_bytes, 0, &indexer_ring_, stream));
  DSA_RETURN_IF_ERROR(allocate_filled(size_t(s_.cache_blocks()) * s_.indexer_page_bytes(), 0, &indexer_k_cache_, stream));

  DSA_RETURN_IF_ERROR(prefill_indexer(indexer_history, stream));
  // The host vectors (the block table too) must outlive the copies that read them.
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  return Status();
}

DsaLayerWeights DeviceLayer::weights(int copy) const {
  DsaLayerWeights views;
  char* base = weights_.as<char>() + size_t(copy % weight_copies_) * copy_bytes_;
  size_t offset = 0;
  // The host values are not read here: an empty HostWeights gives the same layout.
  for_each_weight(s_, HostWeights{},
                  [&](WeightField field, DType dtype, std::initializer_list<int64_t> dims, const void*) {
                    views.*field = make_tensor(base + offset, dtype, dims);
                    offset += aligned(element_count(dims) * dtype_size(dtype));
                  });
  return views;
}

// indexer_prefill of each indexer request over the context rows before its
// first token (StepShape), on the device copy of `history`.
Status DeviceLayer::prefill_indexer(const IndexerTokenRows& history, cudaStream_t stream) {
  bench::DeviceMemory index_k, gate;  // [prefill tokens, 128] BF16 each
  DSA_RETURN_IF_ERROR(upload(history.index_k, &index_k, stream));
  DSA_RETURN_IF_ERROR(upload(history.gate, &gate, stream));
  const DsaLayerWeights w = weights(0);
  for (int request = 0; request < s_.indexer_requests(); ++request) {
    const int64_t tokens = s_.indexer_prefill_tokens(request);
    if (tokens == 0) continue;  // no context: the state starts empty
    IndexerPrefillArgs args;
    args.plan = s_.indexer_plan();
    args.index_k = bf16(index_k.get(), {tokens, kIndexerDim});
    args.gate = bf16(gate.get(), {tokens, kIndexerDim});
    args.k_norm_weight = w.index_k_norm_weight;
    args.k_norm_bias = w.index_k_norm_bias;
    args.ape = w.index_ape;
    args.request = request;
    args.state = indexer_state();
    args.error_count = error_counter(kPrefill);
    DSA_RETURN_IF_ERROR(indexer_prefill(args, stream));
  }
  // index_k and gate are freed on return: wait for the launches that read them.
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  return Status();
}

IndexerState DeviceLayer::indexer_state() const {
  const int64_t requests = s_.indexer_requests();
  return IndexerState{make_tensor(indexer_block_table_.get(), DType::kI32, {requests, s_.cache_blocks()}),
                      bf16(indexer_ring_.get(), {requests, 2, s_.indexer_ring(), kIndexerDim}),
                      make_tensor(indexer_k_cache_.get(), DType::kU8, {s_.cache_blocks(), s_.indexer_page_bytes()})};
}

TensorView DeviceLayer::cache_view(DsaPath path) const {
  return make_tensor((path == DsaPath::kFused ? cache_fused_ : cache_stock_).get(), DType::kFP8E4M3,
                     {s_.cache_blocks(), kCacheBlockSize, s_.L});
}

// Both paths run indexer_prepare at the same positions on this one state,
// and the timings replay it many times. That is sound because prepare at
// positions it already ran at rewrites the same bytes (the reference's steps
// 1-4, include/dsa_decode/indexer.h): the q quant and the folded weights
// depend on the step's own rows only; stashing puts the same LayerNormed k and
// gate into the same ring slots; a pool completing at position p reads the
// rows of p-S+1..p, which are this step's tokens (just restashed) or the up to
// S - 1 rows before the request's first token, which no token of the step
// overwrites (the ring rule: a request's step tokens and the S - 1 before them
// fit the ring without wrapping), so it writes the same pooled bytes to the
// same page entry. Select only reads the state. Hence no restore between runs.
// The step's own rows are the same in every run because the projections'
// inputs are: the hidden states, and q_c, which the same qkv_a_proj and norm
// make from them in both paths.
DsaStepArgs DeviceLayer::step_args(DsaPath path) const {
  DsaStepArgs a;
  a.hidden = bf16(hidden_.get(), {s_.m, s_.D});
  a.positions = make_tensor(positions_.get(), DType::kI64, {s_.m});
  a.token_requests = make_tensor(token_requests_.get(), DType::kI32, {s_.m});
  a.slot_mapping = make_tensor(slot_mapping_.get(), DType::kI64, {s_.m});
  a.kv_cache = cache_view(path);
  a.indexer = indexer_state();
  a.out = bf16(out_.get(), {s_.m, s_.D});
  a.error_count = error_counter(path == DsaPath::kFused ? kFusedStep : kStockStep);
  return a;
}

}  // namespace dsa::cli
