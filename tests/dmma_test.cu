// What the FP64 tensor cores (DMMA: mma.sync .f64) compute when the sum is
// not exact. The indexer's logits use DMMA only where every partial sum is
// exact in double, so the order cannot matter. A head_gemv on DMMA (BF16
// weights and activations, docs/head_gemv.md) would round, and its CPU
// reference could reproduce the bits only if it knew the order and rounding
// inside one MMA. This test measures them: each output of m8n8k4 and
// m16n8k16 against CPU models of one k-sum (candidates below), on inputs
// whose sums round often in double. It passes when at least one model
// matches every output, and prints which ones do.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;

// D [M x 8] = A [M x K] B [K x 8] + C with one warp; A row-major [M][K], B
// [K][8], C and D [M][8].
__global__ void dmma_m8n8k4_kernel(const double* a, const double* b, const double* c, double* d) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  const double a0 = a[g * 4 + t], b0 = b[t * 8 + g];
  double d0 = c[g * 8 + 2 * t], d1 = c[g * 8 + 2 * t + 1];
  asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, "
      "{%0, %1};"
      : "+d"(d0), "+d"(d1)
      : "d"(a0), "d"(b0));
  d[g * 8 + 2 * t] = d0;
  d[g * 8 + 2 * t + 1] = d1;
}

// Lane (g, t) holds A[g][t + 4j] (a[2j]) and A[g + 8][t + 4j] (a[2j + 1]),
// B[t + 4j][g] (b[j]), D[g][2t], D[g][2t + 1], D[g + 8][2t], D[g + 8][2t + 1]
// (the layout the indexer's logits kernel uses).
__global__ void dmma_m16n8k16_kernel(const double* a, const double* b, const double* c, double* d) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  double af[8], bf[4], df[4];
  for (int j = 0; j < 4; ++j) {
    af[2 * j] = a[g * 16 + t + 4 * j];
    af[2 * j + 1] = a[(g + 8) * 16 + t + 4 * j];
    bf[j] = b[(t + 4 * j) * 8 + g];
  }
  for (int e = 0; e < 4; ++e) df[e] = c[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2];
  asm("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7, %8, %9, %10, %11}, "
      "{%12, %13, %14, %15}, {%0, %1, %2, %3};"
      : "+d"(df[0]), "+d"(df[1]), "+d"(df[2]), "+d"(df[3])
      : "d"(af[0]), "d"(af[1]), "d"(af[2]), "d"(af[3]), "d"(af[4]), "d"(af[5]), "d"(af[6]), "d"(af[7]), "d"(bf[0]),
        "d"(bf[1]), "d"(bf[2]), "d"(bf[3]));
  for (int e = 0; e < 4; ++e) d[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2] = df[e];
}

// Every input is m 2^e with |m| <= 15 and |e| <= kMaxExponent, so every
// product and c are multiples of 2^-kFixedShift below 2^(8 + 2 kMaxExponent)
// and an int128 holds any sum of them exactly.
constexpr int kMaxExponent = 20;
constexpr int kFixedShift = 2 * kMaxExponent;

__int128 to_fixed(double x) {  // exact for the inputs above
  return static_cast<__int128>(std::ldexp(x, kFixedShift));
}

// The exact value of a fixed-point sum, rounded once to double (the
// int128 -> double conversion rounds to nearest even; the scaling is exact).
double round_fixed(__int128 sum) { return std::ldexp(static_cast<double>(sum), -kFixedShift); }

// Candidate models of one output: c plus the products a[k] b[k], k = 0..K-1.
struct Model {
  const char* name;
  double (*sum)(const std::vector<double>& a, const std::vector<double>& b, double c);
};

double fma_chain_ascending(const std::vector<double>& a, const std::vector<double>& b, double c) {
  double acc = c;
  for (size_t k = 0; k < a.size(); ++k) acc = std::fma(a[k], b[k], acc);
  return acc;
}

double fma_chain_descending(const std::vector<double>& a, const std::vector<double>& b, double c) {
  double acc = c;
  for (size_t k = a.size(); k-- > 0;) acc = std::fma(a[k], b[k], acc);
  return acc;
}

double exact_then_rounded(const std::vector<double>& a, const std::vector<double>& b, double c) {
  __int128 sum = to_fixed(c);
  for (size_t k = 0; k < a.size(); ++k) sum += to_fixed(a[k] * b[k]);  // each product is exact
  return round_fixed(sum);
}

// Blocks of four products, each block's exact sum added to the accumulator
// with one rounding (an m8n8k4 step per block).
double exact_blocks_of_four(const std::vector<double>& a, const std::vector<double>& b, double c) {
  double acc = c;
  for (size_t k0 = 0; k0 < a.size(); k0 += 4) {
    __int128 sum = to_fixed(acc);
    for (size_t k = k0; k < k0 + 4 && k < a.size(); ++k) sum += to_fixed(a[k] * b[k]);
    acc = round_fixed(sum);
  }
  return acc;
}

double products_then_c(const std::vector<double>& a, const std::vector<double>& b, double c) {
  double acc = a[0] * b[0];
  for (size_t k = 1; k < a.size(); ++k) acc = std::fma(a[k], b[k], acc);
  return acc + c;
}

double pairwise_then_c(const std::vector<double>& a, const std::vector<double>& b, double c) {
  std::vector<double> level(a.size());
  for (size_t k = 0; k < a.size(); ++k) level[k] = a[k] * b[k];
  while (level.size() > 1) {
    std::vector<double> next(level.size() / 2);
    for (size_t i = 0; i < next.size(); ++i) next[i] = level[2 * i] + level[2 * i + 1];
    level = next;
  }
  return level[0] + c;
}

const Model kModels[] = {
    {"fma chain, k ascending, from c", fma_chain_ascending},
    {"fma chain, k descending, from c", fma_chain_descending},
    {"exact sum rounded once", exact_then_rounded},
    {"exact blocks of 4 k, each rounded", exact_blocks_of_four},
    {"products chained, then + c", products_then_c},
    {"pairwise tree, then + c", pairwise_then_c},
};
constexpr int kModelCount = sizeof(kModels) / sizeof(kModels[0]);

// +-m 2^e with m in 1..15 and e in [low, high].
double random_input(std::mt19937_64& rng, int low, int high) {
  std::uniform_int_distribution<int> mantissa(1, 15), exponent(low, high), sign(0, 1);
  return std::ldexp(sign(rng) ? -mantissa(rng) : mantissa(rng), exponent(rng));
}

// Inputs on which the models disagree: in every output two products cancel
// exactly (k0 and k1: A[i][k1] = -A[i][k0], B[k0][j] = B[k1][j], both about
// 2^36), the other products are below 2^-25 (lost when added to a cancelling
// one, kept otherwise), and c is 0, small or large.
void cancelling_inputs(int m, int k_count, std::mt19937_64& rng, std::vector<double>* a, std::vector<double>* b,
                       std::vector<double>* c) {
  constexpr int kBig = kMaxExponent - 3, kSmall = -kMaxExponent + 3;
  std::uniform_int_distribution<int> pick(0, k_count - 1), kind(0, 2);
  const int k0 = pick(rng);
  int k1 = pick(rng);
  while (k1 == k0) k1 = pick(rng);
  for (int i = 0; i < m; ++i) {
    for (int k = 0; k < k_count; ++k) (*a)[i * k_count + k] = random_input(rng, -kMaxExponent, kSmall);
    (*a)[i * k_count + k0] = random_input(rng, kBig, kMaxExponent);
    (*a)[i * k_count + k1] = -(*a)[i * k_count + k0];
  }
  for (int j = 0; j < 8; ++j) {
    for (int k = 0; k < k_count; ++k) (*b)[k * 8 + j] = random_input(rng, -kMaxExponent, kSmall);
    (*b)[k0 * 8 + j] = (*b)[k1 * 8 + j] = random_input(rng, kBig, kMaxExponent);
  }
  for (double& x : *c) {
    const int which = kind(rng);
    x = which == 0   ? 0.0
        : which == 1 ? random_input(rng, -kMaxExponent, kSmall)
                     : random_input(rng, kBig, kMaxExponent);
  }
}

struct ProbeResult {
  int outputs = 0;
  int rounded_outputs = 0;  // outputs whose models do not all agree
  std::vector<int> mismatches = std::vector<int>(kModelCount, 0);
};

// Runs `trials` random problems of M x 8 outputs with k = K through the kernel
// and compares every output with every model.
template <int M, int K>
ProbeResult probe(void (*kernel)(const double*, const double*, const double*, double*), int trials,
                  std::mt19937_64& rng) {
  ProbeResult result;
  DeviceBuffer<double> a_device(M * K), b_device(K * 8), c_device(M * 8), d_device(M * 8);
  for (int trial = 0; trial < trials; ++trial) {
    std::vector<double> a(M * K), b(K * 8), c(M * 8);
    cancelling_inputs(M, K, rng, &a, &b, &c);
    a_device.upload(a);
    b_device.upload(b);
    c_device.upload(c);
    kernel<<<1, 32>>>(a_device.get(), b_device.get(), c_device.get(), d_device.get());
    testing::expect_cuda(cudaDeviceSynchronize(), "dmma kernel");
    const std::vector<double> d = d_device.download();
    for (int i = 0; i < M; ++i) {
      for (int j = 0; j < 8; ++j) {
        std::vector<double> row(K), column(K);
        for (int k = 0; k < K; ++k) {
          row[k] = a[i * K + k];
          column[k] = b[k * 8 + j];
        }
        ++result.outputs;
        bool models_differ = false;
        const double first = kModels[0].sum(row, column, c[i * 8 + j]);
        for (int m = 0; m < kModelCount; ++m) {
          const double expected = kModels[m].sum(row, column, c[i * 8 + j]);
          models_differ |= expected != first;
          if (expected != d[i * 8 + j]) ++result.mismatches[m];
        }
        if (models_differ) ++result.rounded_outputs;
      }
    }
  }
  return result;
}

void report_and_check(const char* shape, const ProbeResult& r) {
  std::printf("DMMA %s: %d outputs, %d where the models differ\n", shape, r.outputs, r.rounded_outputs);
  int matching = 0;
  for (int m = 0; m < kModelCount; ++m) {
    std::printf("  %-36s %6d mismatches%s\n", kModels[m].name, r.mismatches[m],
                r.mismatches[m] == 0 ? "  <- matches" : "");
    matching += r.mismatches[m] == 0;
  }
  EXPECT_GT(r.rounded_outputs, r.outputs / 8) << "the inputs must make the models disagree often";
  EXPECT_GE(matching, 1) << shape << ": no model reproduces the tensor cores";
}

// The models disagree on a hand case, so matching one of them says something:
// c = 0 and products 2^53, 1, -2^53, 1.
TEST(Dmma, ModelsDisagreeWhereTheSumRounds) {
  const std::vector<double> a = {std::ldexp(1.0, 27), 1.0, -std::ldexp(1.0, 27), 1.0};
  const std::vector<double> b = {std::ldexp(1.0, 26), 1.0, std::ldexp(1.0, 26), 1.0};
  EXPECT_EQ(fma_chain_ascending(a, b, 0.0), 1.0);   // 2^53 + 1 rounds to 2^53
  EXPECT_EQ(fma_chain_descending(a, b, 0.0), 2.0);  // 1 - 2^53 is exact
  EXPECT_EQ(pairwise_then_c(a, b, 0.0), 1.0);
  const std::vector<double> small_a = {1.0, 3.0, -2.0, 5.0}, small_b = {0.5, 0.25, 4.0, -1.0};
  EXPECT_EQ(round_fixed(to_fixed(0.75)), 0.75);
  EXPECT_EQ(exact_then_rounded(small_a, small_b, 1.0), 1.0 + 0.5 + 0.75 - 8.0 - 5.0);
}

TEST(DmmaGpu, SomeModelReproducesEachShape) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const int trials = testing::quick_mode() ? 4 : 64;
  report_and_check("m8n8k4", probe<8, 4>(dmma_m8n8k4_kernel, trials, rng));
  report_and_check("m16n8k16", probe<16, 16>(dmma_m16n8k16_kernel, trials, rng));
}

}  // namespace
}  // namespace dsa
