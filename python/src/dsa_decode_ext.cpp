// dsa_decode._C: the thin nanobind layer between Python and the library's C++
// API. Every tensor arrives as a DLPack-capable object (a PyTorch, CuPy or
// JAX array, a NumPy array for the CPU references), becomes a TensorView
// over the same memory (no copy), and the C++ entry point checks it; a
// non-ok Status becomes a Python exception carrying the same message.
// Streams arrive as integers (a cudaStream_t's value; dsa_decode/_tensors.py
// picks the caller's current PyTorch stream). Launches release the GIL.
//
// FP8 e4m3 tensors: DLPack carries float8 only from version 1.1 on, so the
// arguments the library reads as e4m3 take uint8 (or int8) views too; the
// Python layer passes torch.float8_e4m3fn tensors as such views.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "dsa_decode/head_gemv.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/linear.h"
#include "dsa_decode/norm.h"
#include "dsa_decode/presets.h"
#include "dsa_decode/sparse_mla.h"
#include "dsa_decode/stage.h"
#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"
#include "head_gemv/head_gemv_reference.h"
#include "linear/linear_reference.h"
#include "norm/norm_reference.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Array = nb::ndarray<>;
using OptArray = std::optional<nb::ndarray<>>;

// One C++ type per error code, each registered as its own Python exception.
struct InvalidArgumentError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct UnsupportedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct CublasError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct NoDeviceError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Raises the Status's exception; the message is Status::to_string(), the
// text the C++ caller would print.
void throw_if_error(const dsa::Status& status) {
  if (status.ok()) return;
  const std::string text = status.to_string();
  switch (status.code()) {
    case dsa::ErrorCode::kInvalidArgument:
      throw InvalidArgumentError(text);
    case dsa::ErrorCode::kUnsupported:
      throw UnsupportedError(text);
    case dsa::ErrorCode::kCudaError:
      throw CudaError(text);
    case dsa::ErrorCode::kCublasError:
      throw CublasError(text);
    case dsa::ErrorCode::kNoDevice:
      throw NoDeviceError(text);
    case dsa::ErrorCode::kOk:
      return;
  }
  throw CudaError(text);
}

// Runs a launch without the GIL (the kernels are asynchronous, but the
// argument checks and cuBLAS's host work take microseconds another Python
// thread can use) and raises its Status.
template <class Launch>
void launch_released(Launch&& launch) {
  dsa::Status status;
  {
    nb::gil_scoped_release release;
    status = launch();
  }
  throw_if_error(status);
}

[[noreturn]] void throw_invalid(const std::string& name, const std::string& expected, const std::string& got) {
  throw InvalidArgumentError(dsa::invalid_argument(name, expected, got).to_string());
}

std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  return "DLPack dtype (code " + std::to_string(int(t.code)) + ", " + std::to_string(int(t.bits)) + " bits, " +
         std::to_string(int(t.lanes)) + " lanes)";
}

// DLPack's float8_e4m3fn code (DLPack 1.1, kDLFloat8_e4m3fn).
constexpr uint8_t kDlpackFloat8E4m3fn = 10;

dsa::DType to_dtype(nb::dlpack::dtype t, const char* name, bool fp8) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes != 1) throw_invalid(name, "one lane per element", dlpack_dtype_name(t));
  if (fp8) {
    const bool byte =
        t.bits == 8 && (t.code == uint8_t(Code::UInt) || t.code == uint8_t(Code::Int) || t.code == kDlpackFloat8E4m3fn);
    if (!byte) throw_invalid(name, "FP8 e4m3 (float8_e4m3fn, or its uint8 view)", dlpack_dtype_name(t));
    return dsa::DType::kFP8E4M3;
  }
  if (t.code == uint8_t(Code::Bfloat) && t.bits == 16) return dsa::DType::kBF16;
  if (t.code == uint8_t(Code::Float) && t.bits == 16) return dsa::DType::kF16;
  if (t.code == uint8_t(Code::Float) && t.bits == 32) return dsa::DType::kF32;
  if (t.code == uint8_t(Code::Int) && t.bits == 32) return dsa::DType::kI32;
  if (t.code == uint8_t(Code::Int) && t.bits == 64) return dsa::DType::kI64;
  if (t.code == uint8_t(Code::UInt) && t.bits == 8) return dsa::DType::kU8;
  if (t.code == kDlpackFloat8E4m3fn && t.bits == 8) return dsa::DType::kFP8E4M3;
  throw_invalid(name, "bfloat16, float16, float32, int32, int64, uint8 or float8_e4m3fn", dlpack_dtype_name(t));
}

// The CUDA device the library launches on (cudaGetDevice), asked only when a
// CUDA array arrives, so CPU-only machines never ask.
int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  return device;
}

// A view of the array's memory under the C++ argument name `name`. The shape,
// strides, dtype and device are translated, and the C++ checks judge them
// (a size-1 dimension's stride, on which DLPack producers disagree, they
// never judge: it is passed on as given), with two rules of the
// translation's own:
//  - negative strides are refused where the size is not 1 (the library's
//    overlap and span rules assume non-negative ones);
//  - a CUDA array must be on the current device, where the launch goes.
dsa::TensorView to_view(const Array& a, const char* name, bool fp8 = false) {
  dsa::TensorView v;
  if (a.ndim() > size_t(dsa::kMaxDims)) {
    throw_invalid(name, "at most " + std::to_string(dsa::kMaxDims) + " dimensions",
                  std::to_string(a.ndim()) + " dimensions");
  }
  v.data = a.data();
  v.dtype = to_dtype(a.dtype(), name, fp8);
  v.ndim = int(a.ndim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = a.shape(d);
    v.strides[d] = a.stride(d);
  }
  for (int d = 0; d < v.ndim; ++d) {
    if (v.shape[d] != 1 && v.strides[d] < 0) throw_invalid(name, "non-negative strides", v.describe());
  }
  const int device_type = a.device_type();
  if (device_type == nb::device::cuda::value) {
    v.device = dsa::Device{dsa::DeviceKind::kCUDA, a.device_id()};
    const int device = current_device();
    if (a.device_id() != device) {
      throw_invalid(
          name,
          "an array on the current device cuda:" + std::to_string(device) + " (torch.cuda.device(...) selects it)",
          v.describe());
    }
  } else if (device_type == nb::device::cpu::value) {
    v.device = dsa::Device{dsa::DeviceKind::kCPU, 0};
  } else {
    throw_invalid(name, "memory on a CUDA device or the CPU", "DLPack device type " + std::to_string(device_type));
  }
  return v;
}

dsa::TensorView to_view(const OptArray& a, const char* name, bool fp8 = false) {
  return a ? to_view(*a, name, fp8) : dsa::TensorView{};
}

// An optional error counter: a [1] (or larger) int32/uint32 CUDA array.
unsigned int* to_counter(const OptArray& a, const char* name) {
  if (!a) return nullptr;
  const nb::dlpack::dtype t = a->dtype();
  const bool word = t.bits == 32 && t.lanes == 1 &&
                    (t.code == uint8_t(nb::dlpack::dtype_code::Int) || t.code == uint8_t(nb::dlpack::dtype_code::UInt));
  if (!word) throw_invalid(name, "an int32 or uint32 counter", dlpack_dtype_name(t));
  if (a->size() < 1) throw_invalid(name, "at least one element", "an empty array");
  if (a->device_type() != nb::device::cuda::value) throw_invalid(name, "a CUDA array", "another device");
  return static_cast<unsigned int*>(a->data());
}

cudaStream_t to_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// The string choices of the C++ enums, one table each: the parsers below and
// the package's HEAD_GEMV_SUMS, ATTENTION_SPLITS and INDEXER_LOGITS read them.
template <class Enum>
using Choices = std::vector<std::pair<std::string, Enum>>;

const Choices<dsa::HeadGemvSums> kHeadGemvSums = {{"seed-order", dsa::HeadGemvSums::kSeedOrder},
                                                  {"tensor-cores", dsa::HeadGemvSums::kTensorCores}};
const Choices<dsa::SparseMlaSplits> kSparseMlaSplits = {{"latency", dsa::SparseMlaSplits::kLatency},
                                                        {"throughput", dsa::SparseMlaSplits::kThroughput},
                                                        {"by-batch", dsa::SparseMlaSplits::kByBatch},
                                                        {"whole-row", dsa::SparseMlaSplits::kWholeRow}};
const Choices<dsa::IndexerLogits> kIndexerLogits = {{"exact", dsa::IndexerLogits::kExact},
                                                    {"fp32-accumulation", dsa::IndexerLogits::kFp32Accumulation}};

template <class Enum>
Enum enum_from(const std::string& value, const char* name, const Choices<Enum>& choices) {
  std::string names;
  for (const auto& [text, e] : choices) {
    if (value == text) return e;
    names += names.empty() ? "" : ", ";
    names += text;
  }
  throw_invalid(name, "one of " + names, "'" + value + "'");
}

template <class Enum>
nb::tuple choice_names(const Choices<Enum>& choices) {
  nb::list names;
  for (const auto& choice : choices) names.append(choice.first);
  return nb::tuple(names);
}

dsa::HeadGemvSums head_gemv_sums(const std::string& s) { return enum_from(s, "sums", kHeadGemvSums); }
dsa::SparseMlaSplits sparse_mla_splits(const std::string& s) { return enum_from(s, "splits", kSparseMlaSplits); }
dsa::IndexerLogits indexer_logits(const std::string& s) { return enum_from(s, "logits", kIndexerLogits); }

// dsa_decode.IndexerPlan as it crosses: (max_tokens, max_context, ring,
// block_size, logits), one argument of every indexer function.
using IndexerPlanFields = std::tuple<int, int64_t, int, int, std::string>;

dsa::IndexerPlan indexer_plan(const IndexerPlanFields& fields) {
  dsa::IndexerPlan plan;
  plan.max_tokens = std::get<0>(fields);
  plan.max_context = std::get<1>(fields);
  plan.ring = std::get<2>(fields);
  plan.block_size = std::get<3>(fields);
  plan.logits = indexer_logits(std::get<4>(fields));
  return plan;
}

dsa::IndexerState indexer_state(const Array& block_table, const Array& ring, const Array& k_cache) {
  return dsa::IndexerState{to_view(block_table, "state.block_table"), to_view(ring, "state.ring"),
                           to_view(k_cache, "state.k_cache")};
}

// Host copies for the CPU references (NumPy arrays, C-contiguous).
template <class T>
const T* host_data(const Array& a, const char* name, nb::dlpack::dtype want, int64_t count) {
  if (a.device_type() != nb::device::cpu::value) throw_invalid(name, "a CPU (NumPy) array", "device memory");
  if (a.dtype() != want) throw_invalid(name, "another dtype", dlpack_dtype_name(a.dtype()));
  int64_t expected_stride = 1;
  for (size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expected_stride) throw_invalid(name, "a C-contiguous array", "strides");
    expected_stride *= a.shape(d);
  }
  if (int64_t(a.size()) != count) {
    throw_invalid(name, std::to_string(count) + " elements", std::to_string(a.size()) + " elements");
  }
  return static_cast<const T*>(a.data());
}

template <class T>
nb::ndarray<nb::numpy, T> numpy_from(std::vector<T> values, std::vector<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape.size(), shape.data(), owner);
}

// --- the stage -------------------------------------------------------------

// Python's handle of a DsaAttentionStage. It keeps the weight arrays it was
// made from (a DLPack capsule has no other owner once imported), and runs
// one call at a time: launches release the GIL, and two threads must not
// share the stage's workspace, events and cuBLAS handle at once.
struct Stage {
  std::unique_ptr<dsa::DsaAttentionStage> stage;
  std::vector<Array> weights;
  std::mutex calls;
};

dsa::DsaStepArgs step_args(const Array& hidden, const Array& positions, const Array& token_requests,
                           const Array& slot_mapping, const Array& kv_cache, const Array& block_table,
                           const Array& ring, const Array& index_k_cache, const Array& out,
                           const OptArray& topk_positions, const OptArray& error_count) {
  dsa::DsaStepArgs args;
  args.hidden = to_view(hidden, "hidden");
  args.positions = to_view(positions, "positions");
  args.token_requests = to_view(token_requests, "token_requests");
  args.slot_mapping = to_view(slot_mapping, "slot_mapping");
  args.kv_cache = to_view(kv_cache, "kv_cache", true);
  args.indexer = indexer_state(block_table, ring, index_k_cache);
  args.topk_positions = to_view(topk_positions, "topk_positions");
  args.out = to_view(out, "out");
  args.error_count = to_counter(error_count, "error_count");
  return args;
}

// A view of a stage buffer as a DLPack array owned by the stage's Python object.
nb::object stage_array(const dsa::TensorView& v, nb::handle owner) {
  if (v.data == nullptr) return nb::none();
  nb::dlpack::dtype t;
  switch (v.dtype) {
    case dsa::DType::kBF16:
      t = {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
      break;
    case dsa::DType::kF16:
      t = {uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
      break;
    case dsa::DType::kF32:
      t = nb::dtype<float>();
      break;
    case dsa::DType::kI32:
      t = nb::dtype<int32_t>();
      break;
    case dsa::DType::kI64:
      t = nb::dtype<int64_t>();
      break;
    case dsa::DType::kFP8E4M3:  // handed out as its uint8 view
    case dsa::DType::kU8:
      t = nb::dtype<uint8_t>();
      break;
  }
  std::vector<size_t> shape(v.shape, v.shape + v.ndim);
  std::vector<int64_t> strides(v.strides, v.strides + v.ndim);
  nb::ndarray<> array(v.data, size_t(v.ndim), shape.data(), owner, strides.data(), t, nb::device::cuda::value,
                      v.device.index);
  return nb::cast(array, nb::rv_policy::reference);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "dsa-decode's C++ API for Python (use the dsa_decode package, not this module)";

  nb::exception<InvalidArgumentError>(m, "InvalidArgument", PyExc_ValueError);
  nb::exception<UnsupportedError>(m, "Unsupported", PyExc_NotImplementedError);
  nb::exception<CudaError>(m, "CudaError", PyExc_RuntimeError);
  nb::exception<CublasError>(m, "CublasError", PyExc_RuntimeError);
  nb::exception<NoDeviceError>(m, "NoDevice", PyExc_RuntimeError);
  m.attr("HEAD_GEMV_SUMS") = choice_names(kHeadGemvSums);
  m.attr("ATTENTION_SPLITS") = choice_names(kSparseMlaSplits);
  m.attr("INDEXER_LOGITS") = choice_names(kIndexerLogits);

  m.def(
      "describe", [](const Array& a, bool fp8) { return to_view(a, "array", fp8).describe(); }, "array"_a,
      "fp8"_a = false, "The TensorView the library would see for this array (for tests and debugging).");

  // --- kernels -------------------------------------------------------------
  m.def(
      "qkv_rmsnorm",
      [](const Array& qkv, const Array& q_weight, const Array& kv_weight, float eps, const Array& q_out,
         const Array& kv_out, uintptr_t stream) {
        const dsa::TensorView qkv_view = to_view(qkv, "qkv"), q_weight_view = to_view(q_weight, "q_weight"),
                              kv_weight_view = to_view(kv_weight, "kv_weight"), q_out_view = to_view(q_out, "q_out"),
                              kv_out_view = to_view(kv_out, "kv_out");
        launch_released([&] {
          return dsa::qkv_rmsnorm(qkv_view, q_weight_view, kv_weight_view, eps, q_out_view, kv_out_view,
                                  to_stream(stream));
        });
      },
      "qkv"_a, "q_weight"_a, "kv_weight"_a, "eps"_a, "q_out"_a, "kv_out"_a, "stream"_a);

  m.def(
      "head_gemv",
      [](const Array& x, const Array& weight, const Array& out, const OptArray& scale, const OptArray& cache_kv,
         const OptArray& cache, const OptArray& slot_mapping, const OptArray& k_scale,
         const OptArray& cache_error_count, const std::string& sums, bool release_dependents_early, uintptr_t stream) {
        dsa::HeadGemvArgs args;
        args.x = to_view(x, "x");
        args.weight = to_view(weight, "weight");
        args.out = to_view(out, "out", /*fp8=*/scale.has_value());  // the FP8 out takes the quant's scale
        args.scale = to_view(scale, "scale");
        args.sums = head_gemv_sums(sums);
        args.release_dependents_early = release_dependents_early;
        dsa::KvCacheWrite write;
        if (cache) {
          write.kv = to_view(cache_kv, "cache.kv");
          write.cache = to_view(cache, "cache.cache", true);
          write.slot_mapping = to_view(slot_mapping, "cache.slot_mapping");
          write.k_scale = to_view(k_scale, "cache.k_scale");
          write.error_count = to_counter(cache_error_count, "cache.error_count");
          args.cache = &write;
        }
        launch_released([&] { return dsa::head_gemv(args, to_stream(stream)); });
      },
      "x"_a, "weight"_a, "out"_a, "scale"_a.none(), "cache_kv"_a.none(), "cache"_a.none(), "slot_mapping"_a.none(),
      "k_scale"_a.none(), "cache_error_count"_a.none(), "sums"_a, "release_dependents_early"_a, "stream"_a);

  m.def(
      "linear_gemv",
      [](const Array& x, const Array& weight, const Array& out, uintptr_t stream) {
        dsa::LinearGemvArgs args{to_view(x, "x"), to_view(weight, "weight"), to_view(out, "out")};
        launch_released([&] { return dsa::linear_gemv(args, to_stream(stream)); });
      },
      "x"_a, "weight"_a, "out"_a, "stream"_a);
  m.def("linear_gemv_supports", &dsa::linear_gemv_supports, "m"_a, "k"_a);

  m.def(
      "sparse_mla",
      [](const Array& q, const Array& q_scale, const Array& kv_cache, const Array& k_scale, const Array& indices,
         float softmax_scale, const Array& latent, const Array& lse, const Array& split_counters,
         const OptArray& split_partials, const std::string& splits, const OptArray& error_count, uintptr_t stream) {
        dsa::SparseMlaArgs args;
        args.q = to_view(q, "q", true);
        args.q_scale = to_view(q_scale, "q_scale");
        args.kv_cache = to_view(kv_cache, "kv_cache", true);
        args.k_scale = to_view(k_scale, "k_scale");
        args.indices = to_view(indices, "indices");
        args.softmax_scale = softmax_scale;
        args.latent = to_view(latent, "latent");
        args.lse = to_view(lse, "lse");
        args.split_counters = to_view(split_counters, "split_counters");
        args.split_partials = to_view(split_partials, "split_partials");
        args.splits = sparse_mla_splits(splits);
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::sparse_mla(args, to_stream(stream)); });
      },
      "q"_a, "q_scale"_a, "kv_cache"_a, "k_scale"_a, "indices"_a, "softmax_scale"_a, "latent"_a, "lse"_a,
      "split_counters"_a, "split_partials"_a.none(), "splits"_a, "error_count"_a.none(), "stream"_a);
  m.def("sparse_mla_split_counter_count", &dsa::sparse_mla_split_counter_count, "m"_a, "heads"_a, "top_k"_a);
  m.def("sparse_mla_split_partials_count", &dsa::sparse_mla_split_partials_count, "m"_a, "heads"_a, "top_k"_a);

  // --- indexer -------------------------------------------------------------
  m.def(
      "indexer_workspace_bytes",
      [](const IndexerPlanFields& plan_fields) {
        const dsa::IndexerPlan plan = indexer_plan(plan_fields);
        throw_if_error(dsa::check_indexer_plan(plan));
        return dsa::indexer_workspace_layout(plan).bytes;
      },
      "plan"_a);

  m.def(
      "indexer_project",
      [](const IndexerPlanFields& plan_fields, const Array& q_c, const Array& x, const Array& wq_b, const Array& wk,
         const Array& weights_proj, const Array& compress_gate, const Array& index_q, const Array& index_k,
         const Array& head_weights, const Array& gate, uintptr_t stream) {
        dsa::IndexerProjectArgs args;
        args.plan = indexer_plan(plan_fields);
        args.q_c = to_view(q_c, "q_c");
        args.x = to_view(x, "x");
        args.wq_b = to_view(wq_b, "wq_b");
        args.wk = to_view(wk, "wk");
        args.weights_proj = to_view(weights_proj, "weights_proj");
        args.compress_gate = to_view(compress_gate, "compress_gate");
        args.index_q = to_view(index_q, "index_q");
        args.index_k = to_view(index_k, "index_k");
        args.head_weights = to_view(head_weights, "head_weights");
        args.gate = to_view(gate, "gate");
        launch_released([&] { return dsa::indexer_project_gemv(args, to_stream(stream)); });
      },
      "plan"_a, "q_c"_a, "x"_a, "wq_b"_a, "wk"_a, "weights_proj"_a, "compress_gate"_a, "index_q"_a, "index_k"_a,
      "head_weights"_a, "gate"_a, "stream"_a);

  m.def(
      "indexer_prepare",
      [](const IndexerPlanFields& plan_fields, const Array& index_q, const Array& index_k, const Array& head_weights,
         const Array& gate, const Array& k_norm_weight, const Array& k_norm_bias, const Array& ape,
         const Array& positions, const Array& token_requests, const Array& block_table, const Array& ring_cache,
         const Array& k_cache, const Array& workspace, const OptArray& error_count, uintptr_t stream) {
        dsa::IndexerPrepareArgs args;
        args.plan = indexer_plan(plan_fields);
        args.index_q = to_view(index_q, "index_q");
        args.index_k = to_view(index_k, "index_k");
        args.head_weights = to_view(head_weights, "head_weights");
        args.gate = to_view(gate, "gate");
        args.k_norm_weight = to_view(k_norm_weight, "k_norm_weight");
        args.k_norm_bias = to_view(k_norm_bias, "k_norm_bias");
        args.ape = to_view(ape, "ape");
        args.positions = to_view(positions, "positions");
        args.token_requests = to_view(token_requests, "token_requests");
        args.state = indexer_state(block_table, ring_cache, k_cache);
        args.workspace = to_view(workspace, "workspace");
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::indexer_prepare(args, to_stream(stream)); });
      },
      "plan"_a, "index_q"_a, "index_k"_a, "head_weights"_a, "gate"_a, "k_norm_weight"_a, "k_norm_bias"_a, "ape"_a,
      "positions"_a, "token_requests"_a, "block_table"_a, "ring_cache"_a, "k_cache"_a, "workspace"_a,
      "error_count"_a.none(), "stream"_a);

  m.def(
      "indexer_select",
      [](const IndexerPlanFields& plan_fields, const Array& positions, const Array& token_requests,
         const Array& block_table, const Array& ring_cache, const Array& k_cache, const Array& workspace,
         const Array& slots, const OptArray& topk_positions, const OptArray& error_count, uintptr_t stream) {
        dsa::IndexerSelectArgs args;
        args.plan = indexer_plan(plan_fields);
        args.positions = to_view(positions, "positions");
        args.token_requests = to_view(token_requests, "token_requests");
        args.state = indexer_state(block_table, ring_cache, k_cache);
        args.workspace = to_view(workspace, "workspace");
        args.slots = to_view(slots, "slots");
        args.topk_positions = to_view(topk_positions, "topk_positions");
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::indexer_select(args, to_stream(stream)); });
      },
      "plan"_a, "positions"_a, "token_requests"_a, "block_table"_a, "ring_cache"_a, "k_cache"_a, "workspace"_a,
      "slots"_a, "topk_positions"_a.none(), "error_count"_a.none(), "stream"_a);

  m.def(
      "indexer_remap",
      [](const IndexerPlanFields& plan_fields, const Array& positions, const Array& token_requests,
         const Array& block_table, const Array& ring_cache, const Array& k_cache, const Array& topk_positions,
         const Array& slots, const OptArray& error_count, uintptr_t stream) {
        dsa::IndexerRemapArgs args;
        args.plan = indexer_plan(plan_fields);
        args.positions = to_view(positions, "positions");
        args.token_requests = to_view(token_requests, "token_requests");
        args.state = indexer_state(block_table, ring_cache, k_cache);
        args.topk_positions = to_view(topk_positions, "topk_positions");
        args.slots = to_view(slots, "slots");
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::indexer_remap(args, to_stream(stream)); });
      },
      "plan"_a, "positions"_a, "token_requests"_a, "block_table"_a, "ring_cache"_a, "k_cache"_a, "topk_positions"_a,
      "slots"_a, "error_count"_a.none(), "stream"_a);

  m.def(
      "indexer_prefill",
      [](const IndexerPlanFields& plan_fields, const Array& index_k, const Array& gate, const Array& k_norm_weight,
         const Array& k_norm_bias, const Array& ape, int request, const Array& block_table, const Array& ring_cache,
         const Array& k_cache, const OptArray& error_count, uintptr_t stream) {
        dsa::IndexerPrefillArgs args;
        args.plan = indexer_plan(plan_fields);
        args.index_k = to_view(index_k, "index_k");
        args.gate = to_view(gate, "gate");
        args.k_norm_weight = to_view(k_norm_weight, "k_norm_weight");
        args.k_norm_bias = to_view(k_norm_bias, "k_norm_bias");
        args.ape = to_view(ape, "ape");
        args.request = request;
        args.state = indexer_state(block_table, ring_cache, k_cache);
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::indexer_prefill(args, to_stream(stream)); });
      },
      "plan"_a, "index_k"_a, "gate"_a, "k_norm_weight"_a, "k_norm_bias"_a, "ape"_a, "request"_a, "block_table"_a,
      "ring_cache"_a, "k_cache"_a, "error_count"_a.none(), "stream"_a);

  // --- presets and the stage ----------------------------------------------
  m.def(
      "layer_config",
      [](const std::string& preset, int tp, float rms_norm_eps) {
        dsa::ModelPreset whole, rank;
        throw_if_error(dsa::find_preset(preset, &whole));
        throw_if_error(dsa::per_rank(whole, tp, &rank));
        const dsa::DsaLayerConfig c = dsa::dsa_layer_config(rank, rms_norm_eps);
        nb::dict d;
        d["hidden_size"] = c.hidden_size;
        d["num_heads"] = c.num_heads;
        d["q_lora_rank"] = c.q_lora_rank;
        d["kv_lora_rank"] = c.kv_lora_rank;
        d["qk_nope_head_dim"] = c.qk_nope_head_dim;
        d["qk_rope_head_dim"] = c.qk_rope_head_dim;
        d["v_head_dim"] = c.v_head_dim;
        d["softmax_scale"] = c.softmax_scale;
        d["rms_norm_eps"] = c.rms_norm_eps;
        d["fuse_qkv_rmsnorm"] = c.fuse_qkv_rmsnorm;
        d["rotary_embedding"] = c.rotary_embedding;
        d["indexer"] = c.indexer;
        d["skip_topk"] = c.skip_topk;
        d["gate_proj"] = c.gate_proj;
        d["dcp_query_replicate"] = c.dcp_query_replicate;
        d["kv_cache_dtype"] = c.kv_cache_dtype;
        d["padded_heads"] = c.padded_heads;
        d["prefill_context_parallel"] = c.prefill_context_parallel;
        d["hisparse_cache"] = c.hisparse_cache;
        d["decode_context_parallel_size"] = c.decode_context_parallel_size;
        return d;
      },
      "preset"_a, "tp"_a, "rms_norm_eps"_a);

  m.def(
      "stage_supports",
      [](int max_tokens, int64_t m, int64_t num_actual_tokens, int64_t num_decode_tokens) {
        dsa::DsaStagePlan plan;
        plan.max_tokens = max_tokens;
        return dsa::dsa_stage_supports(plan, m, num_actual_tokens, num_decode_tokens);
      },
      "max_tokens"_a, "m"_a, "num_actual_tokens"_a, "num_decode_tokens"_a);

  nb::class_<Stage>(m, "Stage")
      .def(
          "__init__",
          [](Stage* self, const nb::dict& config, const nb::dict& weights, const nb::dict& plan) {
            dsa::DsaLayerConfig c;
            c.hidden_size = nb::cast<int64_t>(config["hidden_size"]);
            c.num_heads = nb::cast<int64_t>(config["num_heads"]);
            c.q_lora_rank = nb::cast<int64_t>(config["q_lora_rank"]);
            c.kv_lora_rank = nb::cast<int64_t>(config["kv_lora_rank"]);
            c.qk_nope_head_dim = nb::cast<int64_t>(config["qk_nope_head_dim"]);
            c.qk_rope_head_dim = nb::cast<int64_t>(config["qk_rope_head_dim"]);
            c.v_head_dim = nb::cast<int64_t>(config["v_head_dim"]);
            c.softmax_scale = nb::cast<float>(config["softmax_scale"]);
            c.rms_norm_eps = nb::cast<float>(config["rms_norm_eps"]);
            c.fuse_qkv_rmsnorm = nb::cast<bool>(config["fuse_qkv_rmsnorm"]);
            c.rotary_embedding = nb::cast<bool>(config["rotary_embedding"]);
            c.indexer = nb::cast<bool>(config["indexer"]);
            c.skip_topk = nb::cast<bool>(config["skip_topk"]);
            c.gate_proj = nb::cast<bool>(config["gate_proj"]);
            c.dcp_query_replicate = nb::cast<bool>(config["dcp_query_replicate"]);
            c.kv_cache_dtype = nb::cast<std::string>(config["kv_cache_dtype"]);
            c.padded_heads = nb::cast<bool>(config["padded_heads"]);
            c.prefill_context_parallel = nb::cast<bool>(config["prefill_context_parallel"]);
            c.hisparse_cache = nb::cast<bool>(config["hisparse_cache"]);
            c.decode_context_parallel_size = nb::cast<int>(config["decode_context_parallel_size"]);

            // Absent weights stay empty views: create names each one missing.
            std::vector<Array> imported;
            auto weight = [&](const char* key) {
              if (!weights.contains(key) || weights[key].is_none()) return dsa::TensorView{};
              imported.push_back(nb::cast<Array>(weights[key]));
              return to_view(imported.back(), key);
            };
            dsa::DsaLayerWeights w;
            w.fused_qkv_a_proj = weight("fused_qkv_a_proj");
            w.q_a_norm = weight("q_a_norm");
            w.kv_a_norm = weight("kv_a_norm");
            w.q_b_proj = weight("q_b_proj");
            w.w_uk_t = weight("w_uk_t");
            w.w_uv = weight("w_uv");
            w.o_proj = weight("o_proj");
            w.q_scale = weight("q_scale");
            w.k_scale = weight("k_scale");
            w.index_wq_b = weight("index_wq_b");
            w.index_wk = weight("index_wk");
            w.index_weights_proj = weight("index_weights_proj");
            w.index_compress_gate = weight("index_compress_gate");
            w.index_k_norm_weight = weight("index_k_norm_weight");
            w.index_k_norm_bias = weight("index_k_norm_bias");
            w.index_ape = weight("index_ape");

            dsa::DsaStagePlan p;
            p.max_tokens = nb::cast<int>(plan["max_tokens"]);
            p.max_context = nb::cast<int64_t>(plan["max_context"]);
            p.ring = nb::cast<int>(plan["ring"]);
            p.block_size = nb::cast<int>(plan["block_size"]);
            if (!plan["value_up_tokens"].is_none()) {
              p.value_up_tokens = nb::cast<std::set<int>>(plan["value_up_tokens"]);
            }
            p.head_gemv_sums = head_gemv_sums(nb::cast<std::string>(plan["head_gemv_sums"]));
            p.indexer_logits = indexer_logits(nb::cast<std::string>(plan["indexer_logits"]));
            p.attention_splits = sparse_mla_splits(nb::cast<std::string>(plan["attention_splits"]));
            p.indexer_projections_cublaslt = nb::cast<bool>(plan["indexer_projections_cublaslt"]);
            if (!plan["projection_gemv_tokens"].is_none()) {
              p.projection_gemv_tokens = nb::cast<std::set<int>>(plan["projection_gemv_tokens"]);
            }
            p.overlap_indexer = nb::cast<bool>(plan["overlap_indexer"]);
            p.stock_select_fused = nb::cast<bool>(plan["stock_select_fused"]);

            std::unique_ptr<dsa::DsaAttentionStage> stage;
            throw_if_error(dsa::DsaAttentionStage::create(c, w, p, &stage));
            new (self) Stage{std::move(stage), std::move(imported), {}};
          },
          "config"_a, "weights"_a, "plan"_a)
      .def(
          "supports",
          [](const Stage& s, int64_t m, int64_t num_actual_tokens, int64_t num_decode_tokens) {
            return s.stage->supports(m, num_actual_tokens, num_decode_tokens);
          },
          "m"_a, "num_actual_tokens"_a, "num_decode_tokens"_a)
      .def(
          "run",
          [](Stage& s, bool stock, const Array& hidden, const Array& positions, const Array& token_requests,
             const Array& slot_mapping, const Array& kv_cache, const Array& block_table, const Array& ring,
             const Array& index_k_cache, const Array& out, const OptArray& topk_positions, const OptArray& error_count,
             uintptr_t stream) {
            const dsa::DsaStepArgs args = step_args(hidden, positions, token_requests, slot_mapping, kv_cache,
                                                    block_table, ring, index_k_cache, out, topk_positions, error_count);
            launch_released([&] {
              const std::lock_guard<std::mutex> one_call(s.calls);
              return stock ? s.stage->stock_forward(args, to_stream(stream))
                           : s.stage->forward(args, to_stream(stream));
            });
          },
          "stock"_a, "hidden"_a, "positions"_a, "token_requests"_a, "slot_mapping"_a, "kv_cache"_a, "block_table"_a,
          "ring"_a, "index_k_cache"_a, "out"_a, "topk_positions"_a.none(), "error_count"_a.none(), "stream"_a)
      .def(
          "run_steps",
          [](Stage& s, bool stock, size_t first, size_t count, const Array& hidden, const Array& positions,
             const Array& token_requests, const Array& slot_mapping, const Array& kv_cache, const Array& block_table,
             const Array& ring, const Array& index_k_cache, const Array& out, const OptArray& topk_positions,
             const OptArray& error_count, uintptr_t stream) {
            const dsa::DsaStepArgs args = step_args(hidden, positions, token_requests, slot_mapping, kv_cache,
                                                    block_table, ring, index_k_cache, out, topk_positions, error_count);
            launch_released([&] {
              const std::lock_guard<std::mutex> one_call(s.calls);
              return s.stage->run_steps(stock ? dsa::DsaPath::kStock : dsa::DsaPath::kFused, args, first, count,
                                        to_stream(stream));
            });
          },
          "stock"_a, "first"_a, "count"_a, "hidden"_a, "positions"_a, "token_requests"_a, "slot_mapping"_a,
          "kv_cache"_a, "block_table"_a, "ring"_a, "index_k_cache"_a, "out"_a, "topk_positions"_a.none(),
          "error_count"_a.none(), "stream"_a)
      .def(
          "step_names",
          [](const Stage& s, bool stock, const Array& hidden, const Array& positions, const Array& token_requests,
             const Array& slot_mapping, const Array& kv_cache, const Array& block_table, const Array& ring,
             const Array& index_k_cache, const Array& out, const OptArray& topk_positions) {
            const dsa::DsaStepArgs args = step_args(hidden, positions, token_requests, slot_mapping, kv_cache,
                                                    block_table, ring, index_k_cache, out, topk_positions, {});
            std::vector<std::string> names;
            throw_if_error(s.stage->step_names(stock ? dsa::DsaPath::kStock : dsa::DsaPath::kFused, args, &names));
            return names;
          },
          "stock"_a, "hidden"_a, "positions"_a, "token_requests"_a, "slot_mapping"_a, "kv_cache"_a, "block_table"_a,
          "ring"_a, "index_k_cache"_a, "out"_a, "topk_positions"_a.none())
      .def(
          "intermediates",
          [](nb::handle self, int64_t m) {
            const Stage& s = nb::cast<const Stage&>(self);
            if (m < 1 || m > s.stage->plan().max_tokens) {
              throw_invalid("m", "1.." + std::to_string(s.stage->plan().max_tokens), std::to_string(m));
            }
            const dsa::DsaStageIntermediates v = s.stage->intermediates(m);
            nb::dict d;
            d["qkv"] = stage_array(v.qkv, self);
            d["q_c"] = stage_array(v.q_c, self);
            d["kv_c"] = stage_array(v.kv_c, self);
            d["q"] = stage_array(v.q, self);
            d["q_fp8"] = stage_array(v.q_fp8, self);
            d["index_q"] = stage_array(v.index_q, self);
            d["index_k"] = stage_array(v.index_k, self);
            d["head_weights"] = stage_array(v.head_weights, self);
            d["gate"] = stage_array(v.gate, self);
            d["index_logits"] = stage_array(v.index_logits, self);
            d["topk_positions"] = stage_array(v.topk_positions, self);
            d["slots"] = stage_array(v.slots, self);
            d["latent"] = stage_array(v.latent, self);
            d["lse"] = stage_array(v.lse, self);
            d["heads"] = stage_array(v.heads, self);
            return d;
          },
          "m"_a)
      .def_prop_ro("max_tokens", [](const Stage& s) { return s.stage->plan().max_tokens; })
      .def_prop_ro("value_up_tokens", [](const Stage& s) {
        const auto& plan = s.stage->plan();
        return plan.value_up_tokens.value_or(
            dsa::dsa_stage_measured_value_up_tokens(s.stage->config().num_heads, plan.head_gemv_sums));
      });

  // --- CPU references (NumPy in and out; BF16 as uint16 bits) -------------
  nb::module_ ref = m.def_submodule("reference", "The library's CPU references, for bitwise comparisons");
  ref.def(
      "linear_gemv",
      [](const Array& x, const Array& weight) {
        if (x.ndim() != 2 || weight.ndim() != 2 || x.shape(1) != weight.shape(1)) {
          throw_invalid("x, weight", "[m, k] and [n, k]", "other shapes");
        }
        const int64_t m_ = x.shape(0), k = x.shape(1), n = weight.shape(0);
        if (k % 8 != 0) throw_invalid("x", "k a multiple of 8", std::to_string(k));
        const uint16_t* xp = host_data<uint16_t>(x, "x", nb::dtype<uint16_t>(), m_ * k);
        const uint16_t* wp = host_data<uint16_t>(weight, "weight", nb::dtype<uint16_t>(), n * k);
        std::vector<uint16_t> out = dsa::reference::linear_gemv(std::vector<uint16_t>(xp, xp + m_ * k), m_, k,
                                                                std::vector<uint16_t>(wp, wp + n * k), n);
        return numpy_from(std::move(out), {size_t(m_), size_t(n)});
      },
      "x"_a, "weight"_a, "linear_gemv's fixed order: [m, k] x [n, k]^T BF16 bits (uint16) -> [m, n] BF16 bits");
  ref.def(
      "qkv_rmsnorm",
      [](const Array& qkv, const Array& q_weight, const Array& kv_weight, float eps) {
        if (qkv.ndim() != 2 || q_weight.ndim() != 1 || kv_weight.ndim() != 1) {
          throw_invalid("qkv, q_weight, kv_weight", "[m, q_size + kv_size], [q_size], [kv_size]", "other ranks");
        }
        const int64_t m_ = qkv.shape(0), q_size = q_weight.shape(0), kv_size = kv_weight.shape(0);
        const uint16_t* xp = host_data<uint16_t>(qkv, "qkv", nb::dtype<uint16_t>(), m_ * (q_size + kv_size));
        const uint16_t* qw = host_data<uint16_t>(q_weight, "q_weight", nb::dtype<uint16_t>(), q_size);
        const uint16_t* kw = host_data<uint16_t>(kv_weight, "kv_weight", nb::dtype<uint16_t>(), kv_size);
        std::vector<uint16_t> q_out(size_t(m_ * q_size)), kv_out(size_t(m_ * kv_size));
        dsa::reference::qkv_rmsnorm(xp, q_size + kv_size, qw, kw, int(m_), int(q_size), int(kv_size), eps, q_out.data(),
                                    kv_out.data());
        return nb::make_tuple(numpy_from(std::move(q_out), {size_t(m_), size_t(q_size)}),
                              numpy_from(std::move(kv_out), {size_t(m_), size_t(kv_size)}));
      },
      "qkv"_a, "q_weight"_a, "kv_weight"_a, "eps"_a,
      "qkv_rmsnorm's order (BF16 bits as uint16): -> (q_out [m, q_size], kv_out [m, kv_size])");
  ref.def(
      "head_gemv",
      [](const Array& x, const Array& weight, std::optional<float> fp8_scale) {
        if (x.ndim() != 3 || weight.ndim() != 3 || x.shape(1) != weight.shape(0) || x.shape(2) != weight.shape(1)) {
          throw_invalid("x, weight", "[m, H, I] and [H, I, J]", "other shapes");
        }
        const int m_ = int(x.shape(0)), heads = int(x.shape(1)), rows = int(x.shape(2)), cols = int(weight.shape(2));
        dsa::reference::HeadGemvHost a;
        a.x = host_data<uint16_t>(x, "x", nb::dtype<uint16_t>(), int64_t(m_) * heads * rows);
        a.x_token_stride = int64_t(heads) * rows;
        a.weight = host_data<uint16_t>(weight, "weight", nb::dtype<uint16_t>(), int64_t(heads) * rows * cols);
        a.weight_head_stride = int64_t(rows) * cols;
        a.weight_row_stride = cols;
        a.m = m_;
        a.heads = heads;
        a.rows = rows;
        a.cols = cols;
        const dsa::HeadGemvTactic tactic = dsa::head_gemv_tactic(a.heads, a.rows, a.cols, a.m);
        const std::vector<size_t> shape{size_t(a.m), size_t(a.heads), size_t(a.cols)};
        if (fp8_scale) return nb::cast(numpy_from(dsa::reference::head_gemv_fp8(a, tactic, *fp8_scale), shape));
        return nb::cast(numpy_from(dsa::reference::head_gemv_bf16(a, tactic), shape));
      },
      "x"_a, "weight"_a, "fp8_scale"_a.none() = nb::none(),
      "head_gemv's seed order with the table's tactic: BF16 bits (uint16) in; BF16 bits out, or e4m3 codes "
      "(uint8) when fp8_scale is given");
}
