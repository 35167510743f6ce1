// linear_gemv against reference::linear_gemv bit for bit: the stage's
// projection shapes at glm5next (q_b_proj K = 1536, qkv_a_proj K = 4096,
// o_proj K = 2048 at TP8 and 16384 at TP1, whole: more rows than warps, so a
// warp goes from a row's last group to its next row's first) and odd ones
// (K = 4104: two groups, the last partial, more rows than warps; K = 520 /
// N = 77: one partial group, idle warps), every m from 1 to 8, inputs and
// outputs between poisoned guard bands with padded row strides, a token's
// bits alone and in a batch, a CUDA-graph replay, and inputs written by the
// kernel before it while its weights stream (PDL).
// GPU tests: LinearGemvGpu.*; without a GPU: LinearGemvChecks.*, LinearGemvReference.*.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/linear.h"
#include "dsa_decode/numerics.h"
#include "linear/linear_reference.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;
using testing::expect_rejected;

constexpr uint16_t kPoison = 0x7FC1;  // a BF16 NaN no sum produces

TensorView fake(int64_t rows, int64_t columns, uintptr_t address = 0x100000) {
  return make_tensor(reinterpret_cast<void*>(address), DType::kBF16, {rows, columns});
}

TEST(LinearGemvChecks, NamesTheArgumentAtFault) {
  LinearGemvArgs a{fake(2, 1536), fake(4096, 1536, 0x10000000), fake(2, 4096, 0x20000000)};
  EXPECT_TRUE(check_linear_gemv(a).ok()) << check_linear_gemv(a).to_string();
  LinearGemvArgs b = a;
  b.x = fake(9, 1536);
  expect_rejected(check_linear_gemv(b), "x", "m in 1..8");
  b = a;
  b.x = fake(2, 1532);
  b.weight = fake(4096, 1532, 0x10000000);
  expect_rejected(check_linear_gemv(b), "x", "multiple of 8");
  b = a;
  b.x = fake(8, 16384);
  b.weight = fake(4096, 16384, 0x10000000);
  b.out = fake(8, 4096, 0x20000000);
  expect_rejected(check_linear_gemv(b), "x", "K <= 14528 at m = 8");
  b = a;
  b.weight = fake(4096, 1544, 0x10000000);
  expect_rejected(check_linear_gemv(b), "weight", "[4096, 1536]");
  b = a;
  b.out = fake(2, 4095, 0x20000000);
  expect_rejected(check_linear_gemv(b), "out", "[2, 4096]");
  b = a;
  b.out = make_tensor(reinterpret_cast<void*>(0x100000 + 64), DType::kBF16, {2, 4096});
  expect_rejected(check_linear_gemv(b), "out", "disjoint");
  b = a;
  b.out = make_strided(reinterpret_cast<void*>(0x20000000), DType::kBF16, {2, 4096}, {4099, 1});
  EXPECT_TRUE(check_linear_gemv(b).ok()) << "out is written one value at a time: any row stride";
  b = a;
  b.weight = make_strided(reinterpret_cast<void*>(0x10000000), DType::kBF16, {4096, 1536}, {1540, 1});
  expect_rejected(check_linear_gemv(b), "weight", "multiple of 8");
  b = a;
  b.x = make_tensor(reinterpret_cast<void*>(0x100008), DType::kBF16, {2, 1536});
  expect_rejected(check_linear_gemv(b), "x", "16");
  b = a;
  b.out = make_tensor(reinterpret_cast<void*>(0x20000000), DType::kF32, {2, 4096});
  expect_rejected(check_linear_gemv(b), "out", "bf16");
  b = a;
  b.out = make_tensor(reinterpret_cast<void*>(0x10000000 + 64), DType::kBF16, {2, 4096});
  expect_rejected(check_linear_gemv(b), "out", "disjoint");  // over the weight
  b = a;
  b.x = make_strided(reinterpret_cast<void*>(0x100000), DType::kBF16, {2, 1536}, {1540, 1});
  expect_rejected(check_linear_gemv(b), "x", "multiple of 8");
  b = a;
  b.x = make_tensor(reinterpret_cast<void*>(0x100000), DType::kBF16, {1536});
  expect_rejected(check_linear_gemv(b), "x", "2-D");
  b = a;
  b.weight = make_tensor(reinterpret_cast<void*>(0x10000000), DType::kBF16, {kLinearGemvMaxRows + 1, 1536});
  b.out = make_tensor(reinterpret_cast<void*>(0x20000000), DType::kBF16, {2, kLinearGemvMaxRows + 1});
  expect_rejected(check_linear_gemv(b), "weight", "2^30");
  b = a;
  b.out = make_strided(reinterpret_cast<void*>(0x20000000), DType::kBF16, {2, 4096}, {4095, 1});
  expect_rejected(check_linear_gemv(b), "out", "a row stride of at least the row");  // rows would overlap
  b = a;
  b.out = make_strided(reinterpret_cast<void*>(0x20000000), DType::kBF16, {2, 4096}, {8192, 2});
  expect_rejected(check_linear_gemv(b), "out", "stride 1 in dim 1");
  b = a;
  b.out.device = Device{DeviceKind::kCPU, 0};
  expect_rejected(check_linear_gemv(b), "out", "a CUDA tensor");
  b = a;
  b.weight.device = Device{DeviceKind::kCPU, 0};
  expect_rejected(check_linear_gemv(b), "weight", "a CUDA tensor");
  EXPECT_TRUE(linear_gemv_supports(4, 16384));
  EXPECT_FALSE(linear_gemv_supports(5, 16384));
  EXPECT_FALSE(linear_gemv_supports(0, 1536));
}

// The layout: out[t, j] sums x row t against weight row j (small integers,
// so every order gives the exact sum; the order itself is gemv_sum's, tested
// in src/indexer/indexer_project_test.cu).
TEST(LinearGemvReference, SumsRowTAgainstWeightRowJ) {
  constexpr int64_t m = 2, k = 16, n = 3;
  std::vector<uint16_t> x(m * k), weight(n * k);
  for (int64_t i = 0; i < m * k; ++i) x[i] = num::float_to_bf16(float(i / k + 1));   // row t: all t + 1
  for (int64_t i = 0; i < n * k; ++i) weight[i] = num::float_to_bf16(float(i % k));  // every row: 0..15
  const std::vector<uint16_t> out = reference::linear_gemv(x, m, k, weight, n);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(num::bf16_to_float(out[t * n + j]), float((t + 1) * 120));
  }
}

// A problem on the GPU: x [m, k] with row stride k + pad, out [m, n] with row
// stride n + pad, each between guard bands of poison.
struct Problem {
  int64_t m, k, n, pad;
  std::vector<uint16_t> x, weight;
  DeviceBuffer<uint16_t> d_x, d_weight, d_out;

  Problem(int64_t tokens, int64_t columns, int64_t rows, int64_t padding, std::mt19937_64& rng)
      : m(tokens), k(columns), n(rows), pad(padding) {
    x = testing::random_bf16(size_t(m * k), 1.0f, rng);
    weight = testing::random_bf16(size_t(n * k), 0.02f, rng);
    d_x = DeviceBuffer<uint16_t>(testing::pad_rows(x, k, k + pad, kPoison));
    d_weight = DeviceBuffer<uint16_t>(testing::pad_rows(weight, k, k + pad, kPoison));
    d_out = DeviceBuffer<uint16_t>(size_t(m * (n + pad) + 2 * kGuard));
  }
  static constexpr int64_t kGuard = 64;

  LinearGemvArgs args() const {
    return LinearGemvArgs{make_strided(d_x.get(), DType::kBF16, {m, k}, {k + pad, 1}),
                          make_strided(d_weight.get(), DType::kBF16, {n, k}, {k + pad, 1}),
                          make_strided(d_out.get() + kGuard, DType::kBF16, {m, n}, {n + pad, 1})};
  }

  // The outputs, with the guard bands and each row's padding checked untouched.
  std::vector<uint16_t> outputs(const std::string& what) const {
    const std::vector<uint16_t> all = d_out.download();
    std::vector<uint16_t> out(size_t(m * n));
    for (size_t i = 0; i < all.size(); ++i) {
      const int64_t inside = int64_t(i) - kGuard;
      const bool written = inside >= 0 && inside < m * (n + pad) && inside % (n + pad) < n;
      if (written) {
        out[size_t(inside / (n + pad) * n + inside % (n + pad))] = all[i];
      } else if (all[i] != kPoison) {
        ADD_FAILURE() << what << ": wrote outside the output at " << i;
        break;
      }
    }
    return out;
  }
};

size_t first_difference(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i] != b[i]) return i;
  }
  return a.size() == b.size() ? a.size() : std::min(a.size(), b.size());
}

void expect_bits(const Problem& p, const std::string& what) {
  const std::vector<uint16_t> want = reference::linear_gemv(p.x, p.m, p.k, p.weight, p.n);
  const std::vector<uint16_t> got = p.outputs(what);
  const size_t at = first_difference(got, want);
  EXPECT_EQ(at, want.size()) << what << ": first difference at output " << at << " (token " << at / p.n << ", row "
                             << at % p.n << "): got 0x" << std::hex << got[at] << ", want 0x" << want[at];
}

TEST(LinearGemvGpu, EqualsTheReferenceBitForBit) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  struct Shape {
    int64_t k, n;
    std::vector<int> tokens;
  };
  const bool quick = testing::quick_mode();
  const std::vector<Shape> shapes = {
      {1536, 4096, quick ? std::vector<int>{1, 8} : std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8}},  // q_b_proj rows
      {4096, 2048, {1, 4, 8}},                                                                  // qkv_a_proj
      {2048, 4096, {1, 8}},                                                                     // o_proj, TP8
      {16384, quick ? 1024 : 4096, {1}},  // o_proj, TP1: 8 groups a row, more rows than warps (quick: fewer)
      {4104, 7000, {1, 3}},               // two groups, the last partial, more rows than warps
      {520, 77, {5}},                     // one partial group, idle warps
  };
  for (const Shape& s : shapes) {
    for (int m : s.tokens) {
      for (int64_t pad : {int64_t{0}, int64_t{8}}) {
        Problem p(m, s.k, s.n, pad, rng);
        const std::vector<uint16_t> poison(p.d_out.size(), kPoison);
        p.d_out.upload(poison);
        DSA_ASSERT_OK(linear_gemv(p.args(), nullptr));
        DSA_ASSERT_CUDA(cudaDeviceSynchronize());
        expect_bits(p, "m = " + std::to_string(m) + ", K = " + std::to_string(s.k) + ", N = " + std::to_string(s.n) +
                           ", pad " + std::to_string(pad));
        if (HasFailure()) return;
      }
    }
  }
}

// A token's bits do not depend on the batch around it, and a captured launch
// replays them.
TEST(LinearGemvGpu, BatchInvariantAndGraphReplayable) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  Problem batch(7, 4096, 2048, 0, rng);
  const std::vector<uint16_t> poison(batch.d_out.size(), kPoison);
  batch.d_out.upload(poison);
  DSA_ASSERT_OK(linear_gemv(batch.args(), nullptr));
  DSA_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<uint16_t> together = batch.outputs("batch");
  LinearGemvArgs alone = batch.args();
  DeviceBuffer<uint16_t> one(2048);
  alone.x = make_tensor(batch.d_x.get() + 3 * 4096, DType::kBF16, {1, 4096});
  alone.out = make_tensor(one.get(), DType::kBF16, {1, 2048});
  DSA_ASSERT_OK(linear_gemv(alone, nullptr));
  DSA_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<uint16_t> single = one.download();
  EXPECT_TRUE(std::equal(single.begin(), single.end(), together.begin() + 3 * 2048));

  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = linear_gemv(batch.args(), stream);
  DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  DSA_ASSERT_OK(captured);
  DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  batch.d_out.upload(poison);
  DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_TRUE(batch.outputs("replay") == together);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// PDL: launched right after a kernel that writes x late (the weight loads may
// start while it spins), the GEMV sums the new x. Two rounds: the first
// launch of each kernel loads its module, which synchronizes.
TEST(LinearGemvGpu, ReadsInputsThatThePreviousKernelWrites) {
  DSA_REQUIRE_GPU();
  constexpr long long kSpinCycles = 200000;  // about 100 us at the H200's clocks
  std::mt19937_64 rng(testing::test_seed());
  Problem p(4, 4096, 2048, 0, rng);
  const std::vector<uint16_t> old_x = p.x;
  p.x = testing::random_bf16(p.x.size(), 1.0f, rng);
  DeviceBuffer<uint16_t> new_x(p.x);
  cudaStream_t stream = nullptr;  // blocking: it orders after the uploads on the legacy stream
  DSA_ASSERT_CUDA(cudaStreamCreate(&stream));
  for (int round = 0; round < 2; ++round) {
    p.d_x.upload(old_x);
    std::vector<uint16_t> poison(p.d_out.size(), kPoison);
    p.d_out.upload(poison);
    DSA_ASSERT_CUDA(testing::launch_late_writer(new_x.get(), p.d_x.get(), int(p.m * p.k / 8), nullptr, nullptr, 0,
                                                kSpinCycles, 8, 256, stream));
    DSA_ASSERT_OK(linear_gemv(p.args(), stream));
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
    expect_bits(p, "round " + std::to_string(round));
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace dsa
