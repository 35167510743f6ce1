#include "norm/norm_reference.h"

#include <cmath>
#include <vector>

#include "dsa_decode/numerics.h"

namespace dsa::reference {

namespace {
constexpr int kValuesPerThread = 8;
constexpr int kWarpSize = 32;
constexpr int kValuesPerWarp = kValuesPerThread * kWarpSize;
}  // namespace

float norm_sum_of_squares(const uint16_t* x, int size) {
  // Only the warps that hold values are summed: the kernel's further warps (the
  // kv CTA runs the q CTA's thread count) add +0.0f, which leaves the
  // non-negative total unchanged.
  float total = 0.0f;
  for (int warp_start = 0; warp_start < size; warp_start += kValuesPerWarp) {
    float lanes[kWarpSize];
    for (int lane = 0; lane < kWarpSize; ++lane) {
      const int column = warp_start + lane * kValuesPerThread;
      float squares = 0.0f;  // an inactive lane (column >= size) contributes this zero
      for (int i = 0; column < size && i < kValuesPerThread; ++i) {
        const float value = num::bf16_to_float(x[column + i]);
        squares = std::fma(value, value, squares);
      }
      lanes[lane] = squares;
    }
    // The butterfly: at every step each lane adds its partner's value (xor offset).
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      float next[kWarpSize];
      for (int lane = 0; lane < kWarpSize; ++lane) next[lane] = lanes[lane] + lanes[lane ^ offset];
      for (int lane = 0; lane < kWarpSize; ++lane) lanes[lane] = next[lane];
    }
    total += lanes[0];
  }
  return total;
}

float norm_rrms(float total, int size, float eps) {
  return num::rsqrt_approx(num::div_full(total, static_cast<float>(size)) + eps);
}

void norm_apply_rrms(const uint16_t* x, const uint16_t* gamma, int size, float rrms, uint16_t* y) {
  for (int i = 0; i < size; ++i) {
    const float scaled = num::bf16_to_float(x[i]) * rrms;
    y[i] = num::float_to_bf16(scaled * num::bf16_to_float(gamma[i]));
  }
}

void qkv_rmsnorm(const uint16_t* qkv, int64_t qkv_row_pitch, const uint16_t* q_weight, const uint16_t* kv_weight,
                 int m, int q_size, int kv_size, float eps, uint16_t* q_out, uint16_t* kv_out) {
  for (int t = 0; t < m; ++t) {
    const uint16_t* q = qkv + t * qkv_row_pitch;
    const uint16_t* kv = q + q_size;
    norm_apply_rrms(q, q_weight, q_size, norm_rrms(norm_sum_of_squares(q, q_size), q_size, eps),
                    q_out + static_cast<int64_t>(t) * q_size);
    norm_apply_rrms(kv, kv_weight, kv_size, norm_rrms(norm_sum_of_squares(kv, kv_size), kv_size, eps),
                    kv_out + static_cast<int64_t>(t) * kv_size);
  }
}

void rms_norm_exact(const double* row, int size, const uint16_t* gamma, float eps, double* out) {
  std::vector<double> x(size);
  double squares = 0;
  for (int i = 0; i < size; ++i) {
    x[i] = num::round_bf16(static_cast<float>(row[i]));
    squares += x[i] * x[i];
  }
  const double rrms = 1 / std::sqrt(squares / size + eps);
  for (int i = 0; i < size; ++i) out[i] = x[i] * rrms * num::bf16_to_float(gamma[i]);
}

}  // namespace dsa::reference
