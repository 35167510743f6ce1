// A kernel parameter pair taken from a checked TensorView: its data and its
// row stride.
#pragma once

#include <cstdint>

#include "dsa_decode/tensor.h"

namespace dsa {

// data = t's data as T*, stride = t's stride along dim 0 (elements).
template <class T>
inline void set_rows(T*& data, int64_t& stride, const TensorView& t) {
  data = static_cast<T*>(t.data);
  stride = t.stride(0);
}

}  // namespace dsa
