// Conversions shared by host and device. Every rounding the kernels do goes
// through this header, so the CPU references reproduce the kernels' bits.
//
// On the device the helpers compile to the hardware instructions
// (cvt.rn.bf16.f32, cvt.rn.satfinite.e4m3x2.f32, div.rn.f32); on the host they
// are integer formulations of the same roundings. tests/numerics_test.cu checks
// the host formulations against independent ones on every BF16 and FP8 value
// and millions of FP32 values, and the device ones against the host ones.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#define DSA_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define DSA_HD inline
#endif

namespace dsa::num {

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr uint16_t kBF16CanonicalNaN = 0x7FFF;  // what cvt.rn.bf16.f32 gives for NaN
inline constexpr uint8_t kFp8E4M3NaN = 0x7F;

DSA_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

DSA_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

DSA_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// FP32 -> BF16, round to nearest even; NaN -> 0x7FFF; no flushing.
DSA_HD uint16_t float_to_bf16(float x) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
#else
  uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kBF16CanonicalNaN;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
#endif
}

// x rounded to BF16 and back: the value a BF16 store then load would give.
DSA_HD float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// E4M3 (the "fn" variant: no infinities, 0x7F/0xFF are NaN) -> FP32, exact.
DSA_HD float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xFu;
  const uint32_t mantissa = code & 0x7u;
  if ((code & 0x7Fu) == 0x7Fu) return bits_float(0x7FC00000u | sign);
  if (exponent == 0) {  // subnormal: mantissa * 2^-9, exact in FP32
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 512.0f);
    return bits_float(float_bits(magnitude) | sign);
  }
  return bits_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// FP32 -> E4M3 with round to nearest even and saturation to +-448 (infinities
// too); NaN -> 0x7F. Equals cvt.rn.satfinite.e4m3x2.f32, i.e.
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3).
DSA_HD uint8_t float_to_e4m3(float x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
#else
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return kFp8E4M3NaN;
  if (magnitude >= 0x43E00000u) return sign | 0x7Eu;  // >= 448 (ties at 464 go to 448 too)
  if (magnitude < 0x3C800000u) {                      // < 2^-6: E4M3 subnormal step 2^-9
    // magnitude * 2^9 is exact, so one round-to-even of it is the whole rounding.
    const float steps = bits_float(magnitude) * 512.0f;
    const uint32_t whole = static_cast<uint32_t>(steps);
    const float rest = steps - static_cast<float>(whole);
    const uint32_t rounded = whole + ((rest > 0.5f || (rest == 0.5f && (whole & 1u))) ? 1u : 0u);
    return sign | static_cast<uint8_t>(rounded);  // 8 steps is the smallest normal, code 0x08
  }
  // Normal: keep 3 mantissa bits, round to nearest even; a carry bumps the exponent.
  const uint32_t rounded = magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u);
  return sign | static_cast<uint8_t>((rounded >> 20) - (120u << 3));
#endif
}

// Division rounded to nearest (div.rn.f32), as PyTorch's and CUDA's default `/`.
DSA_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The stock static FP8 quant (vLLM scaled_fp8_conversion): clamp to +-448 with
// fminf/fmaxf, then the saturating conversion. fminf/fmaxf return the non-NaN
// operand, so a NaN input becomes +448 (0x7E), as in the stock kernel.
DSA_HD uint8_t quant_fp8_static(float x, float inverse_scale) {
  const float scaled = x * inverse_scale;
  return float_to_e4m3(fmaxf(fminf(scaled, kFp8E4M3Max), -kFp8E4M3Max));
}

// concat_and_cache_mla's FP8 store of one BF16 latent value: kv / k_scale
// (rounded division), saturating conversion; NaN stays NaN (0x7F).
DSA_HD uint8_t cache_fp8(uint16_t kv_bf16, float k_scale) {
  return float_to_e4m3(div_rn(bf16_to_float(kv_bf16), k_scale));
}

// The norm's two approximate operations, as Triton emits them (rsqrt.approx.f32,
// div.full.f32). The host versions are the rounded division and 1/sqrt in
// double rounded to float (within 1 FP32 ulp of the exact value); the device
// results differ from them by a few FP32 ulp, which is why the norm matches
// its CPU reference within 1 BF16 ulp and not bitwise.
DSA_HD float rsqrt_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rsqrt.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(x)));
#endif
}

DSA_HD float div_full(float a, float b) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
#else
  return a / b;
#endif
}

}  // namespace dsa::num
