#include "bind_common.h"

#include <cmath>
#include <cstdio>

namespace dsa_python {

void register_exceptions(nb::module_& m) {
  nb::exception<InvalidArgumentError>(m, "InvalidArgument", PyExc_ValueError);
  nb::exception<UnsupportedError>(m, "Unsupported", PyExc_NotImplementedError);
  nb::exception<CudaError>(m, "CudaError", PyExc_RuntimeError);
  nb::exception<CublasError>(m, "CublasError", PyExc_RuntimeError);
  nb::exception<NoDeviceError>(m, "NoDevice", PyExc_RuntimeError);
}

void throw_if_error(const dsa::Status& status) {
  if (status.ok()) return;
  const std::string text = status.to_string();
  switch (status.code()) {
    case dsa::ErrorCode::kInvalidArgument:
      throw InvalidArgumentError(text);
    case dsa::ErrorCode::kUnsupported:
      throw UnsupportedError(text);
    case dsa::ErrorCode::kCublasError:
      throw CublasError(text);
    case dsa::ErrorCode::kNoDevice:
      throw NoDeviceError(text);
    case dsa::ErrorCode::kCudaError:
    case dsa::ErrorCode::kOk:
      break;
  }
  throw CudaError(text);
}

void throw_invalid(const std::string& name, const std::string& expected, const std::string& got) {
  throw InvalidArgumentError(dsa::invalid_argument(name, expected, got).to_string());
}

namespace {

// DLPack 1.1's float8_e4m3fn code (kDLFloat8_e4m3fn).
constexpr uint8_t kDlpackFloat8E4m3fn = 10;

// NumPy's and PyTorch's name of a DLPack dtype.
std::string dtype_name(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  std::string name;
  switch (t.code) {
    case uint8_t(Code::Int):
      name = "int" + std::to_string(t.bits);
      break;
    case uint8_t(Code::UInt):
      name = "uint" + std::to_string(t.bits);
      break;
    case uint8_t(Code::Float):
      name = "float" + std::to_string(t.bits);
      break;
    case uint8_t(Code::Bfloat):
      name = "bfloat" + std::to_string(t.bits);
      break;
    case uint8_t(Code::Complex):
      name = "complex" + std::to_string(t.bits);
      break;
    case uint8_t(Code::Bool):
      name = "bool";
      break;
    case kDlpackFloat8E4m3fn:
      name = "float8_e4m3fn";
      break;
    default:
      name = "DLPack type code " + std::to_string(int(t.code)) + " of " + std::to_string(int(t.bits)) + " bits";
  }
  if (t.lanes != 1) name += " x" + std::to_string(int(t.lanes)) + " lanes";
  return name;
}

std::string join(const Array& a, bool strides) {
  std::string s = "[";
  for (size_t d = 0; d < a.ndim(); ++d) {
    s += (d == 0 ? "" : ", ") + std::to_string(strides ? a.stride(d) : int64_t(a.shape(d)));
  }
  return s + "]";
}

std::string device_name(const Array& a) {
  if (a.device_type() == nb::device::cuda::value) return "cuda:" + std::to_string(a.device_id());
  if (a.device_type() == nb::device::cpu::value) return "cpu";
  return "DLPack device type " + std::to_string(a.device_type());
}

dsa::DType to_dtype(const Array& a, const char* name, bool fp8) {
  using Code = nb::dlpack::dtype_code;
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes == 1 && fp8) {
    const bool byte =
        t.bits == 8 && (t.code == uint8_t(Code::UInt) || t.code == uint8_t(Code::Int) || t.code == kDlpackFloat8E4m3fn);
    if (!byte) throw_invalid(name, "FP8 e4m3 (float8_e4m3fn, or its uint8 view)", describe_array(a));
    return dsa::DType::kFP8E4M3;
  }
  if (t.lanes == 1) {
    if (t.code == uint8_t(Code::Bfloat) && t.bits == 16) return dsa::DType::kBF16;
    if (t.code == uint8_t(Code::Float) && t.bits == 16) return dsa::DType::kF16;
    if (t.code == uint8_t(Code::Float) && t.bits == 32) return dsa::DType::kF32;
    if (t.code == uint8_t(Code::Int) && t.bits == 32) return dsa::DType::kI32;
    if (t.code == uint8_t(Code::Int) && t.bits == 64) return dsa::DType::kI64;
    if (t.code == uint8_t(Code::UInt) && t.bits == 8) return dsa::DType::kU8;
    if (t.code == kDlpackFloat8E4m3fn && t.bits == 8) return dsa::DType::kFP8E4M3;
  }
  throw_invalid(name, "bfloat16, float16, float32, int32, int64, uint8 or float8_e4m3fn", describe_array(a));
}

// The CUDA device the library launches on (cudaGetDevice), asked only when
// a CUDA array arrives, so CPU-only machines never ask.
int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  return device;
}

}  // namespace

std::string describe_array(const Array& a) {
  return dtype_name(a.dtype()) + join(a, false) + " strides " + join(a, true) + " on " + device_name(a);
}

dsa::TensorView to_view(const Array& a, const char* name, bool fp8) {
  dsa::TensorView v;
  if (a.ndim() > size_t(dsa::kMaxDims)) {
    throw_invalid(name, "at most " + std::to_string(dsa::kMaxDims) + " dimensions",
                  std::to_string(a.ndim()) + " dimensions: " + describe_array(a));
  }
  v.data = a.data();
  v.dtype = to_dtype(a, name, fp8);
  v.ndim = int(a.ndim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = int64_t(a.shape(d));
    v.strides[d] = a.stride(d);
  }
  for (int d = 0; d < v.ndim; ++d) {
    if (v.shape[d] != 1 && v.strides[d] < 0) throw_invalid(name, "non-negative strides", describe_array(a));
  }
  const int device_type = a.device_type();
  if (device_type == nb::device::cuda::value) {
    v.device = dsa::Device{dsa::DeviceKind::kCUDA, a.device_id()};
    const int device = current_device();
    if (a.device_id() != device) {
      throw_invalid(
          name,
          "an array on the current device cuda:" + std::to_string(device) + " (torch.cuda.device(...) selects it)",
          describe_array(a));
    }
  } else if (device_type == nb::device::cpu::value) {
    v.device = dsa::Device{dsa::DeviceKind::kCPU, 0};
  } else {
    throw_invalid(name, "memory on a CUDA device or the CPU", describe_array(a));
  }
  return v;
}

dsa::TensorView to_view(const OptArray& a, const char* name, bool fp8) {
  return a ? to_view(*a, name, fp8) : dsa::TensorView{};
}

unsigned int* to_counter(const OptArray& a, const char* name) {
  if (!a) return nullptr;
  const nb::dlpack::dtype t = a->dtype();
  const bool word = t.bits == 32 && t.lanes == 1 &&
                    (t.code == uint8_t(nb::dlpack::dtype_code::Int) || t.code == uint8_t(nb::dlpack::dtype_code::UInt));
  if (!word) throw_invalid(name, "an int32 or uint32 counter", describe_array(*a));
  if (a->size() < 1) throw_invalid(name, "at least one element", "an empty array: " + describe_array(*a));
  if (a->device_type() != nb::device::cuda::value) throw_invalid(name, "a CUDA array", describe_array(*a));
  return static_cast<unsigned int*>(a->data());
}

float positive_eps(double eps, const char* name) {
  if (!std::isfinite(eps) || eps <= 0 || float(eps) <= 0.0f || !std::isfinite(float(eps))) {
    char got[32];
    std::snprintf(got, sizeof(got), "%g", eps);
    throw_invalid(name, "a finite value > 0 (as a float; an RMSNorm epsilon such as 1e-6)", got);
  }
  return float(eps);
}

}  // namespace dsa_python
