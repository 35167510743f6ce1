// The projections (indexer_project, cuBLASLt) against the float64 reference
// within the contract's tolerance (src/indexer/indexer_reference.h): glm5next
// shapes (Q = 1536, D = 4096) at m = 1, 4, 16, outputs between poisoned guard
// bands with their row padding checked untouched, padded row strides, the
// same bits on a second run and from a CUDA-graph replay.
// GPU tests: IndexerProjectGpu.*; without a GPU: IndexerProjectChecks.*,
// IndexerProjectReference.*.
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
  IndexerProjectArgs one = fake_args(1);  // a size-1 dimension's stride is never used, as indexer_prepare takes it
  one.index_q = make_strided(one.index_q.data, DType::kBF16, {1, kHeads, kDim}, {1, kDim, 1});
  expect_accepted(one, "m 1, index_q token stride 1");
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

// A glm5next layer's projection weights, BF16 bits [out, in], at the scale of
// nn.Linear's initialization (1 / sqrt(in) standard deviation).
struct HostWeights {
  std::vector<uint16_t> wq_b, wk, weights_proj, compress_gate;
  explicit HostWeights(std::mt19937_64& rng)
      : wq_b(testing::random_bf16(size_t(kQWidth * kQLora), 1.0f / std::sqrt(float(kQLora)), rng)),
        wk(testing::random_bf16(size_t(kDim * kHidden), 1.0f / std::sqrt(float(kHidden)), rng)),
        weights_proj(testing::random_bf16(size_t(kHeads * kHidden), 1.0f / std::sqrt(float(kHidden)), rng)),
        compress_gate(testing::random_bf16(size_t(kDim * kHidden), 1.0f / std::sqrt(float(kHidden)), rng)) {}
};

// The weights on the device, each row followed by `padding` NaN elements.
struct DeviceWeights {
  int64_t padding;
  DeviceBuffer<uint16_t> wq_b, wk, weights_proj, compress_gate;
  DeviceWeights(const HostWeights& w, int64_t row_padding)
      : padding(row_padding),
        wq_b(pad_rows(w.wq_b, kQLora, kQLora + padding, kBf16Padding)),
        wk(pad_rows(w.wk, kHidden, kHidden + padding, kBf16Padding)),
        weights_proj(pad_rows(w.weights_proj, kHidden, kHidden + padding, kBf16Padding)),
        compress_gate(pad_rows(w.compress_gate, kHidden, kHidden + padding, kBf16Padding)) {}
  void set_views(IndexerProjectArgs* a) const {
    a->wq_b = make_strided(wq_b.get(), DType::kBF16, {kQWidth, kQLora}, {kQLora + padding, 1});
    a->wk = make_strided(wk.get(), DType::kBF16, {kDim, kHidden}, {kHidden + padding, 1});
    a->weights_proj = make_strided(weights_proj.get(), DType::kBF16, {kHeads, kHidden}, {kHidden + padding, 1});
    a->compress_gate = make_strided(compress_gate.get(), DType::kBF16, {kDim, kHidden}, {kHidden + padding, 1});
  }
};

// One step's inputs, BF16 bits: q_c [m, Q] of unit scale (it follows the q
// latent's RMSNorm) and hidden states x [m, D] of unit scale with 8 channels
// 20 times larger, like the outlier channels of real hidden states.
struct HostStep {
  int m;
  std::vector<uint16_t> q_c, x;
};

HostStep random_step(int m, std::mt19937_64& rng) {
  HostStep s{m, testing::random_bf16(size_t(m * kQLora), 1.0f, rng),
             testing::random_bf16(size_t(m * kHidden), 1.0f, rng)};
  std::uniform_int_distribution<int64_t> channel(0, kHidden - 1);
  for (int outlier = 0; outlier < 8; ++outlier) {
    const int64_t c = channel(rng);
    for (int t = 0; t < m; ++t) {
      uint16_t& v = s.x[t * kHidden + c];
      v = num::float_to_bf16(num::bf16_to_float(v) * 20.0f);
    }
  }
  return s;
}

// A step's inputs on the device and its four outputs between guard bands.
struct DeviceStep {
  int m;
  ProjectPadding padding;
  DeviceBuffer<uint16_t> q_c, x;
  PoisonedRows<uint16_t> index_q, index_k, gate;
  PoisonedRows<float> head_weights;

  DeviceStep(const HostStep& s, const ProjectPadding& p)
      : m(s.m),
        padding(p),
        q_c(pad_rows(s.q_c, kQLora, kQLora + p.input, kBf16Padding)),
        x(pad_rows(s.x, kHidden, kHidden + p.input, kBf16Padding)),
        index_q(m, kQWidth, kQWidth + p.index_q),
        index_k(m, kDim, kDim + p.row),
        gate(m, kDim, kDim + p.row),
        head_weights(m, kHeads, kHeads + p.head_weights) {}

  void set_views(IndexerProjectArgs* a) const {
    a->q_c = make_strided(q_c.get(), DType::kBF16, {m, kQLora}, {kQLora + padding.input, 1});
    a->x = make_strided(x.get(), DType::kBF16, {m, kHidden}, {kHidden + padding.input, 1});
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
  return reference::indexer_project({s.m, kQLora, kHidden, s.q_c.data(), s.x.data(), w.wq_b.data(), w.wk.data(),
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
                              const std::string& what) {
  const double q = worst_tolerance_fraction(device.index_q.written(what + " index_q"), expected.index_q,
                                            DType::kBF16, what + " index_q");
  const double k = worst_tolerance_fraction(device.index_k.written(what + " index_k"), expected.index_k,
                                            DType::kBF16, what + " index_k");
  const double w = worst_tolerance_fraction(device.head_weights.written(what + " head_weights"),
                                            expected.head_weights, DType::kF32, what + " head_weights");
  const double g =
      worst_tolerance_fraction(device.gate.written(what + " gate"), expected.gate, DType::kBF16, what + " gate");
  std::printf("[indexer_project] %s: worst |error| / tolerance: index_q %.3g, index_k %.3g, head_weights %.3g, "
              "gate %.3g\n",
              what.c_str(), q, k, w, g);
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
  IndexerProjectArgs args;
  device.set_views(&args);
  device_weights.set_views(&args);
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
  IndexerProjectArgs args;
  device.set_views(&args);
  device_weights.set_views(&args);
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

}  // namespace
}  // namespace dsa
