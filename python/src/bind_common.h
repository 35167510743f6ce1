// What every family's binding shares: tensors in (DLPack arrays as
// TensorViews), Statuses out (as Python exceptions), the choice names of
// dsa_decode/choices.h, and the host arrays of the CPU references.
//
// Every tensor arrives as a DLPack-capable object (a PyTorch, CuPy or JAX
// array, a NumPy array for the CPU references), becomes a TensorView over
// the same memory (no copy), and the C++ entry point checks it; a non-ok
// Status becomes a Python exception carrying the same message. Streams
// arrive as integers (a cudaStream_t's value). Launches release the GIL.
//
// FP8 e4m3 tensors: DLPack carries float8 only from version 1.1 on, so the
// arguments the library reads as e4m3 take uint8 (or int8) views too.
#pragma once

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
// Every binding's type casters, in every translation unit (a caster missing
// from one makes that file's functions refuse the type at run time).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dsa_decode/choices.h"
#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa_python {

namespace nb = nanobind;
using namespace nanobind::literals;

using Array = nb::ndarray<>;
using OptArray = std::optional<nb::ndarray<>>;

// One C++ type per error code, each registered as its own Python exception
// (register_exceptions).
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

void register_exceptions(nb::module_& m);

// Raises the Status's exception; the message is Status::to_string(), the
// text a C++ caller would print.
void throw_if_error(const dsa::Status& status);

// "invalid argument: argument '<name>': expected <expected>, got <got>".
[[noreturn]] void throw_invalid(const std::string& name, const std::string& expected, const std::string& got);

// Runs a launch without the GIL (the argument checks and cuBLAS's host work
// take microseconds another Python thread can use) and raises its Status.
template <class Launch>
void launch_released(Launch&& launch) {
  dsa::Status status;
  {
    nb::gil_scoped_release release;
    status = launch();
  }
  throw_if_error(status);
}

// The array as the errors show it, by its DLPack dtype:
// "float64[4, 8] strides [8, 1] on cpu".
std::string describe_array(const Array& a);

// A view of the array's memory under the C++ argument name `name` (fp8: the
// argument is read as e4m3, so byte arrays are taken as such). Shape,
// strides, dtype and device are translated and the C++ checks judge them
// (a size-1 dimension's stride is passed on as given); the translation's
// own rules: at most kMaxDims dimensions, a dtype the library names,
// non-negative strides where the size is not 1, a CUDA array on the current
// device.
dsa::TensorView to_view(const Array& a, const char* name, bool fp8 = false);
dsa::TensorView to_view(const OptArray& a, const char* name, bool fp8 = false);

// An optional device error counter: a CUDA int32/uint32 array of at least one element.
unsigned int* to_counter(const OptArray& a, const char* name);

inline cudaStream_t to_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// A positive, finite epsilon that stays positive as a float.
float positive_eps(double eps, const char* name);

// The choice named `value` in one of choices.h's tables, or InvalidArgument
// naming `name` and the table's names.
template <class E, size_t N>
E parse_choice(const dsa::Choice<E> (&choices)[N], const std::string& value, const char* name) {
  E parsed{};
  if (!dsa::parse_choice(choices, value, &parsed)) throw_invalid(name, dsa::choice_list(choices), "'" + value + "'");
  return parsed;
}

// The table's names in its order (the default first), for the package's constants.
template <class E, size_t N>
nb::tuple choice_names(const dsa::Choice<E> (&choices)[N]) {
  nb::list names;
  for (const dsa::Choice<E>& c : choices) names.append(c.name);
  return nb::tuple(names);
}

// A CPU reference's input: a C-contiguous CPU array of T, which the errors
// call `dtype_name`; the caller checks its shape.
template <class T>
const T* host_data(const Array& a, const char* name, const char* dtype_name) {
  if (a.device_type() != nb::device::cpu::value) {
    throw_invalid(name, std::string("a CPU (NumPy) array of ") + dtype_name, describe_array(a));
  }
  if (a.dtype() != nb::dtype<T>()) throw_invalid(name, dtype_name, describe_array(a));
  int64_t expected_stride = 1;
  for (size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expected_stride) {
      throw_invalid(name, "a C-contiguous array", describe_array(a));
    }
    expected_stride *= int64_t(a.shape(d));
  }
  return static_cast<const T*>(a.data());
}

// A NumPy array that owns `values`.
template <class T>
nb::ndarray<nb::numpy, T> numpy_from(std::vector<T> values, std::vector<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape.size(), shape.data(), owner);
}

// One family each (bind_<family>.cpp).
void bind_norm(nb::module_& m);
void bind_linear(nb::module_& m);
void bind_head_gemv(nb::module_& m);
void bind_sparse_mla(nb::module_& m);
void bind_sparse_mla_v32(nb::module_& m);
void bind_rope(nb::module_& m);
void bind_indexer(nb::module_& m);
void bind_stage(nb::module_& m);
void bind_references(nb::module_& m);
void bind_checkpoint(nb::module_& m);

}  // namespace dsa_python
