// The tensor view, argument checks, status and presets.
#include <gtest/gtest.h>

#include "dsa_decode/presets.h"
#include "dsa_decode/tensor.h"

namespace dsa {
namespace {

TEST(TensorView, ContiguousStridesAndSpan) {
  int storage = 0;
  TensorView t = make_tensor(&storage, DType::kBF16, {4, 64, 256});
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.stride(0), 64 * 256);
  EXPECT_EQ(t.stride(1), 256);
  EXPECT_EQ(t.stride(2), 1);
  EXPECT_EQ(t.numel(), 4 * 64 * 256);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.span_elements(), t.numel());

  TensorView padded = make_strided(&storage, DType::kBF16, {4, 64, 256}, {64 * 256 + 8, 256, 1});
  EXPECT_FALSE(padded.is_contiguous());
  EXPECT_EQ(padded.span_elements(), 3 * (64 * 256 + 8) + 64 * 256);
}

TEST(TensorView, ChecksNameTheArgumentAndTheExpectation) {
  int storage = 0;
  TensorView t = make_tensor(&storage, DType::kF32, {2, 3});
  Status s = check_dtype(t, "weight", DType::kBF16);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'weight'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("bf16"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("f32[2, 3]"), std::string::npos) << s.message();

  s = check_shape(t, "x", {2, -1, 4});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("shape [2, *, 4]"), std::string::npos) << s.message();
  EXPECT_TRUE(check_shape(t, "x", {2, -1}).ok());

  s = check_stride(t, "x", 1, 2);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(check_stride(t, "x", 1, 1).ok());
  // A size-1 dimension's stride is never used, so never checked.
  EXPECT_TRUE(check_stride(make_strided(&storage, DType::kF32, {1, 3}, {3, 1}), "x", 0, 4).ok());
  EXPECT_FALSE(check_stride(make_strided(&storage, DType::kF32, {2, 3}, {3, 1}), "x", 0, 4).ok());

  TensorView empty;
  s = check_dtype(empty, "scale", DType::kF32);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("null"), std::string::npos) << s.message();

  TensorView misaligned = make_tensor(reinterpret_cast<char*>(&storage) + 2, DType::kBF16, {1});
  EXPECT_FALSE(check_aligned(misaligned, "x", 16).ok());

  TensorView host = make_tensor(&storage, DType::kF32, {1}, Device{DeviceKind::kCPU, 0});
  EXPECT_FALSE(check_on_cuda(host, "x").ok());
  EXPECT_TRUE(check_on_cuda(t, "x").ok());
}

TEST(TensorView, BadDimensionsAndOverlapsAreRejected) {
  int storage[16] = {};
  TensorView five = make_tensor(storage, DType::kF32, {1, 2, 3, 4, 5});
  EXPECT_FALSE(check_present(five, "x").ok()) << "more than kMaxDims sizes must not pass";
  TensorView negative = make_tensor(storage, DType::kF32, {2, -3});
  Status s = check_present(negative, "x");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("non-negative"), std::string::npos) << s.message();

  TensorView first = make_tensor(storage, DType::kF32, {8});
  TensorView second = make_tensor(storage + 8, DType::kF32, {8});
  TensorView straddling = make_tensor(storage + 7, DType::kF32, {2});
  EXPECT_FALSE(tensors_overlap(first, second));
  EXPECT_TRUE(tensors_overlap(first, straddling));
  EXPECT_TRUE(tensors_overlap(straddling, second));
  s = check_no_overlap(straddling, "out", first, "x");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'out'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("disjoint from 'x'"), std::string::npos) << s.message();
}

// The row helpers the kernels share: a single row takes any stride (it is
// never stepped), more rows need non-overlapping strides of a multiple of 8.
TEST(TensorView, RowHelpersTakeAnyStrideForOneRow) {
  alignas(16) static uint16_t storage[64];
  EXPECT_TRUE(check_bf16_rows(make_strided(storage, DType::kBF16, {1, 16}, {3, 1}), "x", 1, 16).ok());
  Status s = check_bf16_rows(make_strided(storage, DType::kBF16, {2, 16}, {12, 1}), "x", 2, 16);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("a row stride of a multiple of 8 elements, at least 16"), std::string::npos)
      << s.message();
  EXPECT_FALSE(check_bf16_rows(make_strided(storage, DType::kBF16, {2, 16}, {20, 1}), "x", 2, 16).ok());
  EXPECT_FALSE(check_bf16_rows(make_strided(storage, DType::kBF16, {2, 16}, {8, 1}), "x", 2, 16).ok())
      << "a multiple of 8, but rows overlap";
  EXPECT_TRUE(check_bf16_rows(make_strided(storage, DType::kBF16, {2, 16}, {24, 1}), "x", 2, 16).ok());

  EXPECT_TRUE(
      check_head_rows(make_strided(storage, DType::kBF16, {1, 2, 8}, {5, 8, 1}), "q", DType::kBF16, 1, 2, 8).ok());
  s = check_head_rows(make_strided(storage, DType::kBF16, {2, 2, 8}, {8, 8, 1}), "q", DType::kBF16, 2, 2, 8);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("at least heads * dim = 16"), std::string::npos) << s.message();
  EXPECT_FALSE(
      check_head_rows(make_strided(storage, DType::kBF16, {1, 2, 8}, {16, 9, 1}), "q", DType::kBF16, 1, 2, 8).ok())
      << "heads are contiguous rows of dim values";
  EXPECT_TRUE(
      check_head_rows(make_strided(storage, DType::kBF16, {1, 1, 8}, {16, 3, 1}), "q", DType::kBF16, 1, 1, 8).ok())
      << "a single head is never stepped over";

  EXPECT_TRUE(check_error_counter(nullptr, "error_count").ok());
  alignas(4) static unsigned int counter[2];
  EXPECT_TRUE(check_error_counter(counter, "error_count").ok());
  s = check_error_counter(reinterpret_cast<unsigned int*>(reinterpret_cast<char*>(counter) + 2), "error_count");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("4-byte aligned"), std::string::npos) << s.message();
}

TEST(TensorView, SliceRowsKeepsStridesAndOffsetsTheData) {
  alignas(16) static uint16_t storage[6 * 10];
  const TensorView t = make_strided(storage, DType::kBF16, {6, 8}, {10, 1});
  const TensorView r = slice_rows(t, 2, 3);
  EXPECT_EQ(r.data, static_cast<void*>(storage + 20));
  EXPECT_EQ(r.size(0), 3);
  EXPECT_EQ(r.size(1), 8);
  EXPECT_EQ(r.stride(0), 10);
  EXPECT_EQ(r.stride(1), 1);
}

TEST(Status, ToStringCarriesCodeAndMessage) {
  Status s = invalid_argument("m", "1..16", "17");
  EXPECT_EQ(s.to_string(), "invalid argument: argument 'm': expected 1..16, got 17");
  EXPECT_TRUE(Status().ok());
}

TEST(Presets, Glm5NextShapes) {
  ModelPreset p;
  ASSERT_TRUE(find_preset("glm5next", &p).ok());
  EXPECT_EQ(p.hidden, 4096);
  EXPECT_EQ(p.heads, 64);
  EXPECT_EQ(p.q_lora, 1536);
  EXPECT_EQ(p.kv_lora, 512);
  EXPECT_EQ(p.qk_nope, 256);
  EXPECT_EQ(p.qk_rope, 0);
  EXPECT_EQ(p.v_head, 256);
  EXPECT_EQ(p.topk_row_width, 2176);
  EXPECT_EQ(p.pool_size, 4);
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.0625f);
  EXPECT_EQ(p.cache_width(), 512);

  ModelPreset tp8;
  ASSERT_TRUE(per_rank(p, 8, &tp8).ok());
  EXPECT_EQ(tp8.heads, 8);
  EXPECT_EQ(tp8.tp, 8);
  EXPECT_EQ(tp8.index_heads, 32);  // the indexer is replicated, not split

  Status s = per_rank(p, 3, &tp8);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'tp'"), std::string::npos) << s.message();
}

TEST(Presets, RopePresetsAndUnknownName) {
  ModelPreset p;
  ASSERT_TRUE(find_preset("dsv32", &p).ok());
  EXPECT_EQ(p.heads, 128);
  EXPECT_EQ(p.q_head_dim(), 192);
  EXPECT_EQ(p.cache_width(), 576);
  ASSERT_TRUE(find_preset("glm5", &p).ok());
  EXPECT_EQ(p.hidden, 6144);
  Status s = find_preset("llama", &p);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("glm5next, glm5, dsv32"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace dsa
