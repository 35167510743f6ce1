// BF16 values as the kernels load them: 8 in a 16-byte piece (norm, the
// GEMVs).
#pragma once

#include <cstdint>

namespace dsa {

// The eight BF16 values of a 16-byte load as FP32 (exact), in memory order.
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&out)[8]) {
  const uint32_t pairs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(pairs[i] << 16);
    out[2 * i + 1] = __uint_as_float(pairs[i] & 0xFFFF0000u);
  }
}

}  // namespace dsa
