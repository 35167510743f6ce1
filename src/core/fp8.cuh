// e4m3 -> FP16 / FP32 on the device, for the kernels that read FP8 codes
// (sparse_mla's cache rows and q, the indexer's keys and queries). Every e4m3
// value is an FP16 value, so one cvt.rn.f16x2.e4m3x2 per pair is exact; NaN
// stays NaN (e4m3 has no infinities).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace dsa {

// The two codes in the low 16 bits of `codes` (low byte first) as FP16x2 bits.
// Inline PTX: the cuda_fp8.h intrinsic, the same instruction, made the
// tensor-core sparse_mla kernel spill registers.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t codes) {
  uint32_t out;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(static_cast<uint16_t>(codes)));
  return out;
}

// The same two codes as floats (through the intrinsic, which schedules
// better than the opaque PTX in the FP32 and FP64 decoders that use this).
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t codes) {
  return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes), __NV_E4M3)));
}

}  // namespace dsa
