// LinearContext (src/core/linear.h): nn.Linear products through cuBLASLt.
#include "core/linear.h"

#include <cublasLt.h>

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/device_memory.h"
#include "dsa_decode/cuda_check.h"

namespace dsa {

namespace {

// The callers guarantee 16-byte aligned data and row strides of a multiple
// of 16 bytes; telling the heuristic so keeps it from picking an
// algorithm that needs its default of 256-byte aligned matrices.
constexpr uint32_t kMatrixAlignmentBytes = 16;

template <class Handle, cublasStatus_t (*destroy)(Handle)>
struct LtDestroy {
  void operator()(Handle handle) const { destroy(handle); }
};
template <class Handle, cublasStatus_t (*destroy)(Handle)>
using LtOwned = std::unique_ptr<std::remove_pointer_t<Handle>, LtDestroy<Handle, destroy>>;
using OwnedHandle = LtOwned<cublasLtHandle_t, cublasLtDestroy>;
using OwnedMatmulDesc = LtOwned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using OwnedLayout = LtOwned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using OwnedPreference = LtOwned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

// What fixes a matmul's descriptors and algorithm: row-major out[m, n] =
// in[m, k] x weight[n, k]^T with these row strides, in elements.
struct MatmulShape {
  int64_t m, n, k;
  int64_t input_stride, weight_stride, output_stride;
  cudaDataType_t output_type;

  bool operator==(const MatmulShape& o) const {
    return m == o.m && n == o.n && k == o.k && input_stride == o.input_stride && weight_stride == o.weight_stride &&
           output_stride == o.output_stride && output_type == o.output_type;
  }
  std::string describe() const {
    return "m " + std::to_string(m) + ", n " + std::to_string(n) + ", k " + std::to_string(k) + ", row strides " +
           std::to_string(input_stride) + " / " + std::to_string(weight_stride) + " / " + std::to_string(output_stride);
  }
};

// One shape's descriptors and the heuristic's first algorithm for it.
//
// cuBLASLt is column-major, and a row-major [rows, cols] matrix with row
// stride s is the column-major [cols, rows] matrix with leading dimension s.
// So the library computes out^T [n, m] = op_T(weight as [k, n]) x (in as
// [k, m]): every matrix is read and written where it lies, no copies.
struct MatmulPlan {
  MatmulShape shape = {};
  OwnedMatmulDesc desc;
  OwnedLayout weight_layout, input_layout, output_layout;
  cublasLtMatmulAlgo_t algorithm = {};
};

Status make_matmul_plan(cublasLtHandle_t handle, const MatmulShape& shape, size_t workspace_bytes,
                        const std::string& what, MatmulPlan* plan) {
  plan->shape = shape;
  cublasLtMatmulDesc_t desc = nullptr;
  DSA_RETURN_IF_ERROR(cublas_status(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                                    (what + ": cublasLtMatmulDescCreate").c_str()));
  plan->desc.reset(desc);
  const cublasOperation_t transpose = CUBLAS_OP_T, no_transpose = CUBLAS_OP_N;
  DSA_RETURN_IF_ERROR(
      cublas_status(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
                    (what + ": cublasLtMatmulDescSetAttribute(TRANSA)").c_str()));
  DSA_RETURN_IF_ERROR(cublas_status(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose, sizeof(no_transpose)),
      (what + ": cublasLtMatmulDescSetAttribute(TRANSB)").c_str()));

  const auto make_layout = [&](OwnedLayout* owned, cudaDataType_t type, int64_t rows, int64_t cols, int64_t leading) {
    cublasLtMatrixLayout_t layout = nullptr;
    const Status made = cublas_status(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, leading),
                                      (what + ": cublasLtMatrixLayoutCreate").c_str());
    owned->reset(layout);
    return made;
  };
  DSA_RETURN_IF_ERROR(make_layout(&plan->weight_layout, CUDA_R_16BF, shape.k, shape.n, shape.weight_stride));
  DSA_RETURN_IF_ERROR(make_layout(&plan->input_layout, CUDA_R_16BF, shape.k, shape.m, shape.input_stride));
  DSA_RETURN_IF_ERROR(make_layout(&plan->output_layout, shape.output_type, shape.n, shape.m, shape.output_stride));

  cublasLtMatmulPreference_t raw_preference = nullptr;
  DSA_RETURN_IF_ERROR(cublas_status(cublasLtMatmulPreferenceCreate(&raw_preference),
                                    (what + ": cublasLtMatmulPreferenceCreate").c_str()));
  const OwnedPreference preference(raw_preference);
  const uint64_t max_workspace = workspace_bytes;
  DSA_RETURN_IF_ERROR(
      cublas_status(cublasLtMatmulPreferenceSetAttribute(raw_preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &max_workspace, sizeof(max_workspace)),
                    (what + ": cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)").c_str()));
  for (const cublasLtMatmulPreferenceAttributes_t attribute :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    DSA_RETURN_IF_ERROR(
        cublas_status(cublasLtMatmulPreferenceSetAttribute(raw_preference, attribute, &kMatrixAlignmentBytes,
                                                           sizeof(kMatrixAlignmentBytes)),
                      (what + ": cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)").c_str()));
  }

  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  const cublasStatus_t searched = cublasLtMatmulAlgoGetHeuristic(
      handle, desc, plan->weight_layout.get(), plan->input_layout.get(), plan->output_layout.get(),
      plan->output_layout.get(), raw_preference, 1, &result, &found);
  if (searched != CUBLAS_STATUS_SUCCESS) {
    return cublas_status(searched, (what + ": cublasLtMatmulAlgoGetHeuristic").c_str());
  }
  if (found == 0) {
    return Status(ErrorCode::kCublasError, what + ": cublasLtMatmulAlgoGetHeuristic found no algorithm");
  }
  plan->algorithm = result.algo;
  return Status();
}

// "what (the shape)", as errors name a product.
std::string described(const char* what, const MatmulShape& shape) {
  return std::string(what) + " (" + shape.describe() + ")";
}

}  // namespace

struct LinearContext::State {
  OwnedHandle handle;
  DeviceMemory workspace;
  size_t workspace_bytes = 0;
  std::vector<MatmulPlan> plans;  // one per shape met, in the order met

  // The plan of `shape`, made on its first call (its description, for
  // errors, built only then: run is on every step's path).
  Status plan_for(const MatmulShape& shape, const char* what, const MatmulPlan** plan) {
    for (const MatmulPlan& known : plans) {
      if (known.shape == shape) {
        *plan = &known;
        return Status();
      }
    }
    MatmulPlan made;
    DSA_RETURN_IF_ERROR(make_matmul_plan(handle.get(), shape, workspace_bytes, described(what, shape), &made));
    plans.push_back(std::move(made));
    *plan = &plans.back();
    return Status();
  }
};

LinearContext::LinearContext() = default;
LinearContext::~LinearContext() = default;
LinearContext::LinearContext(LinearContext&&) noexcept = default;
LinearContext& LinearContext::operator=(LinearContext&&) noexcept = default;

Status LinearContext::create(LinearContext* context, size_t workspace_bytes) {
  if (context == nullptr) return invalid_argument("context", "a context to fill", "a null pointer");
  auto state = std::make_unique<State>();
  // The workspace first: without a device its error is kNoDevice.
  DSA_RETURN_IF_ERROR(allocate_device(workspace_bytes, &state->workspace));
  state->workspace_bytes = workspace_bytes;
  cublasLtHandle_t handle = nullptr;
  DSA_CUBLAS_RETURN(cublasLtCreate(&handle));
  state->handle.reset(handle);
  context->state_ = std::move(state);
  return Status();
}

namespace {

// cuBLASLt wants a leading dimension of at least the row even where it steps
// no further: a single row is given its contiguous stride, whatever the
// view's (never used, tensor.h) one.
int64_t leading_dimension(int64_t rows, int64_t row_stride, int64_t row_length) {
  return rows > 1 ? row_stride : row_length;
}

MatmulShape shape_of(const TensorView& input, const TensorView& weight, int64_t output_stride,
                     cudaDataType_t output_type) {
  const int64_t m = input.size(0), n = weight.size(0), k = input.size(1);
  return MatmulShape{m,
                     n,
                     k,
                     leading_dimension(m, input.stride(0), k),
                     leading_dimension(n, weight.stride(0), k),
                     leading_dimension(m, output_stride, n),
                     output_type};
}

}  // namespace

Status LinearContext::prepare(const char* what, const TensorView& input, const TensorView& weight,
                              int64_t output_stride, cudaDataType_t output_type) {
  if (!created()) return invalid_argument("context", "a context made by create()", "an empty context");
  const MatmulPlan* plan = nullptr;
  return state_->plan_for(shape_of(input, weight, output_stride, output_type), what, &plan);
}

Status LinearContext::run(const char* what, const TensorView& input, const TensorView& weight, void* output,
                          int64_t output_stride, cudaDataType_t output_type, cudaStream_t stream) {
  if (!created()) return invalid_argument("context", "a context made by create()", "an empty context");
  const MatmulShape shape = shape_of(input, weight, output_stride, output_type);
  const MatmulPlan* plan = nullptr;
  DSA_RETURN_IF_ERROR(state_->plan_for(shape, what, &plan));
  // Host scalars: a cuBLASLt matmul descriptor's pointer mode is host by default.
  const float alpha = 1.0f, beta = 0.0f;
  // beta = 0: C is not read, so C and D are both the output.
  const cublasStatus_t status = cublasLtMatmul(
      state_->handle.get(), plan->desc.get(), &alpha, weight.data, plan->weight_layout.get(), input.data,
      plan->input_layout.get(), &beta, output, plan->output_layout.get(), output, plan->output_layout.get(),
      &plan->algorithm, state_->workspace.get(), state_->workspace_bytes, stream);
  if (status == CUBLAS_STATUS_SUCCESS) return Status();
  return cublas_status(status, (described(what, shape) + ": cublasLtMatmul").c_str());
}

}  // namespace dsa
