// Tests of src/core/wgmma.cuh on the GPU: the 128B-swizzle K-major layout and
// descriptor, the accumulator layout, and the A-in-registers fragment layout,
// each against a CPU product. Integer-valued inputs (every partial sum exact
// in FP32) must match bit for bit, which pins the layouts; random inputs
// report the tensor cores' accumulation error (FP8 products summed with an
// unspecified accumulator width: the number the next sparse_mla's numerics
// rest on).
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/async_copy.cuh"
#include "core/wgmma.cuh"
#include "dsa_decode/numerics.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;

constexpr int kM = 64;            // rows of A and of the result
constexpr int kRowBytes = 128;    // K bytes per operand row: one swizzle row
constexpr int kAtomBytes = 1024;  // tiles start on 1024-byte boundaries

// The 1024-byte aligned start inside the dynamic shared memory.
__device__ uint8_t* aligned_tile_base(uint8_t* raw) {
  const uint32_t address = shared_address(raw);
  return raw + ((kAtomBytes - address % kAtomBytes) % kAtomBytes);
}

// Copies `rows` rows of 128 bytes into the K-major 128B-swizzle layout.
__device__ void store_k_major_sw128(uint8_t* tile, const uint8_t* rows_in_order, int rows) {
  for (int u = threadIdx.x; u < rows * 8; u += blockDim.x) {
    const int row = u / 8, chunk = u % 8;
    *reinterpret_cast<uint4*>(tile + wgmma::k_major_sw128_offset(row, chunk)) =
        *reinterpret_cast<const uint4*>(rows_in_order + row * kRowBytes + chunk * 16);
  }
}

// out[64][N] = a[64][128] . b[N][128]^T over e4m3 codes: four k32 steps.
template <int kN>
__global__ void __launch_bounds__(128) e4m3_product_kernel(const uint8_t* a, const uint8_t* b, float* out) {
  extern __shared__ uint8_t raw[];
  uint8_t* a_tile = aligned_tile_base(raw);
  uint8_t* b_tile = a_tile + kM * kRowBytes;
  store_k_major_sw128(a_tile, a, kM);
  store_k_major_sw128(b_tile, b, kN);
  wgmma::fence_shared_for_async_proxy();
  __syncthreads();
  float d[kN / 2] = {};
  wgmma::fence();
#pragma unroll
  for (int step = 0; step < kRowBytes / 32; ++step) {
    const uint64_t a_descriptor = wgmma::k_major_sw128_descriptor(shared_address(a_tile) + 32 * step);
    const uint64_t b_descriptor = wgmma::k_major_sw128_descriptor(shared_address(b_tile) + 32 * step);
    if constexpr (kN == 8) {
      wgmma::mma_m64n8k32_e4m3(d, a_descriptor, b_descriptor, step > 0);
    } else {
      wgmma::mma_m64n64k32_e4m3(d, a_descriptor, b_descriptor, step > 0);
    }
  }
  wgmma::commit_group();
  wgmma::wait_group<0>();
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) {
    out[wgmma::accumulator_row(threadIdx.x, i) * kN + wgmma::accumulator_column(threadIdx.x, i)] = d[i];
  }
}

// out[64][8] = a[64][64] . b[8][64]^T over FP16 bits, A from registers: four k16 steps.
__global__ void __launch_bounds__(128) f16_product_kernel(const uint16_t* a, const uint16_t* b, float* out) {
  extern __shared__ uint8_t raw[];
  uint8_t* b_tile = aligned_tile_base(raw);
  store_k_major_sw128(b_tile, reinterpret_cast<const uint8_t*>(b), 8);
  wgmma::fence_shared_for_async_proxy();
  __syncthreads();
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
  const auto pair = [&](int row, int column) {  // columns `column`, `column` + 1 of row `row`
    return uint32_t(a[row * 64 + column]) | (uint32_t(a[row * 64 + column + 1]) << 16);
  };
  float d[4] = {};
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    const int row = 16 * warp + g, column = 16 * step + 2 * c;
    const uint32_t fragment[4] = {pair(row, column), pair(row + 8, column), pair(row, column + 8),
                                  pair(row + 8, column + 8)};
    wgmma::fence();  // the fragment registers were just written
    wgmma::mma_m64n8k16_f16_a_in_registers(d, fragment,
                                           wgmma::k_major_sw128_descriptor(shared_address(b_tile) + 32 * step),
                                           step > 0);
  }
  wgmma::commit_group();
  wgmma::wait_group<0>();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[wgmma::accumulator_row(threadIdx.x, i) * 8 + wgmma::accumulator_column(threadIdx.x, i)] = d[i];
  }
}

// e4m3 codes of the values -4..4 (exact sums) or of any finite value.
std::vector<uint8_t> e4m3_codes(size_t count, bool small_integers, std::mt19937_64& rng) {
  std::vector<uint8_t> codes(count);
  std::uniform_int_distribution<int> integer(-4, 4), code(0, 0x7E);
  for (uint8_t& v : codes) {
    v = small_integers ? num::float_to_e4m3(static_cast<float>(integer(rng)))
                       : static_cast<uint8_t>(code(rng) | (rng() & 0x80));
  }
  return codes;
}

uint16_t half_bits(float x) { return __half_raw(__float2half_rn(x)).x; }
float half_value(uint16_t bits) {
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));
}

// Largest |gpu - exact| / sum |products| over the result, and whether every
// element matched the exact sum bit for bit.
struct Comparison {
  double worst_relative = 0.0;
  int mismatches = 0;
};

Comparison compare(const std::vector<float>& got, const std::vector<double>& exact,
                   const std::vector<double>& magnitude) {
  Comparison c;
  for (size_t i = 0; i < got.size(); ++i) {
    if (static_cast<double>(got[i]) != exact[i]) ++c.mismatches;
    if (magnitude[i] > 0) c.worst_relative = std::max(c.worst_relative, std::fabs(got[i] - exact[i]) / magnitude[i]);
  }
  return c;
}

template <int kN>
Comparison run_e4m3(bool small_integers, std::mt19937_64& rng) {
  const std::vector<uint8_t> a = e4m3_codes(kM * kRowBytes, small_integers, rng);
  const std::vector<uint8_t> b = e4m3_codes(kN * kRowBytes, small_integers, rng);
  DeviceBuffer<uint8_t> a_device(a.size()), b_device(b.size());
  DeviceBuffer<float> out(kM * kN);
  a_device.upload(a);
  b_device.upload(b);
  const size_t shared = (kM + kN) * kRowBytes + kAtomBytes;
  e4m3_product_kernel<kN><<<1, 128, shared>>>(a_device.get(), b_device.get(), out.get());
  testing::expect_cuda(cudaDeviceSynchronize(), "e4m3_product_kernel");
  std::vector<double> exact(kM * kN, 0.0), magnitude(kM * kN, 0.0);
  for (int i = 0; i < kM; ++i) {
    for (int j = 0; j < kN; ++j) {
      for (int k = 0; k < kRowBytes; ++k) {
        const double p = double(num::e4m3_to_float(a[i * kRowBytes + k])) * num::e4m3_to_float(b[j * kRowBytes + k]);
        exact[i * kN + j] += p;
        magnitude[i * kN + j] += std::fabs(p);
      }
    }
  }
  return compare(out.download(), exact, magnitude);
}

Comparison run_f16(bool small_integers, std::mt19937_64& rng) {
  constexpr int kK = 64, kN = 8;
  std::uniform_int_distribution<int> integer(-8, 8);
  std::uniform_real_distribution<float> real(-1.0f, 1.0f);
  auto values = [&](size_t count) {
    std::vector<uint16_t> v(count);
    for (uint16_t& x : v) x = half_bits(small_integers ? static_cast<float>(integer(rng)) : real(rng));
    return v;
  };
  const std::vector<uint16_t> a = values(kM * kK), b = values(kN * kK);
  DeviceBuffer<uint16_t> a_device(a.size()), b_device(b.size());
  DeviceBuffer<float> out(kM * kN);
  a_device.upload(a);
  b_device.upload(b);
  f16_product_kernel<<<1, 128, kN * kRowBytes + kAtomBytes>>>(a_device.get(), b_device.get(), out.get());
  testing::expect_cuda(cudaDeviceSynchronize(), "f16_product_kernel");
  std::vector<double> exact(kM * kN, 0.0), magnitude(kM * kN, 0.0);
  for (int i = 0; i < kM; ++i) {
    for (int j = 0; j < kN; ++j) {
      for (int k = 0; k < kK; ++k) {
        const double p = double(half_value(a[i * kK + k])) * half_value(b[j * kK + k]);
        exact[i * kN + j] += p;
        magnitude[i * kN + j] += std::fabs(p);
      }
    }
  }
  return compare(out.download(), exact, magnitude);
}

// The layout functions on the host: the swizzle is a permutation of each
// 1024-byte atom's 16-byte slots, and the accumulator map covers every element
// of an m64nN result exactly once.
TEST(Wgmma, SwizzledOffsetsPermuteEachAtomsSlots) {
  for (int atom = 0; atom < 3; ++atom) {
    std::vector<int> seen(64, 0);
    for (int row = 8 * atom; row < 8 * atom + 8; ++row) {
      for (int chunk = 0; chunk < 8; ++chunk) {
        const uint32_t offset = wgmma::k_major_sw128_offset(row, chunk);
        ASSERT_EQ(offset % 16, 0u);
        ASSERT_EQ(offset / kAtomBytes, static_cast<uint32_t>(atom)) << "row " << row << " left its atom";
        ASSERT_EQ(offset / kRowBytes, static_cast<uint32_t>(row)) << "chunk " << chunk << " left row " << row;
        ++seen[offset % kAtomBytes / 16];
      }
    }
    for (int slot = 0; slot < 64; ++slot) EXPECT_EQ(seen[slot], 1) << "atom " << atom << " slot " << slot;
  }
}

TEST(Wgmma, AccumulatorMapCoversTheResultOnce) {
  for (const int n : {8, 64}) {
    std::vector<int> seen(kM * n, 0);
    for (int thread = 0; thread < 128; ++thread) {
      for (int i = 0; i < n / 2; ++i) {
        const int row = wgmma::accumulator_row(thread, i), column = wgmma::accumulator_column(thread, i);
        ASSERT_TRUE(row >= 0 && row < kM && column >= 0 && column < n) << "thread " << thread << " element " << i;
        ++seen[row * n + column];
      }
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), kM * n) << "N = " << n;
  }
}

// The descriptors' fields as PTX 9.7.15.5.1.2.2 lays them out: start address,
// leading and stride byte offsets (each >> 4, 14 bits), base offset 0, swizzle
// mode 1 (128B); the start address keeps only bits 4..17 of the address.
TEST(Wgmma, DescriptorsHoldTheirFieldsWhereThePtxIsaPutsThem) {
  auto field = [](uint64_t descriptor, int low, int bits) { return (descriptor >> low) & ((uint64_t(1) << bits) - 1); };
  for (const uint32_t address : {0u, 1024u, 0x8020u, 0x3FFF0u}) {
    const uint64_t k_major = wgmma::k_major_sw128_descriptor(address);
    EXPECT_EQ(field(k_major, 0, 14), address >> 4) << address;
    EXPECT_EQ(field(k_major, 16, 14), 1u);          // leading byte offset: unused by swizzled K-major layouts
    EXPECT_EQ(field(k_major, 32, 14), 1024u >> 4);  // stride byte offset: the next 8-row atom
    EXPECT_EQ(field(k_major, 49, 3), 0u);
    EXPECT_EQ(field(k_major, 62, 2), 1u);
    EXPECT_EQ(k_major & ~((uint64_t(1) << 14) - 1 | (uint64_t(0x3FFF) << 16) | (uint64_t(0x3FFF) << 32) |
                          (uint64_t(7) << 49) | (uint64_t(3) << 62)),
              0u) << "bits outside the fields";
    const uint64_t n_major = wgmma::n_major_sw128_descriptor(address, 8192);
    EXPECT_EQ(field(n_major, 0, 14), address >> 4);
    EXPECT_EQ(field(n_major, 16, 14), 8192u >> 4);  // leading byte offset: the next 64 values along N
    EXPECT_EQ(field(n_major, 32, 14), 1024u >> 4);  // stride byte offset: the next 8 k
    EXPECT_EQ(field(n_major, 62, 2), 1u);
  }
  EXPECT_EQ(wgmma::k_major_sw128_descriptor(0x40000u), wgmma::k_major_sw128_descriptor(0u))
      << "shared-memory addresses are 18 bits";
}

TEST(WgmmaGpu, E4m3OperandsInSharedMemoryGiveExactIntegerSums) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  EXPECT_EQ(run_e4m3<8>(true, rng).mismatches, 0) << "m64n8k32";
  EXPECT_EQ(run_e4m3<64>(true, rng).mismatches, 0) << "m64n64k32";
}

TEST(WgmmaGpu, E4m3AccumulationErrorIsSmall) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 1);
  const Comparison n8 = run_e4m3<8>(false, rng), n64 = run_e4m3<64>(false, rng);
  // Reported for docs/sparse_mla.md, "Why FP16 products" (an FP32 accumulator would give about 2^-24).
  std::printf("wgmma e4m3 k = 128: worst |error| / sum |products| = %.3g (N = 8), %.3g (N = 64)\n",
              n8.worst_relative, n64.worst_relative);
  EXPECT_LT(n8.worst_relative, 1e-3);
  EXPECT_LT(n64.worst_relative, 1e-3);
}

TEST(WgmmaGpu, F16AInRegistersGivesExactIntegerSums) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 2);
  EXPECT_EQ(run_f16(true, rng).mismatches, 0);
  const Comparison random = run_f16(false, rng);
  std::printf("wgmma f16 (A in registers) k = 64: worst |error| / sum |products| = %.3g\n", random.worst_relative);
  EXPECT_LT(random.worst_relative, 1e-5);
}

}  // namespace
}  // namespace dsa
