// The fused q/kv RMSNorm (one launch, PDL) against the stock path: vLLM's
// rms_norm kernel called twice, once per part. glm5next sizes, m = 1..16.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <cub/block/block_reduce.cuh>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/norm.h"
#include "harness.h"

namespace dsa {
namespace {

constexpr int kStockMaxThreads = 1024;

// vLLM's rms_norm kernel (csrc/layernorm_kernels.cu) in its plain form: one CTA
// per token of min(size, 1024) threads, a strided pass for the sum of squares,
// a CUB block reduction, and a second pass that rereads the row.
__global__ void __launch_bounds__(kStockMaxThreads)
    stock_rms_norm_kernel(__nv_bfloat16* out,          // [m, size]
                          const __nv_bfloat16* input,  // [m, input_stride]
                          int64_t input_stride,
                          const __nv_bfloat16* weight,  // [size]
                          float eps, int size) {
  using BlockReduce = cub::BlockReduce<float, kStockMaxThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  __shared__ float rrms;
  const __nv_bfloat16* row = input + blockIdx.x * input_stride;
  float variance = 0.0f;
  for (int i = threadIdx.x; i < size; i += blockDim.x) {
    const float x = __bfloat162float(row[i]);
    variance += x * x;
  }
  variance = BlockReduce(reduce_storage).Sum(variance, blockDim.x);
  if (threadIdx.x == 0) rrms = rsqrtf(variance / size + eps);
  __syncthreads();
  for (int i = threadIdx.x; i < size; i += blockDim.x) {
    const float x = __bfloat162float(row[i]);
    out[blockIdx.x * size + i] = __float2bfloat16(x * rrms) * weight[i];
  }
}

Status launch_stock_rms_norm(void* out, const void* input, int64_t input_stride, const void* weight, float eps, int m,
                             int size, cudaStream_t stream) {
  stock_rms_norm_kernel<<<m, std::min(size, kStockMaxThreads), 0, stream>>>(
      static_cast<__nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(input), input_stride,
      static_cast<const __nv_bfloat16*>(weight), eps, size);
  return cuda_status(cudaGetLastError(), "stock_rms_norm_kernel launch");
}

// Both stock launches for one input set.
Status launch_stock_pair(const QkvNormParams& p, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(launch_stock_rms_norm(p.q_out, p.qkv, p.qkv_row_pitch, p.q_weight, p.eps, p.m, p.q_size, stream));
  return launch_stock_rms_norm(p.kv_out, static_cast<const uint16_t*>(p.qkv) + p.q_size, p.qkv_row_pitch, p.kv_weight,
                               p.eps, p.m, p.kv_size, stream);
}

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// q_out and kv_out of one set, concatenated, after a synchronization.
Status download_outputs(const QkvNormParams& p, cudaStream_t stream, std::vector<uint16_t>* values) {
  const size_t q_count = size_t(p.m) * p.q_size, kv_count = size_t(p.m) * p.kv_size;
  values->resize(q_count + kv_count);
  DSA_CUDA_RETURN(cudaMemcpyAsync(values->data(), p.q_out, q_count * 2, cudaMemcpyDeviceToHost, stream));
  DSA_CUDA_RETURN(cudaMemcpyAsync(values->data() + q_count, p.kv_out, kv_count * 2, cudaMemcpyDeviceToHost, stream));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  return Status();
}

// Largest distance in BF16 ulp between two equally long lists of finite values.
int max_bf16_ulp(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  auto order = [](uint16_t bits) { return (bits & 0x8000u) ? -int(bits & 0x7FFFu) : int(bits); };
  int worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(order(a[i]) - order(b[i])));
  return worst;
}

Status bench_norm(bench::Context& ctx, bench::Report& report) {
  constexpr int kQ = 1536, kKv = 512;  // glm5next q_lora, kv_lora
  constexpr int kWidth = kQ + kKv;
  constexpr float kEps = 1e-6f;
  for (int m : {1, 2, 4, 8, 16}) {
    // One input set: qkv, both weights, both outputs, each 256-byte aligned;
    // the sets rotate so that a launch does not find its inputs in L2.
    const size_t row_bytes = size_t{kWidth} * 2;
    const size_t qkv_offset = 0;
    const size_t q_weight_offset = qkv_offset + align_up(m * row_bytes);
    const size_t kv_weight_offset = q_weight_offset + align_up(kQ * 2);
    const size_t q_out_offset = kv_weight_offset + align_up(kKv * 2);
    const size_t kv_out_offset = q_out_offset + align_up(size_t(m) * kQ * 2);
    const size_t set_bytes = kv_out_offset + align_up(size_t(m) * kKv * 2);
    const int copies = bench::cold_copies(ctx, set_bytes);

    bench::DeviceMemory memory;
    DSA_RETURN_IF_ERROR(memory.allocate(copies * set_bytes));
    DSA_RETURN_IF_ERROR(bench::fill_random_bf16(memory.get(), copies * set_bytes / 2, 0x6e6f726d + m, 1.0f, ctx.stream));
    // The norm reads its weights before griddepcontrol.wait: they must be
    // complete before it launches, not merely earlier in the stream.
    DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
    std::vector<QkvNormParams> sets(copies);
    for (int c = 0; c < copies; ++c) {
      char* base = memory.as<char>() + c * set_bytes;
      DSA_RETURN_IF_ERROR(make_qkv_norm_params(make_tensor(base + qkv_offset, DType::kBF16, {m, kWidth}),
                                               make_tensor(base + q_weight_offset, DType::kBF16, {kQ}),
                                               make_tensor(base + kv_weight_offset, DType::kBF16, {kKv}), kEps,
                                               make_tensor(base + q_out_offset, DType::kBF16, {m, kQ}),
                                               make_tensor(base + kv_out_offset, DType::kBF16, {m, kKv}), &sets[c]));
    }

    // Same job check: both paths on set 0, outside the timing.
    std::vector<uint16_t> fused_values, stock_values;
    DSA_RETURN_IF_ERROR(launch_qkv_norm(sets[0], ctx.stream));
    DSA_RETURN_IF_ERROR(download_outputs(sets[0], ctx.stream, &fused_values));
    DSA_RETURN_IF_ERROR(launch_stock_pair(sets[0], ctx.stream));
    DSA_RETURN_IF_ERROR(download_outputs(sets[0], ctx.stream, &stock_values));

    const int per_graph = std::max(copies, 20);  // every replay walks the whole rotation
    double fused_us = 0, stock_us = 0;
    DSA_RETURN_IF_ERROR(bench::time_graph(
        ctx, [&](cudaStream_t stream, int i) { return launch_qkv_norm(sets[i % copies], stream); }, &fused_us,
        per_graph));
    DSA_RETURN_IF_ERROR(bench::time_graph(
        ctx, [&](cudaStream_t stream, int i) { return launch_stock_pair(sets[i % copies], stream); }, &stock_us,
        per_graph));

    bench::Row row;
    row.name = "norm";
    row.params = {{"m", m}};
    row.us = fused_us;
    row.baseline = "two rms_norm launches";
    row.baseline_us = stock_us;
    // Each value of qkv read once, the weights once, each output written once.
    row.floor_us = bench::floor_us(ctx, double(m) * row_bytes + row_bytes + double(m) * row_bytes);
    row.note = "fused vs stock max " + std::to_string(max_bf16_ulp(fused_values, stock_values)) + " BF16 ulp";
    report.add(row);
  }
  return Status();
}

DSA_BENCH("norm", bench_norm);

}  // namespace
}  // namespace dsa
