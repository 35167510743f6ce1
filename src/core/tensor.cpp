#include "dsa_decode/tensor.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace dsa {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF32: return 4;
    case DType::kFP8E4M3: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF32: return "f32";
    case DType::kFP8E4M3: return "fp8_e4m3";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU8: return "u8";
  }
  return "unknown";
}

// ndim clamped to the arrays' size: a view filled in by hand (a DLPack adapter)
// may claim more; the checks reject such a view, and nothing here reads past it.
static int valid_dims(const TensorView& t) { return std::clamp(t.ndim, 0, kMaxDims); }

// Saturating products: a hand-filled view's sizes may overflow int64 (the
// checks reject such a view; nothing here may be undefined on the way).
static int64_t saturating_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return ((a < 0) != (b < 0)) ? INT64_MIN : INT64_MAX;
  return r;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < valid_dims(*this); ++d) n = saturating_mul(n, shape[d]);
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = valid_dims(*this) - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected = saturating_mul(expected, shape[d]);
  }
  return true;
}

// Element offsets [*low, *high] of the first and last addressable elements
// (negative strides reach below data); false when the view is empty, has a
// negative size or an offset overflows int64.
static bool element_extent(const TensorView& t, int64_t* low, int64_t* high) {
  *low = *high = 0;
  for (int d = 0; d < valid_dims(t); ++d) {
    if (t.shape[d] <= 0) return false;
  }
  for (int d = 0; d < valid_dims(t); ++d) {
    int64_t reach;
    if (__builtin_mul_overflow(t.shape[d] - 1, t.strides[d], &reach)) return false;
    if (__builtin_add_overflow(reach < 0 ? *low : *high, reach, reach < 0 ? low : high)) return false;
  }
  return true;
}

// Byte addresses [*begin, *end) the view can touch; false when they overflow
// or leave [0, 2^63).
static bool byte_extent(const TensorView& t, uint64_t* begin, uint64_t* end) {
  int64_t low, high;
  if (!element_extent(t, &low, &high)) return false;
  const auto size = static_cast<int64_t>(dtype_size(t.dtype));
  int64_t low_bytes, high_bytes;
  if (__builtin_mul_overflow(low, size, &low_bytes) || __builtin_mul_overflow(high + 1, size, &high_bytes)) return false;
  const auto base = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data) & (uint64_t{INT64_MAX}));
  if (reinterpret_cast<uintptr_t>(t.data) > uint64_t{INT64_MAX}) return false;
  int64_t first, last;
  if (__builtin_add_overflow(base, low_bytes, &first) || __builtin_add_overflow(base, high_bytes, &last)) return false;
  if (first < 0) return false;
  *begin = static_cast<uint64_t>(first);
  *end = static_cast<uint64_t>(last);
  return true;
}

int64_t TensorView::span_elements() const {
  int64_t low, high;
  if (!element_extent(*this, &low, &high)) return 0;
  return high - low + 1;
}

static std::string join(const int64_t* values, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(values[i]);
  }
  return s + "]";
}

std::string shape_string(std::initializer_list<int64_t> shape) {
  std::string s = "[";
  int i = 0;
  for (int64_t v : shape) {
    if (i++) s += ", ";
    s += v < 0 ? std::string("*") : std::to_string(v);
  }
  return s + "]";
}

std::string TensorView::describe() const {
  if (data == nullptr) return "no tensor (null data)";
  std::string s = std::string(dtype_name(dtype)) + join(shape, valid_dims(*this)) + " strides " +
                  join(strides, valid_dims(*this));
  if (ndim != valid_dims(*this)) s += " (ndim " + std::to_string(ndim) + ")";
  s += device.kind == DeviceKind::kCUDA ? " on cuda:" + std::to_string(device.index) : " on cpu";
  return s;
}

TensorView make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    t.ndim = -1;  // rejected by every check: no view of more than kMaxDims dimensions
    return t;
  }
  t.ndim = static_cast<int>(shape.size());
  std::copy_n(shape.begin(), t.ndim, t.shape);
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

TensorView make_strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                        std::initializer_list<int64_t> strides, Device device) {
  TensorView t = make_tensor(data, dtype, shape, device);
  std::copy_n(strides.begin(), std::min<size_t>(strides.size(), t.ndim), t.strides);
  return t;
}

TensorView slice_rows(const TensorView& t, int64_t first, int64_t count) {
  TensorView r = t;
  r.data = static_cast<char*>(t.data) + first * t.stride(0) * static_cast<int64_t>(dtype_size(t.dtype));
  r.shape[0] = count;
  return r;
}

Status check_present(const TensorView& t, const char* name) {
  if (t.data == nullptr) return invalid_argument(name, "a tensor", "a null pointer");
  if (t.ndim < 0 || t.ndim > kMaxDims) {
    return invalid_argument(name, "0.." + std::to_string(kMaxDims) + " dimensions", std::to_string(t.ndim));
  }
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) return invalid_argument(name, "non-negative sizes", t.describe());
  }
  // Sizes and strides whose byte range overflows int64 or wraps the address
  // space: no kernel's offset arithmetic may take them (an empty view addresses nothing).
  uint64_t begin, end;
  if (t.numel() != 0 && !byte_extent(t, &begin, &end)) {
    return invalid_argument(name, "sizes and strides whose byte range fits in 63 bits", t.describe());
  }
  return Status();
}

Status check_head_rows(const TensorView& t, const char* name, DType dtype, int64_t m, int64_t heads, int64_t dim) {
  DSA_RETURN_IF_ERROR(check_dtype(t, name, dtype));
  DSA_RETURN_IF_ERROR(check_shape(t, name, {m, heads, dim}));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  DSA_RETURN_IF_ERROR(check_stride(t, name, 2, 1));
  DSA_RETURN_IF_ERROR(check_stride(t, name, 1, dim));
  if (m > 1 && (t.stride(0) % 8 != 0 || t.stride(0) < heads * dim)) {
    return invalid_argument(name,
                            "a token stride that is a multiple of 8 and at least heads * dim = " +
                                std::to_string(heads * dim),
                            t.describe());
  }
  return check_aligned(t, name, 16);
}

Status check_bf16_rows(const TensorView& t, const char* name, int64_t rows, int64_t cols) {
  DSA_RETURN_IF_ERROR(check_present(t, name));
  DSA_RETURN_IF_ERROR(check_dtype(t, name, DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(t, name, {rows, cols}));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  DSA_RETURN_IF_ERROR(check_aligned(t, name, 16));
  DSA_RETURN_IF_ERROR(check_stride(t, name, 1, 1));
  if (rows > 1 && (t.stride(0) % 8 != 0 || t.stride(0) < cols)) {
    return invalid_argument(name, "a row stride of a multiple of 8 elements, at least " + std::to_string(cols),
                            t.describe());
  }
  return Status();
}

bool tensors_overlap(const TensorView& a, const TensorView& b) {
  if (a.data == nullptr || b.data == nullptr || a.numel() == 0 || b.numel() == 0) return false;
  uint64_t begin_a, end_a, begin_b, end_b;
  // A view whose range cannot be computed is rejected by check_present; here
  // it conservatively overlaps everything.
  if (!byte_extent(a, &begin_a, &end_a) || !byte_extent(b, &begin_b, &end_b)) return true;
  return begin_a < end_b && begin_b < end_a;
}

Status check_no_overlap(const TensorView& written, const char* written_name, const TensorView& other,
                        const char* other_name) {
  if (!tensors_overlap(written, other)) return Status();
  return invalid_argument(written_name, std::string("memory disjoint from '") + other_name + "'",
                          written.describe() + " overlapping " + other.describe());
}

Status check_dtype(const TensorView& t, const char* name, DType expected) {
  DSA_RETURN_IF_ERROR(check_present(t, name));
  if (t.dtype != expected) return invalid_argument(name, std::string("dtype ") + dtype_name(expected), t.describe());
  return Status();
}

Status check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expected) {
  DSA_RETURN_IF_ERROR(check_present(t, name));
  bool match = t.ndim == static_cast<int>(expected.size());
  int d = 0;
  for (int64_t e : expected) {
    if (!match) break;
    match = e < 0 || t.shape[d] == e;
    ++d;
  }
  if (!match) return invalid_argument(name, "shape " + shape_string(expected), t.describe());
  return Status();
}

Status check_stride(const TensorView& t, const char* name, int dim, int64_t expected) {
  if (t.shape[dim] != 1 && t.strides[dim] != expected) {
    return invalid_argument(name, "stride " + std::to_string(expected) + " in dim " + std::to_string(dim),
                            t.describe());
  }
  return Status();
}

Status check_aligned(const TensorView& t, const char* name, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(t.data) % bytes != 0) {
    return invalid_argument(name, "data aligned to " + std::to_string(bytes) + " bytes", t.describe());
  }
  return Status();
}

Status check_error_counter(const unsigned int* counter, const char* name) {
  if (reinterpret_cast<uintptr_t>(counter) % alignof(unsigned int) != 0) {
    return invalid_argument(name, "a 4-byte aligned device counter or null", "a misaligned pointer");
  }
  return Status();
}

Status check_on_cuda(const TensorView& t, const char* name) {
  if (t.device.kind != DeviceKind::kCUDA) return invalid_argument(name, "a CUDA tensor", t.describe());
  return Status();
}

}  // namespace dsa
