// The projections (indexer_project, cuBLASLt) against the float64 reference
// within the contract's tolerance (src/indexer/indexer_reference.h): glm5next
// shapes (Q = 1536, D = 4096) at m = 1, 4, 16, outputs between poisoned guard
// bands with their row padding checked untouched, padded row strides, the
// same bits on a second run and from a CUDA-graph replay.
// The one-launch GEMV (indexer_project_gemv) bit for bit against its CPU
// reference at every m of 1..16 (quick mode: 1, 5, 16) and within the same
// float64 tolerance, with the same guard bands and padded strides, Q = 1544
// and D = 4104 (a last step of 8 columns), inputs unchanged, a token's bits
// alone and in batches, a CUDA-graph replay and inputs written by the kernel
// before it while its weights stream (PDL).
// GPU tests: IndexerProjectGpu.*, IndexerProjectGemvGpu.*; without a GPU:
// IndexerProjectChecks.*, IndexerProjectReference.*, IndexerProjectGemvChecks.*,
// IndexerProjectGemvReference.*.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/launch.cuh"
#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"
#include "indexer/indexer_reference.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;
using testing::pad_rows;
using testing::expect_rejected;
constexpr int kDim = kIndexerDim;
constexpr int kHeads = kIndexerHeads;
constexpr int64_t kQWidth = int64_t(kHeads) * kDim;  // index_q's 32 heads of 128 per token
constexpr int64_t kQLora = 1536;                     // glm5next's Q
constexpr int64_t kHidden = 4096;                    // glm5next's D
constexpr uint8_t kPoison = 0xFF;                    // NaN in BF16 and FP32: an unwritten output fails the tolerance
constexpr uint16_t kBf16Padding = 0x7FC1;            // BF16 NaN in row padding: a read of it would spread NaN

// ---------------------------------------------------------------------------
// Argument checks (no GPU needed: the views' pointers are never dereferenced).

// Region r of a fake address space (regions 4 GiB apart, so no views overlap).
void* fake_device_pointer(uintptr_t region) { return reinterpret_cast<void*>(region << 16); }

// Valid views of a glm5next projection step of m tokens; each test breaks one thing.
IndexerProjectArgs fake_args(int64_t m) {
  IndexerProjectArgs a;
  a.q_c = make_tensor(fake_device_pointer(0x10000), DType::kBF16, {m, kQLora});
  a.x = make_tensor(fake_device_pointer(0x20000), DType::kBF16, {m, kHidden});
  a.wq_b = make_tensor(fake_device_pointer(0x30000), DType::kBF16, {kQWidth, kQLora});
  a.wk = make_tensor(fake_device_pointer(0x40000), DType::kBF16, {kDim, kHidden});
  a.weights_proj = make_tensor(fake_device_pointer(0x50000), DType::kBF16, {kHeads, kHidden});
  a.compress_gate = make_tensor(fake_device_pointer(0x60000), DType::kBF16, {kDim, kHidden});
  a.index_q = make_tensor(fake_device_pointer(0x70000), DType::kBF16, {m, kHeads, kDim});
  a.index_k = make_tensor(fake_device_pointer(0x80000), DType::kBF16, {m, kDim});
  a.head_weights = make_tensor(fake_device_pointer(0x90000), DType::kF32, {m, kHeads});
  a.gate = make_tensor(fake_device_pointer(0xA0000), DType::kBF16, {m, kDim});
  return a;
}

// The address `bytes` past a view's data.
void* bytes_after(const TensorView& t, int64_t bytes) { return static_cast<char*>(t.data) + bytes; }

void expect_accepted(const IndexerProjectArgs& a, const std::string& what) {
  const Status s = check_indexer_project(a);
  EXPECT_TRUE(s.ok()) << what << ": " << s.to_string();
}

TEST(IndexerProjectChecks, AcceptsGlm5NextShapes) {
  for (int64_t m : {1, 4, 16}) expect_accepted(fake_args(m), "m " + std::to_string(m));
  IndexerProjectArgs padded = fake_args(4);
  padded.q_c = make_strided(padded.q_c.data, DType::kBF16, {4, kQLora}, {kQLora + 8, 1});
  padded.wq_b = make_strided(padded.wq_b.data, DType::kBF16, {kQWidth, kQLora}, {kQLora + 16, 1});
  padded.index_q = make_strided(padded.index_q.data, DType::kBF16, {4, kHeads, kDim}, {kQWidth + 8, kDim, 1});
  padded.head_weights = make_strided(padded.head_weights.data, DType::kF32, {4, kHeads}, {kHeads + 4, 1});
  expect_accepted(padded, "padded row strides");
  IndexerProjectArgs one = fake_args(1);  // a size-1 dimension's stride is never used (tensor.h)
  for (TensorView* t : {&one.q_c, &one.x, &one.index_q, &one.index_k, &one.head_weights, &one.gate}) t->strides[0] = 3;
  expect_accepted(one, "m 1, token strides 3");
  const Status gemv = check_indexer_project_gemv(one);
  EXPECT_TRUE(gemv.ok()) << "indexer_project_gemv, m 1, token strides 3: " << gemv.to_string();
}

TEST(IndexerProjectChecks, ErrorsNameTheArgument) {
  const auto with = [](auto change) {
    IndexerProjectArgs a = fake_args(4);
    change(a);
    return check_indexer_project(a);
  };
  expect_rejected(with([](IndexerProjectArgs& a) { a.plan.max_tokens = 0; }), "plan.max_tokens", "1..16");
  expect_rejected(with([](IndexerProjectArgs& a) { a.q_c.dtype = DType::kF32; }), "q_c", "dtype bf16");
  expect_rejected(with([](IndexerProjectArgs& a) { a.plan.max_tokens = 2; }), "q_c", "1..2 tokens");
  expect_rejected(with([](IndexerProjectArgs& a) { a.q_c.strides[0] = kQLora + 4; }), "q_c",
                  "a token stride that is a multiple of 8 and at least 1536");
  expect_rejected(with([](IndexerProjectArgs& a) { a.x.dtype = DType::kF16; }), "x", "dtype bf16");
  expect_rejected(with([](IndexerProjectArgs& a) { a.x.shape[0] = 3; }), "x", "shape [4, *]");
  expect_rejected(with([](IndexerProjectArgs& a) { a.x.device.kind = DeviceKind::kCPU; }), "x", "a CUDA tensor");
  expect_rejected(with([](IndexerProjectArgs& a) { a.wq_b.shape[1] = 1024; }), "wq_b", "shape [4096, 1536]");
  expect_rejected(with([](IndexerProjectArgs& a) { a.wq_b.strides[0] = kQLora + 4; }), "wq_b",
                  "a row stride that is a multiple of 8 and at least 1536");
  expect_rejected(with([](IndexerProjectArgs& a) { a.wk.dtype = DType::kF16; }), "wk", "dtype bf16");
  expect_rejected(with([](IndexerProjectArgs& a) { a.wk.data = bytes_after(a.wk, 8); }), "wk", "aligned to 16");
  expect_rejected(with([](IndexerProjectArgs& a) { a.weights_proj.shape[0] = 64; }), "weights_proj",
                  "shape [32, 4096]");
  expect_rejected(with([](IndexerProjectArgs& a) { a.compress_gate.strides[1] = 2; }), "compress_gate",
                  "stride 1 in dim 1");
  expect_rejected(with([](IndexerProjectArgs& a) { a.compress_gate.device.kind = DeviceKind::kCPU; }),
                  "compress_gate", "a CUDA tensor");
  expect_rejected(with([](IndexerProjectArgs& a) { a.index_q.shape[1] = 64; }), "index_q", "shape [4, 32, 128]");
  expect_rejected(with([](IndexerProjectArgs& a) { a.index_q.strides[0] = kQWidth + 4; }), "index_q",
                  "a token stride that is a multiple of 8");
  expect_rejected(with([](IndexerProjectArgs& a) { a.index_k.data = bytes_after(a.index_k, 8); }), "index_k",
                  "aligned to 16");
  expect_rejected(with([](IndexerProjectArgs& a) { a.head_weights.dtype = DType::kBF16; }), "head_weights",
                  "dtype f32");
  expect_rejected(with([](IndexerProjectArgs& a) { a.head_weights.strides[0] = kHeads + 2; }), "head_weights",
                  "a token stride that is a multiple of 4");
  expect_rejected(with([](IndexerProjectArgs& a) { a.gate.shape[1] = 64; }), "gate", "shape [4, 128]");
  // Outputs share no memory with the inputs or with each other.
  expect_rejected(with([](IndexerProjectArgs& a) { a.index_q.data = a.x.data; }), "index_q",
                  "memory disjoint from 'x'");
  expect_rejected(with([](IndexerProjectArgs& a) { a.head_weights.data = bytes_after(a.wk, 4096); }), "head_weights",
                  "memory disjoint from 'wk'");
  expect_rejected(with([](IndexerProjectArgs& a) { a.gate.data = bytes_after(a.index_k, 512); }), "index_k",
                  "memory disjoint from 'gate'");
}

// indexer_project checks its arguments first, then that the context was
// created; neither touches the device.
TEST(IndexerProjectChecks, RunChecksArgumentsThenTheContext) {
  IndexerProjectContext empty;
  EXPECT_FALSE(empty.created());
  IndexerProjectArgs bad = fake_args(4);
  bad.gate.dtype = DType::kF32;
  expect_rejected(indexer_project(bad, empty, nullptr), "gate", "dtype bf16");
  expect_rejected(indexer_project(fake_args(4), empty, nullptr), "context", "IndexerProjectContext::create");
}

// DeepSeek-V3.2's indexer (pool 1) has no compress gate: compress_gate and
// gate may both be empty there (no gate computed), for both launchers; given
// one without the other, the missing one is named; a pooled plan needs both.
TEST(IndexerProjectChecks, PoolOneTakesNoCompressGate) {
  IndexerProjectArgs v32 = fake_args(4);
  v32.plan.heads = 64;
  v32.plan.pool = 1;
  v32.plan.ring = 1;
  v32.plan.rope_dims = 64;
  v32.plan.block_size = 64;
  v32.wq_b = make_tensor(v32.wq_b.data, DType::kBF16, {64 * kDim, kQLora});
  v32.weights_proj = make_tensor(v32.weights_proj.data, DType::kBF16, {64, kHidden});
  v32.index_q = make_tensor(v32.index_q.data, DType::kBF16, {4, 64, kDim});
  v32.head_weights = make_tensor(v32.head_weights.data, DType::kF32, {4, 64});
  expect_accepted(v32, "pool 1 with a gate");
  IndexerProjectArgs no_gate = v32;
  no_gate.compress_gate = TensorView();
  no_gate.gate = TensorView();
  expect_accepted(no_gate, "pool 1 without compress_gate and gate");
  const Status gemv = check_indexer_project_gemv(no_gate);
  EXPECT_TRUE(gemv.ok()) << "indexer_project_gemv, pool 1 without a gate: " << gemv.to_string();
  IndexerProjectArgs weight_only = v32;
  weight_only.gate = TensorView();
  expect_rejected(check_indexer_project(weight_only), "gate", "expected a tensor, got a null pointer");
  IndexerProjectArgs output_only = v32;
  output_only.compress_gate = TensorView();
  expect_rejected(check_indexer_project(output_only), "compress_gate", "expected a tensor, got a null pointer");
  IndexerProjectArgs pooled = fake_args(4);
  pooled.compress_gate = TensorView();
  pooled.gate = TensorView();
  expect_rejected(check_indexer_project(pooled), "compress_gate", "expected a tensor, got a null pointer");
  expect_rejected(check_indexer_project_gemv(pooled), "compress_gate", "expected a tensor, got a null pointer");
}

// ---------------------------------------------------------------------------
// The float64 reference and the tolerance.

std::vector<uint16_t> bf16_bits(const std::vector<float>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = num::float_to_bf16(values[i]);
  return bits;
}

TEST(IndexerProjectReference, ExactProductOfAHandExample) {
  const std::vector<uint16_t> input = bf16_bits({1, 2, -3, 0.5f, 0, 4});              // [2, 3]
  const std::vector<uint16_t> weight = bf16_bits({0.5f, 0.25f, 1, -1, 4, 0.125f});  // [2, 3]
  const reference::ExactProduct p = reference::exact_product(input.data(), 2, 3, weight.data(), 2);
  // Row 0: 0.5 + 0.5 - 3 and -1 + 8 - 0.375; row 1: 0.25 + 0 + 4 and -0.5 + 0 + 0.5.
  EXPECT_EQ(p.sum, std::vector<double>({-2.0, 6.625, 4.25, 0.0}));
  EXPECT_EQ(p.magnitude, std::vector<double>({4.0, 9.375, 4.25, 1.0}));
}

// Q = D = 2, m = 2, each weight zero but one row: every output is zero but
// the one column that row feeds, in each token's row.
TEST(IndexerProjectReference, EachProductLandsInItsOutputColumn) {
  const int64_t q_row = 5 * kDim + 7, k_row = 3, weight_row = 31, gate_row = 127;
  std::vector<float> wq_b(kQWidth * 2, 0.0f), wk(kDim * 2, 0.0f), weights_proj(kHeads * 2, 0.0f),
      compress_gate(kDim * 2, 0.0f);
  const auto set_row = [](std::vector<float>& weight, int64_t row, float first, float second) {
    weight[row * 2] = first;
    weight[row * 2 + 1] = second;
  };
  set_row(wq_b, q_row, 1, 2);
  set_row(wk, k_row, -1, 0.5f);
  set_row(weights_proj, weight_row, 2, 1);
  set_row(compress_gate, gate_row, 0.25f, -4);
  const std::vector<uint16_t> q_c = bf16_bits({1, 1, 2, 1}), x = bf16_bits({4, 2, -2, 8});
  const std::vector<uint16_t> wq_b_bits = bf16_bits(wq_b), wk_bits = bf16_bits(wk),
                              weights_proj_bits = bf16_bits(weights_proj),
                              compress_gate_bits = bf16_bits(compress_gate);
  const reference::IndexerProjectionsHost out = reference::indexer_project(
      {2, 2, 2, q_c.data(), x.data(), wq_b_bits.data(), wk_bits.data(), weights_proj_bits.data(),
       compress_gate_bits.data()});

  // Row t of `p` is zero but column `column`, which holds values[t].
  const auto expect_one_column = [](const reference::ExactProduct& p, int64_t width, int64_t column,
                                    const std::vector<double>& values, const char* what) {
    ASSERT_EQ(p.sum.size(), size_t(2 * width)) << what;
    for (int64_t t = 0; t < 2; ++t) {
      for (int64_t j = 0; j < width; ++j) {
        EXPECT_EQ(p.sum[t * width + j], j == column ? values[t] : 0.0) << what << " token " << t << " column " << j;
      }
    }
  };
  expect_one_column(out.index_q, kQWidth, q_row, {1 + 2, 2 + 2}, "index_q");
  expect_one_column(out.index_k, kDim, k_row, {-4 + 1, 2 + 4}, "index_k");
  expect_one_column(out.head_weights, kHeads, weight_row, {8 + 2, -4 + 8}, "head_weights");
  expect_one_column(out.gate, kDim, gate_row, {1 - 8, -0.5 - 32}, "gate");
  EXPECT_EQ(out.gate.magnitude[gate_row], 1 + 8);
  EXPECT_EQ(out.gate.magnitude[kDim + gate_row], 0.5 + 32);

  // Without compress_gate (pool 1): no gate, the other products unchanged,
  // in the float64 reference and in the GEMV's order alike.
  const reference::IndexerProjectInputsHost no_gate{2, 2, 2, q_c.data(), x.data(), wq_b_bits.data(), wk_bits.data(),
                                                    weights_proj_bits.data(), nullptr};
  const reference::IndexerProjectionsHost without = reference::indexer_project(no_gate);
  EXPECT_TRUE(without.gate.sum.empty());
  EXPECT_EQ(without.index_q.sum, out.index_q.sum);
  EXPECT_EQ(without.index_k.sum, out.index_k.sum);
  EXPECT_EQ(without.head_weights.sum, out.head_weights.sum);
  const reference::IndexerProjectionBitsHost bits = reference::indexer_project_gemv(no_gate);
  EXPECT_TRUE(bits.gate.empty());
  EXPECT_EQ(bits.index_k.size(), size_t(2 * kDim));
  EXPECT_EQ(bits.head_weights.size(), size_t(2 * kHeads));
}

TEST(IndexerProjectReference, ToleranceIsOneBf16UlpPlusTheSumTerm) {
  using reference::projection_expected;
  using reference::projection_tolerance;
  // FP32 outputs: the exact sum itself, within 1e-5 of the sum of |products|.
  EXPECT_EQ(projection_expected(1.0 + 1e-12, DType::kF32), 1.0 + 1e-12);
  EXPECT_EQ(projection_tolerance(1.0, 1.0, 1000.0, DType::kF32), 1000.0 * reference::kProjectionSumTolerance);
  // BF16 outputs: the exact sum rounded to nearest even (1 + 2^-8 is the tie
  // between 1 and 1 + 2^-7), then one ulp at the larger value's scale.
  EXPECT_EQ(projection_expected(1.0 + std::ldexp(1.0, -8), DType::kBF16), 1.0);
  EXPECT_EQ(projection_expected(-3.0 - std::ldexp(1.0, -7), DType::kBF16), -3.0);
  EXPECT_EQ(projection_tolerance(1.0 + std::ldexp(1.0, -7), 1.0, 0.0, DType::kBF16), std::ldexp(1.0, -7));
  EXPECT_EQ(projection_tolerance(2.0, 2.0 - std::ldexp(1.0, -7), 0.0, DType::kBF16), std::ldexp(1.0, -6));
  EXPECT_EQ(projection_tolerance(0.0, 0.0, 0.0, DType::kBF16), std::ldexp(1.0, -133));
  EXPECT_EQ(projection_tolerance(-1.0, -1.0, 1000.0, DType::kBF16),
            std::ldexp(1.0, -7) + 1000.0 * reference::kProjectionSumTolerance);
  // Two ulps apart is outside it when the sum term is small.
  const double two_ulps = 1.0 + std::ldexp(1.0, -6);
  EXPECT_GT(two_ulps - 1.0, projection_tolerance(two_ulps, 1.0, 1.0, DType::kBF16));
}

// ---------------------------------------------------------------------------
// GPU tests.

// Elements after each row beyond its width, per view; 0 everywhere is tight.
struct ProjectPadding {
  int64_t input = 0, weight = 0, index_q = 0, row = 0, head_weights = 0;  // row: index_k's and gate's
};
constexpr ProjectPadding kTight{};
constexpr ProjectPadding kPadded{8, 16, 8, 24, 4};

// A device output of `rows` rows of `width` elements at a row stride of
// `stride`, between two guard bands; poison() sets every byte to kPoison.
template <class T>
class PoisonedRows {
 public:
  static constexpr int64_t kGuard = 4096 / sizeof(T);  // 4 KiB: data() keeps the allocation's alignment

  PoisonedRows(int64_t rows, int64_t width, int64_t stride)
      : rows_(rows), width_(width), stride_(stride), buffer_(size_t(2 * kGuard + rows * stride)) {}
  T* data() const { return buffer_.get() + kGuard; }
  int64_t stride() const { return stride_; }
  void poison() { buffer_.fill_bytes(kPoison); }
  std::vector<uint8_t> bytes() const {
    const std::vector<T> all = buffer_.download();
    std::vector<uint8_t> raw(all.size() * sizeof(T));
    std::memcpy(raw.data(), all.data(), raw.size());
    return raw;
  }
  // The written elements [rows, width]; fails the test if any byte outside
  // them (guard bands, row padding) is not kPoison.
  std::vector<T> written(const std::string& what) const {
    const std::vector<uint8_t> raw = bytes();
    std::vector<T> values(size_t(rows_ * width_));
    size_t touched = 0, first_touched = 0;
    for (size_t e = 0; e < raw.size() / sizeof(T); ++e) {
      const int64_t offset = int64_t(e) - kGuard;
      const bool inside = offset >= 0 && offset < rows_ * stride_ && offset % stride_ < width_;
      if (inside) {
        std::memcpy(&values[offset / stride_ * width_ + offset % stride_], &raw[e * sizeof(T)], sizeof(T));
        continue;
      }
      const bool poisoned = std::all_of(&raw[e * sizeof(T)], &raw[(e + 1) * sizeof(T)],
                                        [](uint8_t b) { return b == kPoison; });
      if (!poisoned && touched++ == 0) first_touched = e;
    }
    EXPECT_EQ(touched, 0u) << what << ": elements outside the output changed, the first at " << first_touched
                           << " of the buffer (guard of " << kGuard << ", rows of stride " << stride_ << ")";
    return values;
  }

 private:
  int64_t rows_, width_, stride_;
  DeviceBuffer<T> buffer_;
};

// A glm5next layer's projection weights (or Q and D columns), BF16 bits
// [out, in], at the scale of nn.Linear's initialization (1 / sqrt(in)
// standard deviation).
struct HostWeights {
  int64_t q_lora, hidden;
  std::vector<uint16_t> wq_b, wk, weights_proj, compress_gate;
  explicit HostWeights(std::mt19937_64& rng, int64_t q = kQLora, int64_t d = kHidden)
      : q_lora(q),
        hidden(d),
        wq_b(testing::random_bf16(size_t(kQWidth * q), 1.0f / std::sqrt(float(q)), rng)),
        wk(testing::random_bf16(size_t(kDim * d), 1.0f / std::sqrt(float(d)), rng)),
        weights_proj(testing::random_bf16(size_t(kHeads * d), 1.0f / std::sqrt(float(d)), rng)),
        compress_gate(testing::random_bf16(size_t(kDim * d), 1.0f / std::sqrt(float(d)), rng)) {}
};

// The weights on the device, each row followed by `padding` NaN elements.
struct DeviceWeights {
  int64_t padding, q_lora, hidden;
  DeviceBuffer<uint16_t> wq_b, wk, weights_proj, compress_gate;
  DeviceWeights(const HostWeights& w, int64_t row_padding)
      : padding(row_padding),
        q_lora(w.q_lora),
        hidden(w.hidden),
        wq_b(pad_rows(w.wq_b, q_lora, q_lora + padding, kBf16Padding)),
        wk(pad_rows(w.wk, hidden, hidden + padding, kBf16Padding)),
        weights_proj(pad_rows(w.weights_proj, hidden, hidden + padding, kBf16Padding)),
        compress_gate(pad_rows(w.compress_gate, hidden, hidden + padding, kBf16Padding)) {}
  void set_views(IndexerProjectArgs* a) const {
    a->wq_b = make_strided(wq_b.get(), DType::kBF16, {kQWidth, q_lora}, {q_lora + padding, 1});
    a->wk = make_strided(wk.get(), DType::kBF16, {kDim, hidden}, {hidden + padding, 1});
    a->weights_proj = make_strided(weights_proj.get(), DType::kBF16, {kHeads, hidden}, {hidden + padding, 1});
    a->compress_gate = make_strided(compress_gate.get(), DType::kBF16, {kDim, hidden}, {hidden + padding, 1});
  }
};

// One step's inputs, BF16 bits: q_c [m, Q] of unit scale (it follows the q
// latent's RMSNorm) and hidden states x [m, D] of unit scale with 8 channels
// 20 times larger, like the outlier channels of real hidden states.
struct HostStep {
  int m;
  std::vector<uint16_t> q_c, x;
  int64_t q_lora = kQLora, hidden = kHidden;
};

HostStep random_step(int m, std::mt19937_64& rng, int64_t q_lora = kQLora, int64_t hidden = kHidden) {
  HostStep s{m, testing::random_bf16(size_t(m * q_lora), 1.0f, rng),
             testing::random_bf16(size_t(m * hidden), 1.0f, rng), q_lora, hidden};
  std::uniform_int_distribution<int64_t> channel(0, hidden - 1);
  for (int outlier = 0; outlier < 8; ++outlier) {
    const int64_t c = channel(rng);
    for (int t = 0; t < m; ++t) {
      uint16_t& v = s.x[t * hidden + c];
      v = num::float_to_bf16(num::bf16_to_float(v) * 20.0f);
    }
  }
  return s;
}

// A step's inputs on the device and its four outputs between guard bands.
struct DeviceStep {
  int m;
  int64_t q_lora, hidden;
  ProjectPadding padding;
  DeviceBuffer<uint16_t> q_c, x;
  PoisonedRows<uint16_t> index_q, index_k, gate;
  PoisonedRows<float> head_weights;

  DeviceStep(const HostStep& s, const ProjectPadding& p)
      : m(s.m),
        q_lora(s.q_lora),
        hidden(s.hidden),
        padding(p),
        q_c(pad_rows(s.q_c, q_lora, q_lora + p.input, kBf16Padding)),
        x(pad_rows(s.x, hidden, hidden + p.input, kBf16Padding)),
        index_q(m, kQWidth, kQWidth + p.index_q),
        index_k(m, kDim, kDim + p.row),
        gate(m, kDim, kDim + p.row),
        head_weights(m, kHeads, kHeads + p.head_weights) {}

  void set_views(IndexerProjectArgs* a) const {
    a->q_c = make_strided(q_c.get(), DType::kBF16, {m, q_lora}, {q_lora + padding.input, 1});
    a->x = make_strided(x.get(), DType::kBF16, {m, hidden}, {hidden + padding.input, 1});
    a->index_q = make_strided(index_q.data(), DType::kBF16, {m, kHeads, kDim}, {index_q.stride(), kDim, 1});
    a->index_k = make_strided(index_k.data(), DType::kBF16, {m, kDim}, {index_k.stride(), 1});
    a->head_weights = make_strided(head_weights.data(), DType::kF32, {m, kHeads}, {head_weights.stride(), 1});
    a->gate = make_strided(gate.data(), DType::kBF16, {m, kDim}, {gate.stride(), 1});
  }
  void poison() {
    index_q.poison();
    index_k.poison();
    head_weights.poison();
    gate.poison();
  }
  // Every byte of the four buffers, guard bands included.
  std::vector<uint8_t> all_bytes() const {
    std::vector<uint8_t> all = index_q.bytes();
    for (const std::vector<uint8_t>& more : {index_k.bytes(), head_weights.bytes(), gate.bytes()}) {
      all.insert(all.end(), more.begin(), more.end());
    }
    return all;
  }
};

reference::IndexerProjectionsHost reference_projections(const HostStep& s, const HostWeights& w) {
  return reference::indexer_project({s.m, s.q_lora, s.hidden, s.q_c.data(), s.x.data(), w.wq_b.data(), w.wk.data(),
                                     w.weights_proj.data(), w.compress_gate.data()});
}

double output_value(uint16_t bf16) { return num::bf16_to_float(bf16); }
double output_value(float value) { return value; }

// The largest |error| / tolerance over one output (NaN counts as infinite).
template <class T>
double worst_tolerance_fraction(const std::vector<T>& got, const reference::ExactProduct& exact, DType dtype,
                                const std::string& what) {
  EXPECT_EQ(got.size(), exact.sum.size()) << what;
  double worst = 0.0;
  size_t outside = 0, worst_at = 0;
  for (size_t i = 0; i < std::min(got.size(), exact.sum.size()); ++i) {
    const double value = output_value(got[i]);
    const double expected = reference::projection_expected(exact.sum[i], dtype);
    const double tolerance = reference::projection_tolerance(value, expected, exact.magnitude[i], dtype);
    const double error = std::fabs(value - expected);
    const double fraction = error <= tolerance ? error / tolerance : std::numeric_limits<double>::infinity();
    if (fraction > 1.0) ++outside;
    if (fraction > worst) {
      worst = fraction;
      worst_at = i;
    }
  }
  EXPECT_EQ(outside, 0u) << what << ": " << outside << " of " << got.size() << " outside the tolerance; worst at "
                         << worst_at << ": got " << output_value(got[worst_at]) << ", exact sum "
                         << exact.sum[worst_at] << ", sum of |products| " << exact.magnitude[worst_at];
  return worst;
}

// The four outputs within the tolerance of the reference, nothing written
// outside them; prints the worst |error| / tolerance of each.
void expect_matches_reference(const DeviceStep& device, const reference::IndexerProjectionsHost& expected,
                              const std::string& what, const char* label = "indexer_project") {
  const double q = worst_tolerance_fraction(device.index_q.written(what + " index_q"), expected.index_q,
                                            DType::kBF16, what + " index_q");
  const double k = worst_tolerance_fraction(device.index_k.written(what + " index_k"), expected.index_k,
                                            DType::kBF16, what + " index_k");
  const double w = worst_tolerance_fraction(device.head_weights.written(what + " head_weights"),
                                            expected.head_weights, DType::kF32, what + " head_weights");
  const double g =
      worst_tolerance_fraction(device.gate.written(what + " gate"), expected.gate, DType::kBF16, what + " gate");
  std::printf("[%s] %s: worst |error| / tolerance: index_q %.3g, index_k %.3g, head_weights %.3g, gate %.3g\n", label,
              what.c_str(), q, k, w, g);
}

// The step's and the weights' views in one argument set.
IndexerProjectArgs project_args(const DeviceStep& device, const DeviceWeights& weights) {
  IndexerProjectArgs args;
  device.set_views(&args);
  weights.set_views(&args);
  return args;
}

cudaStream_t new_stream() {
  cudaStream_t stream = nullptr;
  testing::expect_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return stream;
}

// indexer_project, then a wait for the stream; a CUDA error fails the test.
Status project_and_wait(const IndexerProjectArgs& args, IndexerProjectContext& context, cudaStream_t stream) {
  const Status launched = indexer_project(args, context, stream);
  testing::expect_cuda(cudaStreamSynchronize(stream), "indexer_project");
  testing::expect_cuda(cudaGetLastError(), "indexer_project");
  return launched;
}

// m tokens through one context: within the tolerance of the reference,
// nothing written outside the outputs, and a second run (outputs poisoned
// again) gives the same bytes.
void check_projection(int m, const ProjectPadding& padding, const HostWeights& weights,
                      const DeviceWeights& device_weights, IndexerProjectContext& context, std::mt19937_64& rng,
                      const std::string& what) {
  const HostStep step = random_step(m, rng);
  DeviceStep device(step, padding);
  const IndexerProjectArgs args = project_args(device, device_weights);
  cudaStream_t stream = new_stream();

  device.poison();
  DSA_ASSERT_OK(project_and_wait(args, context, stream));
  expect_matches_reference(device, reference_projections(step, weights), what);
  const std::vector<uint8_t> first = device.all_bytes();
  device.poison();
  DSA_ASSERT_OK(project_and_wait(args, context, stream));
  EXPECT_TRUE(device.all_bytes() == first) << what << ": the second run gave other bytes";
  cudaStreamDestroy(stream);
}

TEST(IndexerProjectGpu, MatchesReferenceAtGlm5NextShapes) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng);
  const DeviceWeights device_weights(weights, 0);
  IndexerProjectContext context;
  DSA_ASSERT_OK(IndexerProjectContext::create(&context));
  for (int m : {1, 4, 16}) {
    check_projection(m, kTight, weights, device_weights, context, rng, "m " + std::to_string(m));
    if (HasFailure()) return;
  }
}

// Every view with padded rows (NaN in the inputs' and weights' padding, poison
// in the outputs'): nothing reads or writes the padding.
TEST(IndexerProjectGpu, PaddedRowStrides) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng);
  const DeviceWeights device_weights(weights, kPadded.weight);
  IndexerProjectContext context;
  DSA_ASSERT_OK(IndexerProjectContext::create(&context));
  check_projection(4, kPadded, weights, device_weights, context, rng, "m 4 padded");
}

// One token's rows with a token stride of 3 (never used: cuBLASLt is given
// the contiguous one) give the bytes of the contiguous views.
TEST(IndexerProjectGpu, OneTokenTakesAnyTokenStride) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng);
  const DeviceWeights device_weights(weights, 0);
  DeviceStep device(random_step(1, rng), kTight);
  IndexerProjectArgs args = project_args(device, device_weights);
  IndexerProjectContext context;
  DSA_ASSERT_OK(IndexerProjectContext::create(&context));
  cudaStream_t stream = new_stream();
  device.poison();
  DSA_ASSERT_OK(project_and_wait(args, context, stream));
  const std::vector<uint8_t> contiguous = device.all_bytes();
  for (TensorView* t : {&args.q_c, &args.x, &args.index_q, &args.index_k, &args.head_weights, &args.gate}) {
    t->strides[0] = 3;
  }
  device.poison();
  DSA_ASSERT_OK(project_and_wait(args, context, stream));
  EXPECT_TRUE(device.all_bytes() == contiguous) << "token stride 3 gave other bytes";
  cudaStreamDestroy(stream);
}

// A warm-up call outside the capture (it builds the shape's descriptors),
// then indexer_project captured in a CUDA graph: each replay gives the direct
// run's bytes.
TEST(IndexerProjectGpu, GraphReplayGivesTheDirectRunsBits) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng);
  const DeviceWeights device_weights(weights, 0);
  const HostStep step = random_step(16, rng);
  DeviceStep device(step, kTight);
  const IndexerProjectArgs args = project_args(device, device_weights);
  IndexerProjectContext context;
  DSA_ASSERT_OK(IndexerProjectContext::create(&context));
  cudaStream_t stream = new_stream();

  device.poison();
  DSA_ASSERT_OK(project_and_wait(args, context, stream));
  const std::vector<uint8_t> direct = device.all_bytes();

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = indexer_project(args, context, stream);
  DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  DSA_ASSERT_OK(captured);
  DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    device.poison();
    DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
    EXPECT_TRUE(device.all_bytes() == direct) << "replay " << replay << " gave other bytes than the direct run";
  }
  expect_matches_reference(device, reference_projections(step, weights), "m 16 graph replay");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---------------------------------------------------------------------------
// indexer_project_gemv: argument checks and its CPU reference (no GPU needed).

// fake_args(m) with Q and D columns (every weight's width follows), row
// strides rounded up to a multiple of 8.
IndexerProjectArgs fake_args_with_columns(int64_t m, int64_t q_lora, int64_t hidden) {
  IndexerProjectArgs a = fake_args(m);
  const int64_t q_stride = (q_lora + 7) / 8 * 8, x_stride = (hidden + 7) / 8 * 8;
  a.q_c = make_strided(a.q_c.data, DType::kBF16, {m, q_lora}, {q_stride, 1});
  a.x = make_strided(a.x.data, DType::kBF16, {m, hidden}, {x_stride, 1});
  a.wq_b = make_strided(a.wq_b.data, DType::kBF16, {kQWidth, q_lora}, {q_stride, 1});
  a.wk = make_strided(a.wk.data, DType::kBF16, {kDim, hidden}, {x_stride, 1});
  a.weights_proj = make_strided(a.weights_proj.data, DType::kBF16, {kHeads, hidden}, {x_stride, 1});
  a.compress_gate = make_strided(a.compress_gate.data, DType::kBF16, {kDim, hidden}, {x_stride, 1});
  return a;
}

TEST(IndexerProjectGemvChecks, AcceptsGlm5NextShapesAtEveryTokenCount) {
  for (int64_t m = 1; m <= kIndexerMaxTokens; ++m) {
    const Status s = check_indexer_project_gemv(fake_args(m));
    EXPECT_TRUE(s.ok()) << "m " << m << ": " << s.to_string();
  }
  IndexerProjectArgs padded = fake_args(16);
  padded.q_c = make_strided(padded.q_c.data, DType::kBF16, {16, kQLora}, {kQLora + 8, 1});
  padded.wq_b = make_strided(padded.wq_b.data, DType::kBF16, {kQWidth, kQLora}, {kQLora + 16, 1});
  padded.index_q = make_strided(padded.index_q.data, DType::kBF16, {16, kHeads, kDim}, {kQWidth + 8, kDim, 1});
  padded.head_weights = make_strided(padded.head_weights.data, DType::kF32, {16, kHeads}, {kHeads + 4, 1});
  const Status s = check_indexer_project_gemv(padded);
  EXPECT_TRUE(s.ok()) << "padded row strides: " << s.to_string();
}

// m is 1..16: the plan bounds it (kIndexerMaxTokens), and the launcher checks
// before it touches the device.
TEST(IndexerProjectGemvChecks, RejectsMoreThan16Tokens) {
  IndexerProjectArgs a = fake_args(17);  // the default plan's max_tokens is 16
  expect_rejected(check_indexer_project_gemv(a), "q_c", "1..16 tokens");
  expect_rejected(indexer_project_gemv(a, nullptr), "q_c", "1..16 tokens");
  a.plan.max_tokens = 17;
  expect_rejected(check_indexer_project_gemv(a), "plan.max_tokens", "1..16");
  expect_rejected(indexer_project_gemv(a, nullptr), "plan.max_tokens", "1..16");
}

// Q and D: multiples of 8 (16-byte loads), and a CTA's staged input rows (m
// rounded up to a power of two) with one warp's weight rows within 227 KiB.
TEST(IndexerProjectGemvChecks, NamesItsColumnLimits) {
  expect_rejected(check_indexer_project_gemv(fake_args_with_columns(4, 1540, kHidden)), "q_c",
                  "a column count Q that is a multiple of 8");
  expect_rejected(check_indexer_project_gemv(fake_args_with_columns(4, kQLora, 4100)), "x",
                  "a column count D that is a multiple of 8");
  const Status one_token = check_indexer_project_gemv(fake_args_with_columns(1, kQLora, 8192));
  EXPECT_TRUE(one_token.ok()) << "D = 8192 at m = 1: " << one_token.to_string();
  expect_rejected(check_indexer_project_gemv(fake_args_with_columns(16, kQLora, 8192)), "x", "at most 6832 at m = 16");
  expect_rejected(check_indexer_project_gemv(fake_args_with_columns(16, 6144, kHidden)), "q_c",
                  "at most 5808 at m = 16");
  // At most 64 steps of 256 columns (one cp.async commit group each) where
  // the shared memory would allow more (m = 1, 2).
  const Status most_steps = check_indexer_project_gemv(fake_args_with_columns(1, 16384, 16384));
  EXPECT_TRUE(most_steps.ok()) << "Q = D = 16384 at m = 1: " << most_steps.to_string();
  expect_rejected(check_indexer_project_gemv(fake_args_with_columns(1, kQLora, 16392)), "x",
                  "at most 16384 (64 steps of 256 columns");
  expect_rejected(check_indexer_project_gemv(fake_args_with_columns(2, 16392, kHidden)), "q_c",
                  "at most 16384 (64 steps of 256 columns");
  // check_indexer_project's checks come first, in the launcher too.
  IndexerProjectArgs bad = fake_args(4);
  bad.gate.dtype = DType::kF32;
  expect_rejected(check_indexer_project_gemv(bad), "gate", "dtype bf16");
  expect_rejected(indexer_project_gemv(bad, nullptr), "gate", "dtype bf16");
}

// The order on a hand example where it shows: D = 272, so lane 0 owns
// columns 0..7 and 256..263 and lane 1 owns 8..15 and 264..271. x is all
// ones; the weight row holds 2^24 at column 0 and ones at 8..15 and 256..263.
// Lane 0: 2^24, then each + 1 is a tie that rounds back to 2^24 (even);
// lane 1: 8; the butterfly adds them exactly: 2^24 + 8. (The exact sum is
// 2^24 + 16; a serial chain over ascending columns would give 2^24.)
TEST(IndexerProjectGemvReference, SumsInTheDocumentedOrder) {
  constexpr int64_t kColumns = 272;
  std::vector<float> row(kColumns, 0.0f);
  row[0] = 16777216.0f;
  for (int i = 8; i < 16; ++i) row[i] = 1.0f;
  for (int i = 256; i < 264; ++i) row[i] = 1.0f;
  const std::vector<uint16_t> ones = bf16_bits(std::vector<float>(kColumns, 1.0f)), weight = bf16_bits(row);
  EXPECT_EQ(reference::gemv_sum(ones.data(), weight.data(), kColumns), 16777224.0f);

  // Through the four products: the row as weights_proj row 5 (FP32 out) and
  // compress_gate row 3 (BF16 out: 2^24 + 8 rounds to 2^24); Q = 8.
  std::vector<float> weights_proj(kHeads * kColumns, 0.0f), compress_gate(kDim * kColumns, 0.0f);
  std::copy(row.begin(), row.end(), weights_proj.begin() + 5 * kColumns);
  std::copy(row.begin(), row.end(), compress_gate.begin() + 3 * kColumns);
  const std::vector<uint16_t> q_c = bf16_bits(std::vector<float>(8, 1.0f));
  const std::vector<uint16_t> wq_b(kQWidth * 8, 0), wk(kDim * kColumns, 0);
  const std::vector<uint16_t> weights_proj_bits = bf16_bits(weights_proj),
                              compress_gate_bits = bf16_bits(compress_gate);
  const reference::IndexerProjectionBitsHost out =
      reference::indexer_project_gemv({1, 8, kColumns, q_c.data(), ones.data(), wq_b.data(), wk.data(),
                                       weights_proj_bits.data(), compress_gate_bits.data()});
  EXPECT_EQ(out.head_weights[5], 16777224.0f);
  EXPECT_EQ(out.gate[3], num::float_to_bf16(16777216.0f));
  EXPECT_EQ(out.head_weights[4], 0.0f);
  EXPECT_EQ(out.gate[2], 0);
  EXPECT_EQ(std::count(out.index_q.begin(), out.index_q.end(), 0), kQWidth);
}

reference::IndexerProjectionBitsHost reference_bits(const HostStep& s, const HostWeights& w) {
  return reference::indexer_project_gemv({s.m, s.q_lora, s.hidden, s.q_c.data(), s.x.data(), w.wq_b.data(), w.wk.data(),
                                          w.weights_proj.data(), w.compress_gate.data()});
}

// The fixed order is within the float64 tolerance that indexer_project meets.
TEST(IndexerProjectGemvReference, WithinTheFloat64Tolerance) {
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng);
  const HostStep step = random_step(3, rng);
  const reference::IndexerProjectionBitsHost bits = reference_bits(step, weights);
  const reference::IndexerProjectionsHost exact = reference_projections(step, weights);
  const double q = worst_tolerance_fraction(bits.index_q, exact.index_q, DType::kBF16, "index_q");
  const double k = worst_tolerance_fraction(bits.index_k, exact.index_k, DType::kBF16, "index_k");
  const double w = worst_tolerance_fraction(bits.head_weights, exact.head_weights, DType::kF32, "head_weights");
  const double g = worst_tolerance_fraction(bits.gate, exact.gate, DType::kBF16, "gate");
  std::printf(
      "[indexer_project_gemv reference] m 3: worst |error| / tolerance: index_q %.3g, index_k %.3g, "
      "head_weights %.3g, gate %.3g\n",
      q, k, w, g);
}

// ---------------------------------------------------------------------------
// indexer_project_gemv on the GPU.

// Rows [first, first + count) of a row-major [*, width] vector.
template <class T>
std::vector<T> rows_of(const std::vector<T>& all, int64_t width, int first, int count) {
  return std::vector<T>(all.begin() + first * width, all.begin() + (first + count) * width);
}

HostStep step_rows(const HostStep& s, int first, int count) {
  return {count, rows_of(s.q_c, s.q_lora, first, count), rows_of(s.x, s.hidden, first, count), s.q_lora, s.hidden};
}

reference::IndexerProjectionBitsHost output_rows(const reference::IndexerProjectionBitsHost& o, int first, int count) {
  return {rows_of(o.index_q, kQWidth, first, count), rows_of(o.index_k, kDim, first, count),
          rows_of(o.head_weights, kHeads, first, count), rows_of(o.gate, kDim, first, count)};
}

// The four written outputs of a run; fails the test if anything outside them changed.
reference::IndexerProjectionBitsHost device_outputs(const DeviceStep& device, const std::string& what) {
  return {device.index_q.written(what + " index_q"), device.index_k.written(what + " index_k"),
          device.head_weights.written(what + " head_weights"), device.gate.written(what + " gate")};
}

// Bitwise equality (FP32 compared as bits); reports the count and the first difference.
template <class T>
void expect_same_bits(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t differ = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << got.size() << " differ; the first at " << first << ": "
                        << output_value(got[first]) << " instead of " << output_value(want[first]);
}

void expect_same_outputs(const reference::IndexerProjectionBitsHost& got,
                         const reference::IndexerProjectionBitsHost& want, const std::string& what) {
  expect_same_bits(got.index_q, want.index_q, what + " index_q");
  expect_same_bits(got.index_k, want.index_k, what + " index_k");
  expect_same_bits(got.head_weights, want.head_weights, what + " head_weights");
  expect_same_bits(got.gate, want.gate, what + " gate");
}

// indexer_project_gemv, then a wait for the stream; a CUDA error fails the test.
Status gemv_and_wait(const IndexerProjectArgs& args, cudaStream_t stream) {
  const Status launched = indexer_project_gemv(args, stream);
  testing::expect_cuda(cudaStreamSynchronize(stream), "indexer_project_gemv");
  testing::expect_cuda(cudaGetLastError(), "indexer_project_gemv");
  return launched;
}

// q_c and x on the device still hold the step's bytes, row padding included.
void expect_inputs_unchanged(const DeviceStep& device, const HostStep& step, const std::string& what) {
  const int64_t padding = device.padding.input;
  EXPECT_TRUE(device.q_c.download() == pad_rows(step.q_c, step.q_lora, step.q_lora + padding, kBf16Padding))
      << what << ": q_c changed";
  EXPECT_TRUE(device.x.download() == pad_rows(step.x, step.hidden, step.hidden + padding, kBf16Padding))
      << what << ": x changed";
}

void expect_weights_unchanged(const DeviceWeights& device, const HostWeights& host) {
  const int64_t padding = device.padding, q = host.q_lora, d = host.hidden;
  EXPECT_TRUE(device.wq_b.download() == pad_rows(host.wq_b, q, q + padding, kBf16Padding));
  EXPECT_TRUE(device.wk.download() == pad_rows(host.wk, d, d + padding, kBf16Padding));
  EXPECT_TRUE(device.weights_proj.download() == pad_rows(host.weights_proj, d, d + padding, kBf16Padding));
  EXPECT_TRUE(device.compress_gate.download() == pad_rows(host.compress_gate, d, d + padding, kBf16Padding));
}

// m tokens: the reference's bits and within the float64 tolerance, nothing
// written outside the outputs, the inputs unchanged, and a second run (outputs
// poisoned again) gives the same bytes.
void check_gemv(int m, const ProjectPadding& padding, const HostWeights& weights, const DeviceWeights& device_weights,
                std::mt19937_64& rng, const std::string& what) {
  const HostStep step = random_step(m, rng, weights.q_lora, weights.hidden);
  DeviceStep device(step, padding);
  const IndexerProjectArgs args = project_args(device, device_weights);
  cudaStream_t stream = new_stream();

  device.poison();
  DSA_ASSERT_OK(gemv_and_wait(args, stream));
  expect_same_outputs(device_outputs(device, what), reference_bits(step, weights), what);
  expect_matches_reference(device, reference_projections(step, weights), what, "indexer_project_gemv");
  expect_inputs_unchanged(device, step, what);
  const std::vector<uint8_t> first = device.all_bytes();
  device.poison();
  DSA_ASSERT_OK(gemv_and_wait(args, stream));
  EXPECT_TRUE(device.all_bytes() == first) << what << ": the second run gave other bytes";
  cudaStreamDestroy(stream);
}

// check_gemv at each token count of `counts` (until the first failure), then
// the weights unchanged; `what` names the case.
void check_gemv_counts(const std::vector<int>& counts, const ProjectPadding& padding, const HostWeights& weights,
                       const DeviceWeights& device_weights, std::mt19937_64& rng, const std::string& what) {
  for (int m : counts) {
    check_gemv(m, padding, weights, device_weights, rng, "gemv m " + std::to_string(m) + what);
    if (::testing::Test::HasFailure()) return;
  }
  expect_weights_unchanged(device_weights, weights);
}

TEST(IndexerProjectGemvGpu, BitwiseEqualToTheReferenceAtEveryTokenCount) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng);
  const DeviceWeights device_weights(weights, 0);
  std::vector<int> counts = {1, 5, 16};
  if (!testing::quick_mode()) {
    counts.clear();
    for (int m = 1; m <= kIndexerMaxTokens; ++m) counts.push_back(m);
  }
  check_gemv_counts(counts, kTight, weights, device_weights, rng, "");
}

// The GEMV at 16 and 64 index heads (wq_b [H * 128, Q], weights_proj [H, D],
// outputs [m, H, 128] and [m, H]) equals reference::indexer_project_gemv of
// the same head count bit for bit, at m = 1, 3 and 16; nothing is written
// past the outputs.
TEST(IndexerProjectGemvGpu, EveryHeadCountIsBitwiseTheReference) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 3);
  constexpr int64_t q = 512, d = 1024;
  for (int heads : {16, 64}) {
    const std::vector<uint16_t> wq_b = testing::random_bf16(size_t(heads) * kDim * q, 1.0f / std::sqrt(float(q)), rng);
    const std::vector<uint16_t> wk = testing::random_bf16(size_t(kDim) * d, 1.0f / std::sqrt(float(d)), rng);
    const std::vector<uint16_t> weights_proj = testing::random_bf16(size_t(heads) * d, 1.0f / std::sqrt(float(d)), rng);
    const std::vector<uint16_t> gate_w = testing::random_bf16(size_t(kDim) * d, 1.0f / std::sqrt(float(d)), rng);
    DeviceBuffer<uint16_t> wq_b_d(wq_b), wk_d(wk), weights_proj_d(weights_proj), gate_w_d(gate_w);
    for (int m : {1, 3, 16}) {
      const std::string what = "H " + std::to_string(heads) + " m " + std::to_string(m);
      const std::vector<uint16_t> q_c = testing::random_bf16(size_t(m) * q, 1.0f, rng);
      const std::vector<uint16_t> x = testing::random_bf16(size_t(m) * d, 1.0f, rng);
      DeviceBuffer<uint16_t> q_c_d(q_c), x_d(x);
      // One guard row past each output.
      DeviceBuffer<uint16_t> index_q(size_t(m + 1) * heads * kDim), index_k(size_t(m + 1) * kDim),
          gate(size_t(m + 1) * kDim);
      DeviceBuffer<float> head_weights(size_t(m + 1) * heads);
      for (auto* b : {&index_q, &index_k, &gate}) b->fill_bytes(kPoison);
      head_weights.fill_bytes(kPoison);
      IndexerProjectArgs args;
      args.plan.heads = heads;
      args.q_c = make_tensor(q_c_d.get(), DType::kBF16, {m, q});
      args.x = make_tensor(x_d.get(), DType::kBF16, {m, d});
      args.wq_b = make_tensor(wq_b_d.get(), DType::kBF16, {int64_t(heads) * kDim, q});
      args.wk = make_tensor(wk_d.get(), DType::kBF16, {kDim, d});
      args.weights_proj = make_tensor(weights_proj_d.get(), DType::kBF16, {heads, d});
      args.compress_gate = make_tensor(gate_w_d.get(), DType::kBF16, {kDim, d});
      args.index_q = make_tensor(index_q.get(), DType::kBF16, {m, heads, kDim});
      args.index_k = make_tensor(index_k.get(), DType::kBF16, {m, kDim});
      args.head_weights = make_tensor(head_weights.get(), DType::kF32, {m, heads});
      args.gate = make_tensor(gate.get(), DType::kBF16, {m, kDim});
      cudaStream_t stream = new_stream();
      DSA_ASSERT_OK(gemv_and_wait(args, stream));
      cudaStreamDestroy(stream);
      reference::IndexerProjectInputsHost inputs{m, q, d, q_c.data(), x.data(), wq_b.data(), wk.data(),
                                                 weights_proj.data(), gate_w.data(), heads};
      const reference::IndexerProjectionBitsHost want = reference::indexer_project_gemv(inputs);
      // The first `count` values; the guard row after them must still be poison.
      const auto written = [](auto all, size_t count, const std::string& name) {
        const uint8_t* guard = reinterpret_cast<const uint8_t*>(all.data() + count);
        const size_t bytes = (all.size() - count) * sizeof(all[0]);
        EXPECT_EQ(std::count(guard, guard + bytes, kPoison), static_cast<std::ptrdiff_t>(bytes)) << name;
        all.resize(count);
        return all;
      };
      expect_same_bits(written(index_q.download(), want.index_q.size(), what + " index_q guard"), want.index_q,
                       what + " index_q");
      expect_same_bits(written(index_k.download(), want.index_k.size(), what + " index_k guard"), want.index_k,
                       what + " index_k");
      expect_same_bits(written(head_weights.download(), want.head_weights.size(), what + " head_weights guard"),
                       want.head_weights, what + " head_weights");
      expect_same_bits(written(gate.download(), want.gate.size(), what + " gate guard"), want.gate, what + " gate");
      if (HasFailure()) return;
    }
  }
}

// Every view with padded rows (NaN in the inputs' and weights' padding, poison
// in the outputs'): nothing reads or writes the padding.
TEST(IndexerProjectGemvGpu, PaddedRowStrides) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng);
  const DeviceWeights device_weights(weights, kPadded.weight);
  check_gemv_counts(testing::quick_mode() ? std::vector<int>{5} : std::vector<int>{1, 5, 16}, kPadded, weights,
                    device_weights, rng, " padded");
}

// Q = 1544 and D = 4104, multiples of 8 but not of 256: in the last step
// only lane 0 has columns (8 of them), the other lanes none.
TEST(IndexerProjectGemvGpu, ColumnsNotAMultipleOf256) {
  DSA_REQUIRE_GPU();
  constexpr int64_t kQ = 1544, kD = 4104;
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng, kQ, kD);
  const DeviceWeights device_weights(weights, 0);
  check_gemv_counts(testing::quick_mode() ? std::vector<int>{5} : std::vector<int>{5, 16}, kTight, weights,
                    device_weights, rng, " Q 1544 D 4104");
}

// Batch invariance: each token's outputs depend only on its own q_c and x
// rows, so a token gives the same bits alone (m = 1, one accumulator per row),
// in a batch of 6 (8 per row) and in a batch of 16 (16 per row).
TEST(IndexerProjectGemvGpu, ATokensBitsDoNotDependOnItsBatch) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng);
  const DeviceWeights device_weights(weights, 0);
  const HostStep batch = random_step(16, rng);
  cudaStream_t stream = new_stream();
  const auto run = [&](const HostStep& step, const std::string& what) {
    DeviceStep device(step, kTight);
    const IndexerProjectArgs args = project_args(device, device_weights);
    device.poison();
    const Status s = gemv_and_wait(args, stream);
    EXPECT_TRUE(s.ok()) << what << ": " << s.to_string();
    return device_outputs(device, what);
  };
  const reference::IndexerProjectionBitsHost whole = run(batch, "batch of 16");
  // The batch is the reference's bits, so equal runs cannot be two unwritten outputs.
  expect_same_outputs(whole, reference_bits(batch, weights), "batch of 16");
  const reference::IndexerProjectionBitsHost six = run(step_rows(batch, 5, 6), "tokens 5..10");
  expect_same_outputs(six, output_rows(whole, 5, 6), "tokens 5..10 as a batch of 6");
  for (int t : {0, 6, 15}) {
    const std::string what = "token " + std::to_string(t) + " alone";
    expect_same_outputs(run(step_rows(batch, t, 1), what), output_rows(whole, t, 1), what);
  }
  cudaStreamDestroy(stream);
}

// Captured in a CUDA graph after a direct call (which raises the kernel's
// shared-memory limit): each replay gives the direct run's bytes.
TEST(IndexerProjectGemvGpu, GraphReplayGivesTheDirectRunsBits) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng);
  const DeviceWeights device_weights(weights, 0);
  const HostStep step = random_step(7, rng);
  DeviceStep device(step, kTight);
  const IndexerProjectArgs args = project_args(device, device_weights);
  cudaStream_t stream = new_stream();

  device.poison();
  DSA_ASSERT_OK(gemv_and_wait(args, stream));
  const std::vector<uint8_t> direct = device.all_bytes();

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = indexer_project_gemv(args, stream);
  DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  DSA_ASSERT_OK(captured);
  DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    device.poison();
    DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
    EXPECT_TRUE(device.all_bytes() == direct) << "replay " << replay << " gave other bytes than the direct run";
  }
  expect_same_outputs(device_outputs(device, "m 7 graph replay"), reference_bits(step, weights), "m 7 graph replay");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// PDL: the GEMV launched right after a kernel that writes its inputs late
// (its weight stream may start while that kernel spins) gives the bits of the
// new inputs. Two rounds: the first launch of each kernel loads its module,
// which synchronizes, so only the second can overlap.
TEST(IndexerProjectGemvGpu, ReadsInputsThatThePreviousKernelWrites) {
  DSA_REQUIRE_GPU();
  constexpr long long kSpinCycles = 200000;  // about 100 us at the H200's clocks
  constexpr int m = 4;
  std::mt19937_64 rng(testing::test_seed());
  const HostWeights weights(rng);
  const DeviceWeights device_weights(weights, 0);
  const HostStep old_step = random_step(m, rng), new_step = random_step(m, rng);
  DeviceStep device(old_step, kTight);
  DeviceBuffer<uint16_t> q_c_source(new_step.q_c), x_source(new_step.x);
  const IndexerProjectArgs args = project_args(device, device_weights);
  const reference::IndexerProjectionBitsHost want = reference_bits(new_step, weights);
  cudaStream_t stream = nullptr;  // blocking: it orders after the uploads on the legacy stream
  DSA_ASSERT_CUDA(cudaStreamCreate(&stream));
  for (int round = 0; round < 2; ++round) {
    const std::string what = "round " + std::to_string(round);
    device.q_c.upload(old_step.q_c);
    device.x.upload(old_step.x);
    device.poison();
    // testing::launch_late_writer: releases the GEMV at once, spins, then
    // copies the new q_c and x over the old ones.
    DSA_ASSERT_CUDA(testing::launch_late_writer(q_c_source.get(), device.q_c.get(), int(m * kQLora / 8), x_source.get(),
                                                device.x.get(), int(m * kHidden / 8), kSpinCycles, 8, 256, stream));
    DSA_ASSERT_OK(gemv_and_wait(args, stream));
    expect_same_outputs(device_outputs(device, what), want, what);
  }
  cudaStreamDestroy(stream);
}

// Pool 1 (DeepSeek-V3.2) without compress_gate and gate: the GEMV and
// cuBLASLt's four-GEMM path compute index_q, index_k and head_weights (the
// GEMV bitwise the reference) and nothing else: a buffer placed where the gate
// would go keeps its poison.
TEST(IndexerProjectGemvGpu, PoolOneWithoutAGateWritesNoGate) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 5);
  constexpr int heads = 64;
  constexpr int64_t q = 1536, d = 1024;
  const std::vector<uint16_t> wq_b = testing::random_bf16(size_t(heads) * kDim * q, 1.0f / std::sqrt(float(q)), rng);
  const std::vector<uint16_t> wk = testing::random_bf16(size_t(kDim) * d, 1.0f / std::sqrt(float(d)), rng);
  const std::vector<uint16_t> weights_proj = testing::random_bf16(size_t(heads) * d, 1.0f / std::sqrt(float(d)), rng);
  DeviceBuffer<uint16_t> wq_b_d(wq_b), wk_d(wk), weights_proj_d(weights_proj);
  for (int m : {1, 5}) {
    const std::string what = "pool 1 m " + std::to_string(m);
    const std::vector<uint16_t> q_c = testing::random_bf16(size_t(m) * q, 1.0f, rng);
    const std::vector<uint16_t> x = testing::random_bf16(size_t(m) * d, 1.0f, rng);
    DeviceBuffer<uint16_t> q_c_d(q_c), x_d(x);
    // The outputs, then a gate-sized poisoned region no launch may touch.
    DeviceBuffer<uint16_t> index_q(size_t(m) * heads * kDim), index_k(size_t(m) * kDim), untouched(size_t(m) * kDim);
    DeviceBuffer<float> head_weights(size_t(m) * heads);
    for (auto* b : {&index_q, &index_k, &untouched}) b->fill_bytes(kPoison);
    head_weights.fill_bytes(kPoison);
    IndexerProjectArgs args;
    args.plan.heads = heads;
    args.plan.pool = 1;
    args.plan.ring = 1;
    args.plan.rope_dims = 64;
    args.plan.block_size = 64;
    args.q_c = make_tensor(q_c_d.get(), DType::kBF16, {m, q});
    args.x = make_tensor(x_d.get(), DType::kBF16, {m, d});
    args.wq_b = make_tensor(wq_b_d.get(), DType::kBF16, {int64_t(heads) * kDim, q});
    args.wk = make_tensor(wk_d.get(), DType::kBF16, {kDim, d});
    args.weights_proj = make_tensor(weights_proj_d.get(), DType::kBF16, {heads, d});
    args.index_q = make_tensor(index_q.get(), DType::kBF16, {m, heads, kDim});
    args.index_k = make_tensor(index_k.get(), DType::kBF16, {m, kDim});
    args.head_weights = make_tensor(head_weights.get(), DType::kF32, {m, heads});
    cudaStream_t stream = new_stream();
    DSA_ASSERT_OK(gemv_and_wait(args, stream));
    const reference::IndexerProjectionBitsHost want = reference::indexer_project_gemv(
        {m, q, d, q_c.data(), x.data(), wq_b.data(), wk.data(), weights_proj.data(), nullptr, heads});
    EXPECT_TRUE(want.gate.empty());
    expect_same_bits(index_q.download(), want.index_q, what + " index_q");
    expect_same_bits(index_k.download(), want.index_k, what + " index_k");
    expect_same_bits(head_weights.download(), want.head_weights, what + " head_weights");
    IndexerProjectContext context;
    DSA_ASSERT_OK(IndexerProjectContext::create(&context));
    DSA_ASSERT_OK(indexer_project(args, context, stream));
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaStreamDestroy(stream);
    const std::vector<uint16_t> poison = untouched.download();
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(poison.data());
    EXPECT_EQ(std::count(bytes, bytes + poison.size() * 2, kPoison), static_cast<std::ptrdiff_t>(poison.size() * 2))
        << what;
    if (HasFailure()) return;
  }
}

}  // namespace
}  // namespace dsa
