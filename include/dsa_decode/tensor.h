// A framework-free tensor view: pointer, dtype, shape, strides (in elements)
// and device; it owns nothing. Every entry point checks its views with the
// helpers below; errors name the argument, what it was and what was expected.
// Rule: the stride of a dimension of size 1 is never checked (its index is
// always 0; producers such as DLPack exporters disagree on it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "dsa_decode/status.h"

namespace dsa {

enum class DType : uint8_t { kBF16, kF16, kF32, kFP8E4M3, kI32, kI64, kU8 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

enum class DeviceKind : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceKind kind = DeviceKind::kCUDA;
  int index = 0;
};

inline constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kU8;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements
  Device device;

  int64_t size(int dim) const { return shape[dim]; }
  int64_t stride(int dim) const { return strides[dim]; }
  int64_t numel() const;
  bool is_contiguous() const;
  // Elements from the first to one past the last addressable element.
  int64_t span_elements() const;
  // e.g. "bf16[4, 64, 256] strides [16384, 256, 1] on cuda:0"
  std::string describe() const;
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// A contiguous (row-major) view. More than kMaxDims sizes give an invalid view
// (ndim -1) that every check rejects.
TensorView make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape,
                       Device device = Device{});
TensorView make_strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                        std::initializer_list<int64_t> strides, Device device = Device{});

// Argument checks. `name` is the caller-facing argument name.
// Non-null data, 0..kMaxDims dimensions, non-negative sizes.
// Rows [first, first + count) of dim 0 of `t`, strides kept (no checks: the
// caller keeps the range inside t).
TensorView slice_rows(const TensorView& t, int64_t first, int64_t count);

Status check_present(const TensorView& t, const char* name);
Status check_dtype(const TensorView& t, const char* name, DType expected);
// `expected` entries of -1 match any size.
Status check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expected);
// Passes for any stride when dim `dim` has size 1 (the rule above).
Status check_stride(const TensorView& t, const char* name, int dim, int64_t expected);
// data pointer aligned to `bytes`
Status check_aligned(const TensorView& t, const char* name, size_t bytes);
Status check_on_cuda(const TensorView& t, const char* name);
// An optional device counter (atomicAdd): null or 4-byte aligned.
Status check_error_counter(const unsigned int* counter, const char* name);
// Per-head rows [m, heads, dim] of `dtype` as the kernels read them, 16 bytes at
// a time: dims 1-2 packed (strides dim, 1), a token stride that is a multiple
// of 8 elements and at least heads * dim (any when m == 1: a size-1 dimension's
// stride is never used), data 16-byte aligned, on CUDA.
Status check_head_rows(const TensorView& t, const char* name, DType dtype, int64_t m, int64_t heads, int64_t dim);
// BF16 rows [rows, cols] as the kernels and cuBLASLt read them 16 bytes at
// a time: dim 1 contiguous, a row stride that is a multiple of 8 elements
// and at least cols (any when rows == 1: a size-1 dimension's stride is
// never used), data 16-byte aligned, on CUDA.
Status check_bf16_rows(const TensorView& t, const char* name, int64_t rows, int64_t cols);
// Whether the byte ranges the two views can address intersect.
bool tensors_overlap(const TensorView& a, const TensorView& b);
// A tensor a kernel writes must not share memory with another argument.
Status check_no_overlap(const TensorView& written, const char* written_name, const TensorView& other,
                        const char* other_name);

std::string shape_string(std::initializer_list<int64_t> shape);

}  // namespace dsa
