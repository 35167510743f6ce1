// The fused q/kv RMSNorm: argument checks and the CPU reference (CPU tests),
// the kernel against the reference, determinism and batch invariance (NormGpu).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/norm.h"
#include "dsa_decode/numerics.h"
#include "norm/norm_reference.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;

constexpr uint16_t kPoison = 0xFFFF;  // 0xFF bytes: a NaN no finite input can produce
constexpr int64_t kGuard = 64;        // guard elements on each side of an output (keeps 16-byte alignment)

// ---------------------------------------------------------------------------
// Argument checks (no GPU needed: the views' pointers are never dereferenced).

void* fake_device_pointer(uintptr_t address) { return reinterpret_cast<void*>(address); }

// Valid views of m = 4 tokens at glm5next's sizes; each test breaks one thing.
struct NormArgs {
  int64_t m = 4, q_size = 1536, kv_size = 512;
  TensorView qkv = make_tensor(fake_device_pointer(0x10000), DType::kBF16, {m, q_size + kv_size});
  TensorView q_weight = make_tensor(fake_device_pointer(0x20000), DType::kBF16, {q_size});
  TensorView kv_weight = make_tensor(fake_device_pointer(0x30000), DType::kBF16, {kv_size});
  TensorView q_out = make_tensor(fake_device_pointer(0x40000), DType::kBF16, {m, q_size});
  TensorView kv_out = make_tensor(fake_device_pointer(0x50000), DType::kBF16, {m, kv_size});
  float eps = 1e-6f;

  Status make(QkvNormParams* params) const {
    return make_qkv_norm_params(qkv, q_weight, kv_weight, eps, q_out, kv_out, params);
  }
  Status make() const {
    QkvNormParams params;
    return make(&params);
  }
  TensorView* tensor(const std::string& name) {
    if (name == "qkv") return &qkv;
    if (name == "q_weight") return &q_weight;
    if (name == "kv_weight") return &kv_weight;
    if (name == "q_out") return &q_out;
    return &kv_out;
  }
};

const char* const kTensorNames[] = {"qkv", "q_weight", "kv_weight", "q_out", "kv_out"};

// The status is an invalid-argument error whose message holds every fragment.
void expect_rejected(const Status& status, std::initializer_list<std::string> fragments) {
  ASSERT_FALSE(status.ok()) << "accepted; expected an error mentioning " << *fragments.begin();
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument) << status.to_string();
  for (const std::string& fragment : fragments) {
    EXPECT_NE(status.message().find(fragment), std::string::npos)
        << "'" << fragment << "' missing from: " << status.message();
  }
}

TEST(NormArgs, AcceptsValidArgumentsAndFillsParams) {
  NormArgs args;
  QkvNormParams params;
  DSA_ASSERT_OK(args.make(&params));
  EXPECT_EQ(params.qkv, args.qkv.data);
  EXPECT_EQ(params.q_weight, args.q_weight.data);
  EXPECT_EQ(params.kv_weight, args.kv_weight.data);
  EXPECT_EQ(params.q_out, args.q_out.data);
  EXPECT_EQ(params.kv_out, args.kv_out.data);
  EXPECT_EQ(params.qkv_row_pitch, 2048);
  EXPECT_EQ(params.m, 4);
  EXPECT_EQ(params.q_size, 1536);
  EXPECT_EQ(params.kv_size, 512);
  EXPECT_EQ(params.eps, 1e-6f);

  // A padded row pitch (e.g. qkv as columns of a wider GEMM output), and the
  // extreme sizes: kv_size 8, q_size at the thread limit, one token.
  args.qkv = make_strided(args.qkv.data, DType::kBF16, {4, 2048}, {2048 + 64, 1});
  DSA_ASSERT_OK(args.make(&params));
  EXPECT_EQ(params.qkv_row_pitch, 2048 + 64);
  NormArgs edge;
  edge.qkv = make_tensor(edge.qkv.data, DType::kBF16, {1, kNormMaxSize + 8});
  edge.q_weight.shape[0] = kNormMaxSize;
  edge.kv_weight.shape[0] = 8;
  edge.q_out = make_tensor(edge.q_out.data, DType::kBF16, {1, kNormMaxSize});
  edge.kv_out = make_tensor(edge.kv_out.data, DType::kBF16, {1, 8});
  edge.eps = 0.0f;
  DSA_ASSERT_OK(edge.make());
}

TEST(NormArgs, RejectsWrongDtype) {
  for (const char* name : kTensorNames) {
    NormArgs args;
    args.tensor(name)->dtype = DType::kF16;
    expect_rejected(args.make(), {std::string("'") + name + "'", "dtype bf16", "f16["});
  }
}

TEST(NormArgs, RejectsNullPointers) {
  for (const char* name : kTensorNames) {
    NormArgs args;
    args.tensor(name)->data = nullptr;
    expect_rejected(args.make(), {std::string("'") + name + "'", "null"});
  }
}

TEST(NormArgs, RejectsHostTensors) {
  for (const char* name : kTensorNames) {
    NormArgs args;
    args.tensor(name)->device = Device{DeviceKind::kCPU, 0};
    expect_rejected(args.make(), {std::string("'") + name + "'", "a CUDA tensor", "on cpu"});
  }
}

TEST(NormArgs, RejectsMisalignedData) {
  for (const char* name : kTensorNames) {
    for (uintptr_t offset : {2, 8}) {
      NormArgs args;
      TensorView* t = args.tensor(name);
      t->data = fake_device_pointer(reinterpret_cast<uintptr_t>(t->data) + offset);
      expect_rejected(args.make(), {std::string("'") + name + "'", "aligned to 16 bytes"});
    }
  }
}

TEST(NormArgs, RejectsWrongShapes) {
  {  // qkv narrower than q_size + kv_size
    NormArgs args;
    args.qkv = make_tensor(args.qkv.data, DType::kBF16, {4, 2040});
    expect_rejected(args.make(), {"'qkv'", "shape [*, 2048]", "bf16[4, 2040]"});
  }
  {  // qkv with a head dimension
    NormArgs args;
    args.qkv = make_tensor(args.qkv.data, DType::kBF16, {4, 1, 2048});
    expect_rejected(args.make(), {"'qkv'", "shape [*, 2048]"});
  }
  {  // a 2-D weight
    NormArgs args;
    args.q_weight = make_tensor(args.q_weight.data, DType::kBF16, {1, 1536});
    expect_rejected(args.make(), {"'q_weight'", "shape [*]"});
  }
  {  // q_out of the wrong width
    NormArgs args;
    args.q_out = make_tensor(args.q_out.data, DType::kBF16, {4, 1528});
    expect_rejected(args.make(), {"'q_out'", "shape [4, 1536]"});
  }
  {  // kv_out for another token count
    NormArgs args;
    args.kv_out = make_tensor(args.kv_out.data, DType::kBF16, {5, 512});
    expect_rejected(args.make(), {"'kv_out'", "shape [4, 512]"});
  }
}

TEST(NormArgs, RejectsNonContiguousTensors) {
  {
    NormArgs args;
    args.qkv = make_strided(args.qkv.data, DType::kBF16, {4, 2048}, {4096, 2});
    expect_rejected(args.make(), {"'qkv'", "stride 1 in dim 1"});
  }
  {
    NormArgs args;
    args.kv_weight = make_strided(args.kv_weight.data, DType::kBF16, {512}, {2});
    expect_rejected(args.make(), {"'kv_weight'", "contiguous"});
  }
  {
    NormArgs args;
    args.q_out = make_strided(args.q_out.data, DType::kBF16, {4, 1536}, {1544, 1});
    expect_rejected(args.make(), {"'q_out'", "contiguous"});
  }
  {
    NormArgs args;
    args.kv_out = make_strided(args.kv_out.data, DType::kBF16, {4, 512}, {1, 4});
    expect_rejected(args.make(), {"'kv_out'", "contiguous"});
  }
}

TEST(NormArgs, RejectsBadRowPitch) {
  for (int64_t pitch : {2052, 2044, 2040}) {  // not a multiple of 8 (twice), or narrower than a row
    NormArgs args;
    args.qkv = make_strided(args.qkv.data, DType::kBF16, {4, 2048}, {pitch, 1});
    expect_rejected(args.make(), {"'qkv_row_pitch (qkv.stride(0))'", "multiple of 8", "at least q_size + kv_size = 2048",
                                  "got " + std::to_string(pitch)});
  }
}

// Views whose sizes are consistent with each other, for the size tests.
NormArgs args_with_sizes(int64_t m, int64_t q_size, int64_t kv_size) {
  NormArgs args;
  args.qkv = make_tensor(args.qkv.data, DType::kBF16, {m, q_size + kv_size});
  args.q_weight = make_tensor(args.q_weight.data, DType::kBF16, {q_size});
  args.kv_weight = make_tensor(args.kv_weight.data, DType::kBF16, {kv_size});
  args.q_out = make_tensor(args.q_out.data, DType::kBF16, {m, q_size});
  args.kv_out = make_tensor(args.kv_out.data, DType::kBF16, {m, kv_size});
  return args;
}

// One token's row pitch is never used (tensor.h): any is taken, and the
// params carry it through the launch's recheck; two tokens' is checked.
TEST(NormArgs, AcceptsAnyRowPitchForOneToken) {
  NormArgs one = args_with_sizes(1, 1536, 512);
  one.qkv = make_strided(one.qkv.data, DType::kBF16, {1, 2048}, {3, 1});
  QkvNormParams params;
  DSA_ASSERT_OK(one.make(&params));
  EXPECT_EQ(params.qkv_row_pitch, 3);
  NormArgs two = args_with_sizes(2, 1536, 512);
  two.qkv = make_strided(two.qkv.data, DType::kBF16, {2, 2048}, {3, 1});
  expect_rejected(two.make(), {"'qkv_row_pitch (qkv.stride(0))'", "got 3"});
}

TEST(NormArgs, RejectsSizesNotMultipleOf8) {
  // q_size + kv_size stays a multiple of 8, so only the part sizes are wrong.
  expect_rejected(args_with_sizes(4, 1532, 516).make(), {"'kv_size (kv_weight.size(0))'", "multiple of 8", "got 516"});
  expect_rejected(args_with_sizes(4, 1540, 508).make(), {"'kv_size (kv_weight.size(0))'", "got 508"});
  expect_rejected(args_with_sizes(4, 1532, 512).make(), {"'q_size (q_weight.size(0))'", "multiple of 8", "got 1532"});
  expect_rejected(args_with_sizes(4, 1536, 0).make(), {"'kv_size (kv_weight.size(0))'", "positive", "got 0"});
}

// The outputs are written while other CTAs still read qkv and the weights:
// an in-place norm (the likeliest mistake) and every other shared byte are refused.
TEST(NormArgs, RejectsOutputsSharingMemory) {
  for (const char* out : {"q_out", "kv_out"}) {
    for (const char* in : {"qkv", "q_weight", "kv_weight"}) {
      NormArgs args;
      args.tensor(out)->data = args.tensor(in)->data;
      expect_rejected(args.make(), {std::string("'") + out + "'", std::string("memory disjoint from '") + in + "'"});
    }
  }
  NormArgs args;
  args.kv_out.data = static_cast<char*>(args.q_out.data) + 2 * (args.q_size - 8);  // the last 8 values of q_out's row 0
  expect_rejected(args.make(), {"'q_out'", "memory disjoint from 'kv_out'"});
}

TEST(NormArgs, RejectsQSizeBelowKvSize) {
  expect_rejected(args_with_sizes(4, 512, 1536).make(),
                  {"'q_size (q_weight.size(0))'", "at least kv_size = 1536", "got 512"});
}

TEST(NormArgs, RejectsQSizeOverThreadLimit) {
  expect_rejected(args_with_sizes(4, kNormMaxSize + 8, 512).make(),
                  {"'q_size (q_weight.size(0))'", "at most 8192", "got 8200"});
}

TEST(NormArgs, RejectsEmptyBatch) {
  expect_rejected(args_with_sizes(0, 1536, 512).make(), {"'m (qkv.size(0))'", "1 to", "got 0"});
}

TEST(NormArgs, RejectsBadEps) {
  for (float eps : {-1e-6f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    NormArgs args;
    args.eps = eps;
    expect_rejected(args.make(), {"'eps'", "finite value >= 0"});
  }
}

TEST(NormArgs, LaunchRechecksParamsBeforeLaunching) {
  NormArgs args;
  QkvNormParams valid;
  DSA_ASSERT_OK(args.make(&valid));
  // Every case fails before the launch, so no GPU is needed.
  QkvNormParams params = valid;
  params.q_size = 1532;
  expect_rejected(launch_qkv_norm(params, nullptr), {"'q_size (q_weight.size(0))'"});
  params = valid;
  params.m = 0;
  expect_rejected(launch_qkv_norm(params, nullptr), {"'m (qkv.size(0))'"});
  params = valid;
  params.qkv_row_pitch = 2000;
  expect_rejected(launch_qkv_norm(params, nullptr), {"'qkv_row_pitch (qkv.stride(0))'"});
  params = valid;
  params.q_out = nullptr;
  expect_rejected(launch_qkv_norm(params, nullptr), {"'q_out'", "null"});
  params = valid;
  params.kv_weight = fake_device_pointer(0x30008);
  expect_rejected(launch_qkv_norm(params, nullptr), {"'kv_weight'", "16-byte aligned"});
}

// ---------------------------------------------------------------------------
// Comparison helpers.

// Position of a BF16 value on the number line (+0 and -0 both 0), so that the
// difference of two positions is their distance in ulp.
int bf16_order(uint16_t bits) { return (bits & 0x8000u) ? -static_cast<int>(bits & 0x7FFFu) : static_cast<int>(bits); }
bool bf16_is_nan(uint16_t bits) { return (bits & 0x7FFFu) > 0x7F80u; }

struct Agreement {
  int max_ulp = 0;
  int64_t different = 0;  // values whose bits differ
  int64_t count = 0;
  int64_t nan = 0;        // NaN on either side (no finite input gives one)
  std::string describe() const {
    return "max " + std::to_string(max_ulp) + " BF16 ulp, " + std::to_string(different) + " of " +
           std::to_string(count) + " values not bitwise identical, " + std::to_string(nan) + " NaN";
  }
};

void accumulate(Agreement* agreement, const uint16_t* got, const uint16_t* want, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    ++agreement->count;
    if (bf16_is_nan(got[i]) || bf16_is_nan(want[i])) {
      ++agreement->nan;
      continue;
    }
    if (got[i] == want[i]) continue;
    ++agreement->different;
    agreement->max_ulp = std::max(agreement->max_ulp, std::abs(bf16_order(got[i]) - bf16_order(want[i])));
  }
}

// The textbook RMSNorm in float64, rounded once to BF16.
void float64_rmsnorm(const uint16_t* x, const uint16_t* gamma, int size, float eps, uint16_t* y) {
  double squares = 0.0;
  for (int i = 0; i < size; ++i) squares += static_cast<double>(num::bf16_to_float(x[i])) * num::bf16_to_float(x[i]);
  const double rrms = 1.0 / std::sqrt(squares / size + eps);
  for (int i = 0; i < size; ++i) {
    y[i] = num::float_to_bf16(static_cast<float>(num::bf16_to_float(x[i]) * rrms * num::bf16_to_float(gamma[i])));
  }
}

// ---------------------------------------------------------------------------
// Inputs on the host: qkv rows of widely different scales, NaN in the row padding
// (which nothing may read), weights around 1.

struct NormShape {
  int m, q_size, kv_size;
  int64_t pitch;
};

std::string shape_name(const NormShape& s) {
  return "m=" + std::to_string(s.m) + " q_size=" + std::to_string(s.q_size) + " kv_size=" + std::to_string(s.kv_size) +
         " pitch=" + std::to_string(s.pitch);
}

struct HostInputs {
  std::vector<uint16_t> qkv;        // [m, pitch]
  std::vector<uint16_t> q_weight;   // [q_size]
  std::vector<uint16_t> kv_weight;  // [kv_size]
};

HostInputs random_inputs(const NormShape& s, std::mt19937_64& rng) {
  HostInputs in;
  in.qkv.assign(s.m * s.pitch, kPoison);
  const float row_scales[] = {0.01f, 1.0f, 37.0f};
  for (int t = 0; t < s.m; ++t) {
    const std::vector<uint16_t> row = testing::random_bf16(s.q_size + s.kv_size, row_scales[rng() % 3], rng);
    std::copy(row.begin(), row.end(), in.qkv.begin() + t * s.pitch);
  }
  auto weight = [&rng](int size) {
    std::normal_distribution<float> around_one(1.0f, 0.25f);
    std::vector<uint16_t> w(size);
    for (uint16_t& v : w) v = num::float_to_bf16(around_one(rng));
    return w;
  };
  in.q_weight = weight(s.q_size);
  in.kv_weight = weight(s.kv_size);
  return in;
}

TEST(NormReference, MatchesFloat64RmsNormWithin1Ulp) {
  std::mt19937_64 rng(testing::test_seed());
  Agreement agreement;
  const NormShape shapes[] = {{8, 1536, 512, 2048}, {8, 2048, 512, 2560 + 64}, {8, 512, 512, 1024},
                              {8, 64, 8, 80},       {4, 520, 136, 656},        {2, kNormMaxSize, 8, kNormMaxSize + 8}};
  for (const NormShape& s : shapes) {
    const HostInputs in = random_inputs(s, rng);
    std::vector<uint16_t> q_out(s.m * s.q_size), kv_out(s.m * s.kv_size);
    reference::qkv_rmsnorm(in.qkv.data(), s.pitch, in.q_weight.data(), in.kv_weight.data(), s.m, s.q_size, s.kv_size,
                           1e-6f, q_out.data(), kv_out.data());
    std::vector<uint16_t> want(std::max(s.q_size, s.kv_size));
    for (int t = 0; t < s.m; ++t) {
      const uint16_t* row = in.qkv.data() + t * s.pitch;
      float64_rmsnorm(row, in.q_weight.data(), s.q_size, 1e-6f, want.data());
      accumulate(&agreement, q_out.data() + t * s.q_size, want.data(), s.q_size);
      float64_rmsnorm(row + s.q_size, in.kv_weight.data(), s.kv_size, 1e-6f, want.data());
      accumulate(&agreement, kv_out.data() + t * s.kv_size, want.data(), s.kv_size);
    }
  }
  std::printf("[norm] CPU reference vs float64: %s\n", agreement.describe().c_str());
  EXPECT_EQ(agreement.nan, 0);
  EXPECT_LE(agreement.max_ulp, 1) << agreement.describe();
}

TEST(NormReference, SumOfSquaresKeepsTheKernelOrder) {
  // Squares chosen so that every order gives a different FP32 sum: 2^24 absorbs
  // a following 1 (a tie, to even) but not a following 2.
  // Lane 0's thread: 4096 then seven 1s -> the fma chain stays at 2^24.
  // Lane 16's thread: eight 1s -> 8. Butterfly step xor 16: 2^24 + 8 (exact).
  // Every other lane holds 0, so the warp total is 2^24 + 8. A sequential sum
  // of all values gives 2^24 (each 1 absorbed), the exact sum 2^24 + 15 rounds
  // to 2^24 + 16, and the ones added before 2^24 would give 2^24 + 16 too.
  std::vector<uint16_t> x(256, 0);
  x[0] = num::float_to_bf16(4096.0f);
  for (int i = 1; i < 8; ++i) x[i] = num::float_to_bf16(1.0f);
  for (int i = 128; i < 136; ++i) x[i] = num::float_to_bf16(1.0f);
  EXPECT_EQ(reference::norm_sum_of_squares(x.data(), 256), 16777216.0f + 8.0f);
  // A second warp's total is added after the first's: (2^24 + 8) + 3 -> 2^24 + 12 (tie to even).
  x.resize(512, 0);
  for (int i = 256; i < 259; ++i) x[i] = num::float_to_bf16(1.0f);
  EXPECT_EQ(reference::norm_sum_of_squares(x.data(), 512), 16777216.0f + 12.0f);
}

// ---------------------------------------------------------------------------
// GPU tests.

// A blocking stream: it orders after DeviceBuffer's uploads and poison fills,
// which run on the legacy default stream.
class Stream {
 public:
  Stream() { cudaStreamCreate(&stream_); }
  ~Stream() { cudaStreamDestroy(stream_); }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// An output buffer with kGuard poisoned elements on each side.
struct GuardedOutput {
  DeviceBuffer<uint16_t> buffer;
  int64_t count;
  explicit GuardedOutput(int64_t n) : buffer(n + 2 * kGuard), count(n) { buffer.fill_bytes(0xFF); }
  uint16_t* data() const { return buffer.get() + kGuard; }
  // The interior; fails the test if a guard element changed or an element was left unwritten.
  std::vector<uint16_t> download_checked(const char* name) const {
    const std::vector<uint16_t> all = buffer.download();
    for (int64_t i = 0; i < kGuard; ++i) {
      EXPECT_EQ(all[i], kPoison) << name << ": guard element " << i - kGuard << " overwritten";
      EXPECT_EQ(all[kGuard + count + i], kPoison) << name << ": guard element " << count + i << " overwritten";
    }
    std::vector<uint16_t> interior(all.begin() + kGuard, all.begin() + kGuard + count);
    for (int64_t i = 0; i < count; ++i) {
      if (interior[i] == kPoison) {
        ADD_FAILURE() << name << ": element " << i << " not written";
        break;
      }
    }
    return interior;
  }
};

// One shape on the device: inputs uploaded, outputs guarded and poisoned.
struct DeviceCase {
  NormShape shape;
  HostInputs in;
  DeviceBuffer<uint16_t> qkv, q_weight, kv_weight;
  GuardedOutput q_out, kv_out;

  DeviceCase(const NormShape& s, std::mt19937_64& rng)
      : shape(s),
        in(random_inputs(s, rng)),
        qkv(in.qkv),
        q_weight(in.q_weight),
        kv_weight(in.kv_weight),
        q_out(int64_t{s.m} * s.q_size),
        kv_out(int64_t{s.m} * s.kv_size) {}

  // Tokens [first, first + m) of the inputs into the outputs' rows [0, m).
  Status run(cudaStream_t stream, int first = 0, int m = -1) const {
    if (m < 0) m = shape.m;
    const TensorView qkv_view = make_strided(qkv.get() + first * shape.pitch, DType::kBF16,
                                             {m, shape.q_size + shape.kv_size}, {shape.pitch, 1});
    return qkv_rmsnorm(qkv_view, make_tensor(q_weight.get(), DType::kBF16, {shape.q_size}),
                       make_tensor(kv_weight.get(), DType::kBF16, {shape.kv_size}), kEps,
                       make_tensor(q_out.data(), DType::kBF16, {m, shape.q_size}),
                       make_tensor(kv_out.data(), DType::kBF16, {m, shape.kv_size}), stream);
  }
  void poison_outputs() {
    q_out.buffer.fill_bytes(0xFF);
    kv_out.buffer.fill_bytes(0xFF);
  }
  static constexpr float kEps = 1e-6f;
};

// The shapes the GPU tests sweep: glm5next (1536/512) at every m the stage runs
// and 64, the other presets' sizes, the extremes (kv_size 8, q_size at the
// thread limit), and partial warps (520/8 = 65 and 136/8 = 17 threads).
std::vector<NormShape> gpu_shapes() {
  std::vector<NormShape> shapes;
  if (testing::quick_mode()) {
    return {{1, 1536, 512, 2048}, {3, 1536, 512, 2048 + 8}, {2, 520, 136, 656}, {2, 64, 8, 72}};
  }
  for (int m = 1; m <= 16; ++m) shapes.push_back({m, 1536, 512, m % 2 ? 2048 : 2048 + 64});
  shapes.push_back({64, 1536, 512, 2048});
  for (int m : {1, 7, 16, 64}) {
    shapes.push_back({m, 2048, 512, 2560 + 8});
    shapes.push_back({m, 512, 512, 1024});
    shapes.push_back({m, 64, 8, 72 + 8});
    shapes.push_back({m, 520, 136, 656});
    shapes.push_back({m, kNormMaxSize, 8, kNormMaxSize + 8});
  }
  return shapes;
}

// q_out and kv_out of the reference for the whole case.
void reference_outputs(const DeviceCase& c, std::vector<uint16_t>* q_out, std::vector<uint16_t>* kv_out) {
  const NormShape& s = c.shape;
  q_out->resize(int64_t{s.m} * s.q_size);
  kv_out->resize(int64_t{s.m} * s.kv_size);
  reference::qkv_rmsnorm(c.in.qkv.data(), s.pitch, c.in.q_weight.data(), c.in.kv_weight.data(), s.m, s.q_size,
                         s.kv_size, DeviceCase::kEps, q_out->data(), kv_out->data());
}

TEST(NormGpu, MatchesReferenceWithin1UlpAndWritesOnlyItsOutputs) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  Stream stream;
  Agreement total;
  for (const NormShape& s : gpu_shapes()) {
    SCOPED_TRACE(shape_name(s));
    DeviceCase c(s, rng);
    DSA_ASSERT_OK(c.run(stream.get()));
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
    DSA_ASSERT_CUDA(cudaGetLastError());
    const std::vector<uint16_t> q_got = c.q_out.download_checked("q_out");
    const std::vector<uint16_t> kv_got = c.kv_out.download_checked("kv_out");
    EXPECT_EQ(c.qkv.download(), c.in.qkv) << "qkv changed";

    std::vector<uint16_t> q_want, kv_want;
    reference_outputs(c, &q_want, &kv_want);
    Agreement agreement;
    accumulate(&agreement, q_got.data(), q_want.data(), q_got.size());
    accumulate(&agreement, kv_got.data(), kv_want.data(), kv_got.size());
    EXPECT_EQ(agreement.nan, 0) << agreement.describe();
    EXPECT_LE(agreement.max_ulp, 1) << agreement.describe();
    accumulate(&total, q_got.data(), q_want.data(), q_got.size());
    accumulate(&total, kv_got.data(), kv_want.data(), kv_got.size());
  }
  std::printf("[norm] GPU vs CPU reference: %s\n", total.describe().c_str());
  // rsqrt.approx and div.full are a few FP32 ulp from exact; that moves a BF16
  // rounding in roughly 1e-4 of the values. Far more means a different order.
  EXPECT_LE(total.different, 2 + total.count / 1000) << total.describe();
}

// The device's rrms for given totals: the kernel's expression, compiled for the GPU.
__global__ void device_rrms_kernel(const float* totals, const int* sizes, float eps, float* rrms, int count) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) rrms[i] = num::rsqrt_approx(num::div_full(totals[i], static_cast<float>(sizes[i])) + eps);
}

TEST(NormGpu, BitwiseEqualToReferenceGivenTheDeviceRrms) {
  // With rsqrt.approx/div.full evaluated on the device, the reference's order of
  // sums and multiplies must reproduce every bit: the only freedom left to the
  // kernel's result is the approximations.
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 1);
  Stream stream;
  const int m = testing::quick_mode() ? 4 : 64;
  for (const NormShape& s : {NormShape{m, 1536, 512, 2048 + 8}, NormShape{m, 520, 136, 656}}) {
    SCOPED_TRACE(shape_name(s));
    DeviceCase c(s, rng);
    DSA_ASSERT_OK(c.run(stream.get()));
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
    const std::vector<uint16_t> q_got = c.q_out.download_checked("q_out");
    const std::vector<uint16_t> kv_got = c.kv_out.download_checked("kv_out");

    // Row r = 2 t + part.
    std::vector<float> totals(2 * m);
    std::vector<int> sizes(2 * m);
    for (int t = 0; t < m; ++t) {
      const uint16_t* row = c.in.qkv.data() + t * s.pitch;
      totals[2 * t] = reference::norm_sum_of_squares(row, s.q_size);
      totals[2 * t + 1] = reference::norm_sum_of_squares(row + s.q_size, s.kv_size);
      sizes[2 * t] = s.q_size;
      sizes[2 * t + 1] = s.kv_size;
    }
    DeviceBuffer<float> totals_device(totals), rrms_device(totals.size());
    DeviceBuffer<int> sizes_device(sizes);
    device_rrms_kernel<<<1, 2 * m, 0, stream.get()>>>(totals_device.get(), sizes_device.get(), DeviceCase::kEps,
                                                     rrms_device.get(), 2 * m);
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
    DSA_ASSERT_CUDA(cudaGetLastError());
    const std::vector<float> rrms = rrms_device.download();

    std::vector<uint16_t> want(s.q_size);
    Agreement agreement;
    for (int t = 0; t < m; ++t) {
      const uint16_t* row = c.in.qkv.data() + t * s.pitch;
      reference::norm_apply_rrms(row, c.in.q_weight.data(), s.q_size, rrms[2 * t], want.data());
      accumulate(&agreement, q_got.data() + t * s.q_size, want.data(), s.q_size);
      reference::norm_apply_rrms(row + s.q_size, c.in.kv_weight.data(), s.kv_size, rrms[2 * t + 1], want.data());
      accumulate(&agreement, kv_got.data() + t * s.kv_size, want.data(), s.kv_size);
    }
    EXPECT_EQ(agreement.different, 0) << agreement.describe();
    EXPECT_EQ(agreement.nan, 0) << agreement.describe();
  }
}

TEST(NormGpu, RepeatedRunsAreBitwiseIdentical) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 2);
  Stream stream;
  DeviceCase c({testing::quick_mode() ? 3 : 16, 1536, 512, 2048}, rng);
  std::vector<uint16_t> q_first, kv_first;
  for (int run = 0; run < 5; ++run) {
    c.poison_outputs();
    DSA_ASSERT_OK(c.run(stream.get()));
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
    const std::vector<uint16_t> q_got = c.q_out.download_checked("q_out");
    const std::vector<uint16_t> kv_got = c.kv_out.download_checked("kv_out");
    if (run == 0) {
      q_first = q_got;
      kv_first = kv_got;
      continue;
    }
    EXPECT_EQ(q_got, q_first) << "run " << run;
    EXPECT_EQ(kv_got, kv_first) << "run " << run;
  }
}

TEST(NormGpu, TokenResultIsTheSameAloneAndInsideABatch) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 3);
  Stream stream;
  const int m = testing::quick_mode() ? 4 : 64;
  DeviceCase batch({m, 1536, 512, 2048 + 64}, rng);
  DSA_ASSERT_OK(batch.run(stream.get()));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
  const std::vector<uint16_t> q_batch = batch.q_out.download_checked("q_out");
  const std::vector<uint16_t> kv_batch = batch.kv_out.download_checked("kv_out");
  for (int t = 0; t < m; t += testing::quick_mode() ? 3 : 5) {
    for (int count : {1, 2}) {  // token t alone, and first of a batch of two
      if (t + count > m) continue;
      SCOPED_TRACE("token " + std::to_string(t) + " in a batch of " + std::to_string(count));
      batch.poison_outputs();
      DSA_ASSERT_OK(batch.run(stream.get(), t, count));
      DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
      const std::vector<uint16_t> q_alone = batch.q_out.buffer.download();
      const std::vector<uint16_t> kv_alone = batch.kv_out.buffer.download();
      EXPECT_TRUE(std::equal(q_batch.begin() + t * 1536, q_batch.begin() + (t + count) * 1536,
                             q_alone.begin() + kGuard));
      EXPECT_TRUE(std::equal(kv_batch.begin() + t * 512, kv_batch.begin() + (t + count) * 512,
                             kv_alone.begin() + kGuard));
    }
  }
}

TEST(NormGpu, PdlChainMatchesSerializedLaunches) {
  // Each launch normalizes the previous launch's output (one token: q_out and
  // kv_out are the two halves of the next qkv row). Launched back to back with
  // PDL, every launch must still read its input after the previous one
  // finished: the same bits as launches with a synchronization between them.
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 4);
  Stream stream;
  constexpr int kQ = 1536, kKv = 512, kLaunches = 16;
  const std::vector<uint16_t> q_weight = testing::random_bf16(kQ, 1.0f, rng);
  const std::vector<uint16_t> kv_weight = testing::random_bf16(kKv, 1.0f, rng);
  const std::vector<uint16_t> first_row = testing::random_bf16(kQ + kKv, 3.0f, rng);
  DeviceBuffer<uint16_t> q_weight_device(q_weight), kv_weight_device(kv_weight);

  auto chain = [&](bool synchronize_each, std::vector<uint16_t>* result) {
    DeviceBuffer<uint16_t> rows[2] = {DeviceBuffer<uint16_t>(first_row), DeviceBuffer<uint16_t>(kQ + kKv)};
    for (int i = 0; i < kLaunches; ++i) {
      const DeviceBuffer<uint16_t>& in = rows[i % 2];
      const DeviceBuffer<uint16_t>& out = rows[(i + 1) % 2];
      DSA_ASSERT_OK(qkv_rmsnorm(make_tensor(in.get(), DType::kBF16, {1, kQ + kKv}),
                                make_tensor(q_weight_device.get(), DType::kBF16, {kQ}),
                                make_tensor(kv_weight_device.get(), DType::kBF16, {kKv}), 1e-6f,
                                make_tensor(out.get(), DType::kBF16, {1, kQ}),
                                make_tensor(out.get() + kQ, DType::kBF16, {1, kKv}), stream.get()));
      if (synchronize_each) DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
    }
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
    DSA_ASSERT_CUDA(cudaGetLastError());
    *result = rows[kLaunches % 2].download();
  };
  std::vector<uint16_t> serialized, chained;
  ASSERT_NO_FATAL_FAILURE(chain(true, &serialized));
  ASSERT_NO_FATAL_FAILURE(chain(false, &chained));
  EXPECT_EQ(chained, serialized);
}

// The run path allocates and synchronizes nothing: a captured launch replays
// the direct launch's bits over poisoned outputs.
TEST(NormGpu, CapturedGraphReplaysTheSameResult) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 5);
  Stream stream;
  constexpr int kQ = 1536, kKv = 512, kM = 4;
  DeviceBuffer<uint16_t> qkv(testing::random_bf16(kM * (kQ + kKv), 3.0f, rng));
  DeviceBuffer<uint16_t> q_weight(testing::random_bf16(kQ, 1.0f, rng)), kv_weight(testing::random_bf16(kKv, 1.0f, rng));
  DeviceBuffer<uint16_t> q_out(kM * kQ), kv_out(kM * kKv);
  auto launch = [&] {
    return qkv_rmsnorm(make_tensor(qkv.get(), DType::kBF16, {kM, kQ + kKv}),
                       make_tensor(q_weight.get(), DType::kBF16, {kQ}), make_tensor(kv_weight.get(), DType::kBF16, {kKv}),
                       1e-6f, make_tensor(q_out.get(), DType::kBF16, {kM, kQ}),
                       make_tensor(kv_out.get(), DType::kBF16, {kM, kKv}), stream.get());
  };
  DSA_ASSERT_OK(launch());
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
  const std::vector<uint16_t> direct_q = q_out.download(), direct_kv = kv_out.download();

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  const Status captured = launch();
  DSA_ASSERT_CUDA(cudaStreamEndCapture(stream.get(), &graph));
  DSA_ASSERT_OK(captured);
  DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  q_out.fill_bytes(0xFF);
  kv_out.fill_bytes(0xFF);
  for (int i = 0; i < 3; ++i) DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream.get()));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
  EXPECT_EQ(q_out.download(), direct_q);
  EXPECT_EQ(kv_out.download(), direct_kv);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace
}  // namespace dsa
