// The numbers to beat (DESIGN.md section 4): the device copy rate, and the
// stock path's cuBLAS batched per-head products at the glm5next shapes,
// absorb (q_nope x W_UK_T) and value-up (latent x W_UV), with cold L2.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cublas_bmm.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/presets.h"
#include "dsa_decode/stock.h"
#include "harness.h"

namespace dsa::bench {
namespace {

constexpr int kTokenCounts[] = {1, 2, 4, 8, 16};
constexpr int kTensorParallel[] = {1, 8};  // glm5next: H = 64 and H = 8
constexpr int kMinPerGraph = 20;
constexpr size_t kBF16Bytes = 2;
constexpr int kCheckedColumnStep = 17;  // plus the last column: spread over the row, both ends included

// One per-head product: out [m, H, J] = x [m, H, I] x W [H, I, J].
struct HeadProduct {
  const char* row_name;
  int rows_I;
  int cols_J;
};

// `copies` rotations of weights, input and output, each sized for the
// largest token count, in three allocations.
struct ProductBuffers {
  int heads = 0;
  HeadProduct product{};
  int copies = 0;
  size_t weight_elements = 0;  // per copy
  size_t x_elements = 0;
  size_t out_elements = 0;
  DeviceMemory weights;
  DeviceMemory x;
  DeviceMemory out;

  const uint16_t* weight_copy(int c) const { return weights.as<uint16_t>() + c * weight_elements; }
  const uint16_t* x_copy(int c) const { return x.as<uint16_t>() + c * x_elements; }
  uint16_t* out_copy(int c) const { return out.as<uint16_t>() + c * out_elements; }

  Status enqueue(cublasHandle_t handle, int m, int copy) const {
    const int64_t I = product.rows_I;
    const int64_t J = product.cols_J;
    return cublas_head_bmm(handle, make_tensor(const_cast<uint16_t*>(x_copy(copy)), DType::kBF16, {m, heads, I}),
                           make_tensor(const_cast<uint16_t*>(weight_copy(copy)), DType::kBF16, {heads, I, J}),
                           make_tensor(out_copy(copy), DType::kBF16, {m, heads, J}));
  }
};

Status allocate_buffers(const Context& ctx, int heads, const HeadProduct& product, uint64_t seed,
                        ProductBuffers* buffers) {
  buffers->heads = heads;
  buffers->product = product;
  buffers->weight_elements = size_t{1} * heads * product.rows_I * product.cols_J;
  buffers->x_elements = size_t{1} * kMaxDecodeTokens * heads * product.rows_I;
  buffers->out_elements = size_t{1} * kMaxDecodeTokens * heads * product.cols_J;
  const size_t set_bytes = (buffers->weight_elements + buffers->x_elements + buffers->out_elements) * kBF16Bytes;
  buffers->copies = cold_copies(ctx, set_bytes);
  const size_t copies = buffers->copies;
  DSA_RETURN_IF_ERROR(buffers->weights.allocate(copies * buffers->weight_elements * kBF16Bytes));
  DSA_RETURN_IF_ERROR(buffers->x.allocate(copies * buffers->x_elements * kBF16Bytes));
  DSA_RETURN_IF_ERROR(buffers->out.allocate(copies * buffers->out_elements * kBF16Bytes));
  // Weights scaled by 1/sqrt(I) keep the outputs near unit size, as in a model.
  const float weight_scale = 1.0f / std::sqrt(static_cast<float>(product.rows_I));
  DSA_RETURN_IF_ERROR(
      fill_random_bf16(buffers->weights.get(), copies * buffers->weight_elements, seed, weight_scale, ctx.stream));
  DSA_RETURN_IF_ERROR(fill_random_bf16(buffers->x.get(), copies * buffers->x_elements, seed + 1, 1.0f, ctx.stream));
  return Status();
}

Status download(const uint16_t* device, size_t count, std::vector<uint16_t>* host) {
  host->resize(count);
  DSA_CUDA_RETURN(cudaMemcpy(host->data(), device, count * kBF16Bytes, cudaMemcpyDeviceToHost));
  return Status();
}

// The product at the largest token count on copy 0 against a CPU product:
// every output written (poisoned before), and the relative error over every
// 17th column in BF16 range. A wrong stride or transposition in the
// column-major mapping fails this by orders of magnitude.
Status check_against_cpu(const ProductBuffers& buffers, cublasHandle_t handle, cudaStream_t stream) {
  const int m = kMaxDecodeTokens;
  const int H = buffers.heads;
  const int I = buffers.product.rows_I;
  const int J = buffers.product.cols_J;
  DSA_CUDA_RETURN(cudaMemsetAsync(buffers.out_copy(0), 0xFF, buffers.out_elements * kBF16Bytes, stream));  // NaN
  DSA_RETURN_IF_ERROR(buffers.enqueue(handle, m, 0));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  std::vector<uint16_t> x;
  std::vector<uint16_t> w;
  std::vector<uint16_t> out;
  DSA_RETURN_IF_ERROR(download(buffers.x_copy(0), buffers.x_elements, &x));
  DSA_RETURN_IF_ERROR(download(buffers.weight_copy(0), buffers.weight_elements, &w));
  DSA_RETURN_IF_ERROR(download(buffers.out_copy(0), buffers.out_elements, &out));

  for (uint16_t value : out) {
    if (!std::isfinite(num::bf16_to_float(value))) {
      return Status(ErrorCode::kCublasError, std::string(buffers.product.row_name) +
                                                 ": cuBLAS left an output unwritten or non-finite");
    }
  }
  std::vector<int> columns;
  for (int j = 0; j < J; j += kCheckedColumnStep) columns.push_back(j);
  if (columns.back() != J - 1) columns.push_back(J - 1);
  double error_squares = 0;
  double reference_squares = 0;
  for (int t = 0; t < m; ++t) {
    for (int h = 0; h < H; ++h) {
      const uint16_t* x_row = &x[(size_t{1} * t * H + h) * I];
      const uint16_t* w_head = &w[size_t{1} * h * I * J];
      for (int j : columns) {
        double reference = 0;
        for (int i = 0; i < I; ++i) {
          reference += double{num::bf16_to_float(x_row[i])} * num::bf16_to_float(w_head[size_t{1} * i * J + j]);
        }
        const double got = num::bf16_to_float(out[(size_t{1} * t * H + h) * J + j]);
        error_squares += (got - reference) * (got - reference);
        reference_squares += reference * reference;
      }
    }
  }
  // BF16 output rounding alone gives about 2e-3 (METHOD.md: 1e-3 to 1e-2).
  const double relative_error = std::sqrt(error_squares / reference_squares);
  if (!(relative_error < 1e-2)) {
    return Status(ErrorCode::kCublasError, std::string(buffers.product.row_name) + " H=" + std::to_string(H) +
                                               ": cuBLAS result differs from the CPU product, relative error " +
                                               std::to_string(relative_error));
  }
  return Status();
}

Status time_product(Context& ctx, Report& report, const ProductBuffers& buffers, cublasHandle_t handle) {
  const int H = buffers.heads;
  const int I = buffers.product.rows_I;
  const int J = buffers.product.cols_J;
  for (int m : kTokenCounts) {
    const Enqueue enqueue = [&](cudaStream_t stream, int i) {
      return buffers.enqueue(handle, m, i % buffers.copies);
    };
    double us = 0;
    DSA_RETURN_IF_ERROR(time_graph(ctx, enqueue, &us, std::max(kMinPerGraph, buffers.copies)));
    const double bytes = (double{1} * H * I * J + double{1} * m * H * (I + J)) * kBF16Bytes;
    Row row;
    row.name = buffers.product.row_name;
    row.params = {{"H", H}, {"m", m}};
    row.us = us;
    row.floor_us = floor_us(ctx, bytes);
    row.tflops = 2.0 * m * H * I * J / (us * 1e-6) / 1e12;
    row.note = "cublasGemmStridedBatchedEx bf16, " + std::to_string(buffers.copies) + " cold copies";
    report.add(std::move(row));
  }
  return Status();
}

Status run_baseline(Context& ctx, Report& report) {
  Row copy;
  copy.name = "copy";
  copy.params = {{"bytes", static_cast<double>(kCopyProbeBytes)}};
  copy.us = 2.0 * kCopyProbeBytes / (ctx.copy_GBps * 1e3);
  copy.note = "cudaMemcpyAsync device to device; " + std::to_string(static_cast<long>(ctx.copy_GBps)) +
              " GB/s counting bytes read + written";
  report.add(std::move(copy));

  ModelPreset preset;
  DSA_RETURN_IF_ERROR(find_preset("glm5next", &preset));
  const HeadProduct products[] = {
      {"absorb_bmm", preset.qk_nope, preset.kv_lora},  // q_nope [m, H, P] x W_UK_T [H, P, L]
      {"value_up_bmm", preset.kv_lora, preset.v_head},  // latent [m, H, L] x W_UV [H, L, V]
  };
  CublasHandle cublas;
  DSA_RETURN_IF_ERROR(cublas.create(ctx.stream));
  uint64_t seed = 0x5EED;  // fixed: the same inputs in every run, so runs compare
  for (int tp : kTensorParallel) {
    ModelPreset rank;
    DSA_RETURN_IF_ERROR(per_rank(preset, tp, &rank));
    for (const HeadProduct& product : products) {
      ProductBuffers buffers;
      DSA_RETURN_IF_ERROR(allocate_buffers(ctx, rank.heads, product, seed, &buffers));
      seed += 2;  // allocate_buffers draws the streams seed and seed + 1
      DSA_RETURN_IF_ERROR(check_against_cpu(buffers, cublas.get(), ctx.stream));
      DSA_RETURN_IF_ERROR(time_product(ctx, report, buffers, cublas.get()));
    }
  }
  return Status();
}

}  // namespace

DSA_BENCH("baseline", run_baseline);

}  // namespace dsa::bench
