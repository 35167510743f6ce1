// The indexer's projections (include/dsa_decode/indexer.h, indexer_project):
// four cuBLASLt matmuls out[m, n] = in[m, k] x weight[n, k]^T, BF16 in, FP32
// compute, BF16 or FP32 out.
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "core/linear.h"
#include "dsa_decode/indexer.h"
#include "indexer/indexer_project_gate.h"

namespace dsa {

namespace {

// One of indexer_project's four products: output[m, n] = input x weight^T.
struct Product {
  const char* name;  // for error messages
  const TensorView& input;   // [m, k] BF16
  const TensorView& weight;  // [n, k] BF16
  void* output;
  int64_t output_stride;
  cudaDataType_t output_type;
};

}  // namespace

struct IndexerProjectContext::State {
  LinearContext linear;
};

IndexerProjectContext::IndexerProjectContext() = default;
IndexerProjectContext::~IndexerProjectContext() = default;
IndexerProjectContext::IndexerProjectContext(IndexerProjectContext&&) noexcept = default;
IndexerProjectContext& IndexerProjectContext::operator=(IndexerProjectContext&&) noexcept = default;

Status IndexerProjectContext::create(IndexerProjectContext* context, size_t workspace_bytes) {
  if (context == nullptr) return invalid_argument("context", "a context to fill", "a null pointer");
  auto state = std::make_unique<State>();
  DSA_RETURN_IF_ERROR(LinearContext::create(&state->linear, workspace_bytes));
  context->state_ = std::move(state);
  return Status();
}

Status indexer_project(const IndexerProjectArgs& a, IndexerProjectContext& context, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_project(a));
  if (!context.created()) {
    return invalid_argument("context", "a context made by IndexerProjectContext::create", "an empty context");
  }
  const Product products[] = {
      {"indexer_project, index_q = q_c @ wq_b^T", a.q_c, a.wq_b, a.index_q.data, a.index_q.stride(0), CUDA_R_16BF},
      {"indexer_project, index_k = x @ wk^T", a.x, a.wk, a.index_k.data, a.index_k.stride(0), CUDA_R_16BF},
      {"indexer_project, head_weights = x @ weights_proj^T", a.x, a.weights_proj, a.head_weights.data,
       a.head_weights.stride(0), CUDA_R_32F},
      {"indexer_project, gate = x @ compress_gate^T", a.x, a.compress_gate, a.gate.data, a.gate.stride(0), CUDA_R_16BF},
  };
  const bool with_gate = indexer_project_computes_gate(a);  // the last product; none with pool 1's empty gate
  for (const Product& product : products) {
    if (&product == &products[3] && !with_gate) break;
    DSA_RETURN_IF_ERROR(context.state_->linear.run(product.name, product.input, product.weight, product.output,
                                                   product.output_stride, product.output_type, stream));
  }
  return Status();
}

}  // namespace dsa
