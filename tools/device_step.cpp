#include "device_step.h"

#include <algorithm>
#include <string>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/norm.h"
#include "dsa_decode/sparse_mla.h"
#include "dsa_decode/stock.h"
#include "reference_chain.h"

namespace dsa::cli {

namespace {

constexpr size_t kCopyAlignment = 256;  // what cudaMalloc gives: every copy as aligned as the first
constexpr int kPoisonByte = 0xFF;       // BF16 0xFFFF and e4m3 0xFF are NaN: an unwritten output fails its check

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

Status allocate_poisoned(size_t bytes, bench::DeviceMemory* device, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(device->allocate(bytes));
  DSA_CUDA_RETURN(cudaMemsetAsync(device->get(), kPoisonByte, bytes, stream));
  return Status();
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

Status DeviceStep::init(const StepShape& shape, const HostWeights& w, const HostStepInputs& in, const HostCache& cache,
                        int weight_copies, cublasHandle_t handle, cudaStream_t stream) {
  if (cache.first_block != 0 || cache.blocks != shape.cache_blocks()) {
    return invalid_argument("cache", "the whole cache (" + std::to_string(shape.cache_blocks()) + " blocks from 0)",
                            std::to_string(cache.blocks) + " blocks from " + std::to_string(cache.first_block));
  }
  s_ = shape;
  handle_ = handle;
  eps_ = w.eps;
  DSA_RETURN_IF_ERROR(q_norm_gamma_.upload(w.q_norm_gamma.data(), bytes_of(w.q_norm_gamma), weight_copies, stream));
  DSA_RETURN_IF_ERROR(kv_norm_gamma_.upload(w.kv_norm_gamma.data(), bytes_of(w.kv_norm_gamma), weight_copies, stream));
  DSA_RETURN_IF_ERROR(q_b_proj_.upload(w.q_b_proj.data(), bytes_of(w.q_b_proj), weight_copies, stream));
  DSA_RETURN_IF_ERROR(w_uk_t_.upload(w.w_uk_t.data(), bytes_of(w.w_uk_t), weight_copies, stream));
  DSA_RETURN_IF_ERROR(w_uv_.upload(w.w_uv.data(), bytes_of(w.w_uv), weight_copies, stream));
  const std::vector<float> scales = {w.q_scale, w.k_scale};
  DSA_RETURN_IF_ERROR(copy_to_device(scales, &scales_, stream));

  DSA_RETURN_IF_ERROR(copy_to_device(in.qkv, &qkv_, stream));
  DSA_RETURN_IF_ERROR(copy_to_device(in.slot_mapping, &slots_, stream));
  DSA_RETURN_IF_ERROR(copy_to_device(in.topk_slots, &topk_slots_, stream));
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
  DSA_RETURN_IF_ERROR(error_counts_.allocate(4 * sizeof(unsigned int)));
  DSA_CUDA_RETURN(cudaMemsetAsync(error_counts_.get(), 0, error_counts_.bytes(), stream));
  // The host vectors (`scales` too) must outlive the copies from them.
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  return Status();
}

TensorView DeviceStep::q_view() const { return bf16(q_.get(), {s_.m, s_.H, s_.P}); }

TensorView DeviceStep::cache_view(void* data) const { return fp8(data, {s_.cache_blocks(), kCacheBlockSize, s_.L}); }

KvCacheWrite DeviceStep::cache_write(void* cache, unsigned int* error_count) const {
  return KvCacheWrite{bf16(kv_c_.get(), {s_.m, s_.L}), cache_view(cache),
                      make_tensor(slots_.get(), DType::kI64, {s_.m}),
                      make_tensor(scales_.as<float>() + 1, DType::kF32, {1}), error_count};
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
  const KvCacheWrite write = cache_write(cache_fused_.get(), error_counts_.as<unsigned int>());
  HeadGemvArgs args;
  args.x = q_view();
  args.weight = bf16(w_uk_t_.copy(copy), {s_.H, s_.P, s_.L});
  args.out = fp8(q_fp8_fused_.get(), {s_.m, s_.H, s_.L});
  args.scale = make_tensor(scales_.get(), DType::kF32, {1});
  args.cache = &write;
  const HeadGemvTactic tactic = absorb_tactic(s_);
  return head_gemv(args, stream, &tactic);
}

// q_fp8 [m, H, L] and the cache attend over the step's top-k slots into
// latent [m, H, L] BF16 and lse [m, H] f32.
Status DeviceStep::attention(void* q_fp8, void* cache, void* latent, void* lse, unsigned int* error_count,
                             cudaStream_t stream) const {
  SparseMlaArgs args;
  args.q = fp8(q_fp8, {s_.m, s_.H, s_.L});
  args.q_scale = make_tensor(scales_.get(), DType::kF32, {1});
  args.kv_cache = cache_view(cache);
  args.k_scale = make_tensor(scales_.as<float>() + 1, DType::kF32, {1});
  args.indices = make_tensor(topk_slots_.get(), DType::kI32, {s_.m, kTopKWidth});
  args.softmax_scale = attention_softmax_scale(s_);
  args.latent = bf16(latent, {s_.m, s_.H, s_.L});
  args.lse = make_tensor(lse, DType::kF32, {s_.m, s_.H});
  args.split_counters = make_tensor(split_counters_.get(), DType::kI32,
                                    {int64_t(split_counters_.bytes() / sizeof(int32_t))});
  args.error_count = error_count;
  return sparse_mla(args, stream);
}

Status DeviceStep::fused_attention(cudaStream_t stream, int /*copy: no weights*/) const {
  return attention(q_fp8_fused_.get(), cache_fused_.get(), latent_fused_.get(), lse_fused_.get(),
                   error_counts_.as<unsigned int>() + 2, stream);
}

Status DeviceStep::fused_value_up(cudaStream_t stream, int copy) const {
  HeadGemvArgs args;
  args.x = bf16(latent_fused_.get(), {s_.m, s_.H, s_.L});
  args.weight = bf16(w_uv_.copy(copy), {s_.H, s_.L, s_.V});
  args.out = bf16(out_fused_.get(), {s_.m, s_.H, s_.V});
  const HeadGemvTactic tactic = value_up_tactic(s_);
  return head_gemv(args, stream, &tactic);
}

Status DeviceStep::stock_cache_write(cudaStream_t stream, int /*copy: no weights*/) const {
  return stock_concat_and_cache_mla(cache_write(cache_stock_.get(), error_counts_.as<unsigned int>() + 1), stream);
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
  return attention(q_fp8_stock_.get(), cache_stock_.get(), latent_stock_.get(), lse_stock_.get(),
                   error_counts_.as<unsigned int>() + 3, stream);
}

Status DeviceStep::stock_value_up_bmm(cudaStream_t stream, int copy) const {
  DSA_RETURN_IF_ERROR(check_cublas_stream(stream));
  return cublas_head_bmm(handle_, bf16(latent_stock_.get(), {s_.m, s_.H, s_.L}),
                         bf16(w_uv_.copy(copy), {s_.H, s_.L, s_.V}),
                         bf16(out_stock_.get(), {s_.m, s_.H, s_.V}));
}

Status DeviceStep::download(cudaStream_t stream, StepOutputs* out) const {
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  DSA_CUDA_RETURN(cudaGetLastError());
  DSA_RETURN_IF_ERROR(copy_to_host(q_c_, &out->q_c, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(kv_c_, &out->kv_c, stream));
  DSA_RETURN_IF_ERROR(copy_to_host(q_, &out->q, stream));
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
  std::vector<unsigned int> counts;
  DSA_RETURN_IF_ERROR(copy_to_host(error_counts_, &counts, stream));
  std::vector<int32_t> split_counters;
  DSA_RETURN_IF_ERROR(copy_to_host(split_counters_, &split_counters, stream));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  out->skipped_slots_fused = counts[0];
  out->skipped_slots_stock = counts[1];
  out->bad_indices_fused = counts[2];
  out->bad_indices_stock = counts[3];
  out->counters_zero = std::all_of(split_counters.begin(), split_counters.end(), [](int32_t c) { return c == 0; });
  return Status();
}

}  // namespace dsa::cli
