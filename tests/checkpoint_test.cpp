// dsa-decode --weights (tools/checkpoint.h): small checkpoints in the
// Hugging Face layout written from code (scaled-down shapes, the synthetic
// layer's random values, BF16 and FP8 with 128 x 128 block scales, one file
// and shards with model.safetensors.index.json) load to the values written
// (BF16) or their block dequantization (FP8), bit for bit, with the heads of
// --tp's rank 0 split as vLLM splits them; every loading error names the
// tensor (or the file, for a bad header). Checkpoint.FullSizeGlm5next... writes
// a whole glm5next layer (BF16 ~250 MB, FP8 ~130 MB), loads it at TP1 and TP8
// and prints the load's GB/s; with DSA_CHECKPOINT_OUT set it keeps the
// checkpoints there for the dsa-decode --cpu --weights program tests.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"
#include "tools/checkpoint.h"
#include "tools/compare.h"
#include "tools/synthetic_layer.h"

namespace dsa::cli {
namespace {

namespace fs = std::filesystem;

// A directory under the system's temporary one, removed with the object.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "dsa_checkpoint_XXXXXX").string();
    path_ = ::mkdtemp(pattern.data()) != nullptr ? pattern : "";
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A scaled-down NoPE model with the default indexer shape (32 x 128 heads,
// pools of 4, top-2048). Widths not multiples of 128 give partial FP8 blocks.
ModelPreset tiny_preset(int heads, int D = 320, int Q = 192, int L = 160, int P = 64, int V = 96) {
  return ModelPreset{"tiny", "scaled-down glm5next", D, heads, Q, L, P, 0, V, 32, 128, 2048, 2176, 4, 0.125f, 1};
}

StepShape shape_at(const ModelPreset& whole, int tp) {
  ModelPreset rank{};
  EXPECT_TRUE(per_rank(whole, tp, &rank).ok());
  return make_step_shape(rank, 1, 0);
}

constexpr int kLayer = 3;

std::string layer_name(const std::string& suffix) { return layer_tensor_name(kLayer, suffix); }

Status load(const std::vector<std::string>& paths, const StepShape& shape, HostWeights* w,
            CheckpointLoad* info = nullptr) {
  CheckpointLoad ignored;
  return load_layer_weights(paths, kLayer, shape, w, info != nullptr ? info : &ignored);
}

std::string load_error(const std::vector<std::string>& paths, const StepShape& shape) {
  HostWeights w;
  const Status status = load(paths, shape, &w);
  EXPECT_FALSE(status.ok());
  return status.message();
}

// The rank-0 weights of `whole` (TP1 values) at `tp`, as vLLM splits them:
// the first heads of q_b_proj, W_UK_T and W_UV, the first input columns of o_proj.
HostWeights rank0_slice(const StepShape& whole, const HostWeights& w, int tp) {
  HostWeights r = w;
  const int64_t H = whole.H / tp, P = whole.P, Q = whole.Q, L = whole.L, V = whole.V, D = whole.D;
  r.q_b_proj.assign(w.q_b_proj.begin(), w.q_b_proj.begin() + H * P * Q);
  r.w_uk_t.assign(w.w_uk_t.begin(), w.w_uk_t.begin() + H * P * L);
  r.w_uv.assign(w.w_uv.begin(), w.w_uv.begin() + H * L * V);
  r.o_proj.clear();
  for (int64_t row = 0; row < D; ++row) {
    const auto first = w.o_proj.begin() + row * whole.H * V;
    r.o_proj.insert(r.o_proj.end(), first, first + H * V);
  }
  return r;
}

// Every field bit for bit.
void expect_same_weights(const HostWeights& got, const HostWeights& want) {
#define DSA_EXPECT_FIELD(field) \
  EXPECT_EQ(got.field.size(), want.field.size()) << #field; \
  EXPECT_EQ(differing(got.field, want.field), 0u) << #field
  DSA_EXPECT_FIELD(fused_qkv_a_proj);
  DSA_EXPECT_FIELD(q_norm_gamma);
  DSA_EXPECT_FIELD(kv_norm_gamma);
  DSA_EXPECT_FIELD(q_b_proj);
  DSA_EXPECT_FIELD(w_uk_t);
  DSA_EXPECT_FIELD(w_uv);
  DSA_EXPECT_FIELD(o_proj);
  DSA_EXPECT_FIELD(index_k_norm_weight);
  DSA_EXPECT_FIELD(index_k_norm_bias);
  DSA_EXPECT_FIELD(index_ape);
  DSA_EXPECT_FIELD(index_wq_b);
  DSA_EXPECT_FIELD(index_wk);
  DSA_EXPECT_FIELD(index_weights_proj);
  DSA_EXPECT_FIELD(index_compress_gate);
#undef DSA_EXPECT_FIELD
  EXPECT_EQ(got.q_scale, want.q_scale);
  EXPECT_EQ(got.k_scale, want.k_scale);
  EXPECT_EQ(got.eps, want.eps);
}

const TensorToWrite* find_written(const std::vector<TensorToWrite>& tensors, const std::string& name) {
  for (const TensorToWrite& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// What an FP8 block-scaled tensor written as `tensors[name]` stands for, computed here element by element:
// bf16_rne(e4m3(code) * scale_inv[row / 128][col / 128]).
std::vector<uint16_t> expected_fp8(const std::vector<TensorToWrite>& tensors, const std::string& name) {
  const TensorToWrite* codes = find_written(tensors, name);
  const TensorToWrite* scales = find_written(tensors, name + "_scale_inv");
  EXPECT_TRUE(codes != nullptr && scales != nullptr) << name;
  if (codes == nullptr || scales == nullptr) return {};
  EXPECT_EQ(codes->dtype, "F8_E4M3");
  const int64_t rows = codes->shape[0], cols = codes->shape[1], scale_cols = scales->shape[1];
  std::vector<uint16_t> values(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float scale;
      std::memcpy(&scale, scales->data.data() + 4 * ((r / 128) * scale_cols + c / 128), 4);
      values[size_t(r * cols + c)] = num::float_to_bf16(num::e4m3_to_float(codes->data[size_t(r * cols + c)]) * scale);
    }
  }
  return values;
}

// The TP1 weights an FP8 checkpoint of `w` stands for: w with every FP8 projection replaced by its dequantization.
HostWeights fp8_values(const StepShape& whole, const HostWeights& w, const std::vector<TensorToWrite>& tensors) {
  HostWeights d = w;
  const int64_t H = whole.H, P = whole.P, L = whole.L, V = whole.V;
  d.fused_qkv_a_proj = expected_fp8(tensors, layer_name("q_a_proj.weight"));
  const std::vector<uint16_t> kv_a = expected_fp8(tensors, layer_name("kv_a_proj_with_mqa.weight"));
  d.fused_qkv_a_proj.insert(d.fused_qkv_a_proj.end(), kv_a.begin(), kv_a.end());
  d.q_b_proj = expected_fp8(tensors, layer_name("q_b_proj.weight"));
  const std::vector<uint16_t> kv_b = expected_fp8(tensors, layer_name("kv_b_proj.weight"));
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t p = 0; p < P; ++p) {
      for (int64_t l = 0; l < L; ++l) d.w_uk_t[size_t((h * P + p) * L + l)] = kv_b[size_t((h * (P + V) + p) * L + l)];
    }
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t v = 0; v < V; ++v) {
        d.w_uv[size_t((h * L + l) * V + v)] = kv_b[size_t((h * (P + V) + P + v) * L + l)];
      }
    }
  }
  d.o_proj = expected_fp8(tensors, layer_name("o_proj.weight"));
  d.index_wq_b = expected_fp8(tensors, layer_name("indexer.wq_b.weight"));
  d.index_wk = expected_fp8(tensors, layer_name("indexer.wk.weight"));
  return d;
}

std::vector<TensorToWrite> without(std::vector<TensorToWrite> tensors, const std::string& name) {
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const TensorToWrite& t) { return t.name == name; }),
                tensors.end());
  return tensors;
}

TensorToWrite* find_mutable(std::vector<TensorToWrite>* tensors, const std::string& name) {
  for (TensorToWrite& t : *tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

TEST(Checkpoint, Bf16SingleFileLoadsTheWeightsWritten) {
  const ModelPreset whole_preset = tiny_preset(4);
  const StepShape whole = shape_at(whole_preset, 1);
  const HostWeights w = make_weights(whole, 5);
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"), layer_tensors(whole, w, kLayer, CheckpointDType::kBF16)).ok());
  for (const std::vector<std::string>& paths : {std::vector<std::string>{dir.path()},
                                                std::vector<std::string>{dir.file("model.safetensors")}}) {
    HostWeights loaded;
    CheckpointLoad info;
    const Status status = load(paths, whole, &loaded, &info);
    ASSERT_TRUE(status.ok()) << status.to_string();
    expect_same_weights(loaded, w);  // the synthetic layer of the same values, bit for bit
    EXPECT_EQ(info.files, 1u);
    EXPECT_EQ(info.tensors, 14u);
    EXPECT_EQ(info.fp8_tensors, 0u);
    EXPECT_GT(info.bytes, 0u);
  }
}

TEST(Checkpoint, Bf16SplitsHeadsForTpAsVllm) {
  const ModelPreset whole_preset = tiny_preset(4);
  const StepShape whole = shape_at(whole_preset, 1);
  const HostWeights w = make_weights(whole, 6);
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"), layer_tensors(whole, w, kLayer, CheckpointDType::kBF16)).ok());
  for (int tp : {2, 4}) {
    HostWeights loaded;
    const Status status = load({dir.path()}, shape_at(whole_preset, tp), &loaded);
    ASSERT_TRUE(status.ok()) << status.to_string();
    expect_same_weights(loaded, rank0_slice(whole, w, tp));
  }
}

TEST(Checkpoint, KvBProjSplitsIntoWukTAndWuvAsVllm) {
  // kv_b_proj [H * (P + V), L] filled with its own coordinates: W_UK_T[h, p, l] = kv_b[h (P + V) + p, l] and
  // W_UV[h, l, v] = kv_b[h (P + V) + P + v, l] (vLLM: weight.T.view(L, H, P + V).split([P, V]); permute).
  const ModelPreset whole_preset = tiny_preset(2, 128, 128, 8, 4, 3);
  const StepShape whole = shape_at(whole_preset, 1);
  HostWeights w = make_weights(whole, 7);
  std::vector<TensorToWrite> tensors = layer_tensors(whole, w, kLayer, CheckpointDType::kBF16);
  TensorToWrite* kv_b = find_mutable(&tensors, layer_name("kv_b_proj.weight"));
  ASSERT_NE(kv_b, nullptr);
  const int64_t rows = 2 * (4 + 3), L = 8;
  ASSERT_EQ(kv_b->shape, (std::vector<int64_t>{rows, L}));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t l = 0; l < L; ++l) {
      const uint16_t value = num::float_to_bf16(float(r * 16 + l));
      std::memcpy(kv_b->data.data() + 2 * (r * L + l), &value, 2);
    }
  }
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"), tensors).ok());
  HostWeights loaded;
  ASSERT_TRUE(load({dir.path()}, whole, &loaded).ok());
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t p = 0; p < 4; ++p) {
        EXPECT_EQ(num::bf16_to_float(loaded.w_uk_t[size_t((h * 4 + p) * L + l)]), float((h * 7 + p) * 16 + l));
      }
      for (int64_t v = 0; v < 3; ++v) {
        EXPECT_EQ(num::bf16_to_float(loaded.w_uv[size_t((h * L + l) * 3 + v)]), float((h * 7 + 4 + v) * 16 + l));
      }
    }
  }
}

TEST(Checkpoint, Fp8BlocksShardedWithIndexDequantizeBitForBit) {
  const ModelPreset whole_preset = tiny_preset(4);
  const StepShape whole = shape_at(whole_preset, 1);
  const HostWeights w = make_weights(whole, 8);
  const std::vector<TensorToWrite> tensors = layer_tensors(whole, w, kLayer, CheckpointDType::kFp8Block);
  // Shards: the main attention's tensors in one file, the indexer's in another; a tensor of another layer too.
  std::vector<TensorToWrite> first, second;
  std::map<std::string, std::string> weight_map;
  for (const TensorToWrite& t : tensors) {
    const bool indexer = t.name.find(".indexer.") != std::string::npos;
    (indexer ? second : first).push_back(t);
    weight_map[t.name] = indexer ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  }
  first.push_back(TensorToWrite{"model.layers.0.mlp.gate.weight", "BF16", {2, 2}, std::vector<uint8_t>(8, 0)});
  weight_map["model.layers.0.mlp.gate.weight"] = "model-00001-of-00002.safetensors";
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model-00001-of-00002.safetensors"), first).ok());
  ASSERT_TRUE(write_safetensors(dir.file("model-00002-of-00002.safetensors"), second).ok());
  ASSERT_TRUE(write_safetensors_index(dir.path(), weight_map).ok());

  const HostWeights dequantized = fp8_values(whole, w, tensors);
  // Most values change under FP8 (the test would pass vacuously otherwise).
  EXPECT_GT(differing(dequantized.q_b_proj, w.q_b_proj), w.q_b_proj.size() / 2);
  HostWeights loaded;
  CheckpointLoad info;
  const Status status = load({dir.path()}, whole, &loaded, &info);
  ASSERT_TRUE(status.ok()) << status.to_string();
  expect_same_weights(loaded, dequantized);
  EXPECT_EQ(info.files, 2u);
  EXPECT_EQ(info.fp8_tensors, 7u);  // q_a, q_b, kv_a, kv_b, o_proj, wq_b, wk
  // And split for TP2: the dequantized rows and columns of rank 0.
  HostWeights rank;
  ASSERT_TRUE(load({dir.path()}, shape_at(whole_preset, 2), &rank).ok());
  expect_same_weights(rank, rank0_slice(whole, dequantized, 2));
  // The same shards as a list of files (no index).
  HostWeights listed;
  ASSERT_TRUE(load(split_weight_paths(dir.file("model-00001-of-00002.safetensors") + "," +
                                      dir.file("model-00002-of-00002.safetensors")),
                   whole, &listed)
                  .ok());
  expect_same_weights(listed, dequantized);
}

TEST(Checkpoint, Fp8BlockDequantizationIsPerBlock) {
  // Two blocks of rows and columns with different scales; the partial last block too.
  const int64_t rows = 130, cols = 129;
  std::vector<uint8_t> codes(size_t(rows * cols));
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t((i * 37) % 256 == 0x7F ? 0x7E : (i * 37) % 256);
  const std::vector<float> scales = {0.5f, 2.0f, 0.25f, 1e-3f};
  const std::vector<uint16_t> values = dequantize_fp8_blocks(codes.data(), scales.data(), rows, cols);
  for (int64_t r : {int64_t{0}, int64_t{127}, int64_t{128}, int64_t{129}}) {
    for (int64_t c : {int64_t{0}, int64_t{127}, int64_t{128}}) {
      const float scale = scales[size_t((r / 128) * 2 + c / 128)];
      EXPECT_EQ(values[size_t(r * cols + c)], num::float_to_bf16(num::e4m3_to_float(codes[size_t(r * cols + c)]) * scale))
          << r << ", " << c;
    }
  }
}

TEST(Checkpoint, EveryMissingOrMisShapedTensorNamedInOneError) {
  const ModelPreset whole_preset = tiny_preset(4);
  const StepShape whole = shape_at(whole_preset, 1);
  std::vector<TensorToWrite> tensors =
      without(layer_tensors(whole, make_weights(whole, 9), kLayer, CheckpointDType::kBF16), layer_name("q_b_proj.weight"));
  tensors = without(tensors, layer_name("indexer.k_norm.bias"));
  TensorToWrite* o_proj = find_mutable(&tensors, layer_name("o_proj.weight"));
  o_proj->shape = {whole.H * whole.V, whole.D};  // transposed
  TensorToWrite* kv_b = find_mutable(&tensors, layer_name("kv_b_proj.weight"));
  kv_b->dtype = "F16";
  TensorToWrite* gamma = find_mutable(&tensors, layer_name("q_a_layernorm.weight"));
  gamma->dtype = "F8_E4M3";  // FP8 only for the 2-D projections
  gamma->data.resize(gamma->data.size() / 2);
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"), tensors).ok());
  const std::string error = load_error({dir.path()}, whole);
  EXPECT_NE(error.find("5 tensor problems"), std::string::npos) << error;
  EXPECT_NE(error.find(layer_name("q_b_proj.weight") + ": missing (expected [256, 192])"), std::string::npos) << error;
  EXPECT_NE(error.find(layer_name("indexer.k_norm.bias") + ": missing"), std::string::npos) << error;
  EXPECT_NE(error.find(layer_name("o_proj.weight") + ": shape [384, 320], expected [320, 384]"), std::string::npos)
      << error;
  EXPECT_NE(error.find(layer_name("kv_b_proj.weight") + ": dtype F16, expected BF16, F32 or F8_E4M3"), std::string::npos)
      << error;
  EXPECT_NE(error.find(layer_name("q_a_layernorm.weight") + ": dtype F8_E4M3, expected BF16, F32\n"), std::string::npos)
      << error;
}

TEST(Checkpoint, HeadCountOfAnotherModelIsAShapeError) {
  // A checkpoint of 4 heads read as a preset of 8: the per-head tensors are named with both shapes.
  const StepShape four = shape_at(tiny_preset(4), 1);
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"),
                                layer_tensors(four, make_weights(four, 10), kLayer, CheckpointDType::kBF16))
                  .ok());
  const std::string error = load_error({dir.path()}, shape_at(tiny_preset(8), 2));
  EXPECT_NE(error.find(layer_name("q_b_proj.weight") + ": shape [256, 192], expected [512, 192]"), std::string::npos)
      << error;
  EXPECT_NE(error.find(layer_name("kv_b_proj.weight") + ": shape [640, 160], expected [1280, 160]"), std::string::npos)
      << error;
  EXPECT_NE(error.find(layer_name("o_proj.weight") + ": shape [320, 384], expected [320, 768]"), std::string::npos)
      << error;
}

TEST(Checkpoint, Fp8WithoutOrWithBadScalesNamesTheScaleTensor) {
  const StepShape whole = shape_at(tiny_preset(4), 1);
  const std::vector<TensorToWrite> fp8 = layer_tensors(whole, make_weights(whole, 11), kLayer, CheckpointDType::kFp8Block);
  std::vector<TensorToWrite> tensors = without(fp8, layer_name("q_b_proj.weight_scale_inv"));
  TensorToWrite* scale = find_mutable(&tensors, layer_name("o_proj.weight_scale_inv"));
  scale->shape = {2, 2};  // should be [3, 3]
  scale->data.resize(16);
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"), tensors).ok());
  const std::string error = load_error({dir.path()}, whole);
  EXPECT_NE(error.find(layer_name("q_b_proj.weight_scale_inv") + ": missing (the F32 [2, 2] block scales of F8_E4M3 " +
                       layer_name("q_b_proj.weight") + ")"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find(layer_name("o_proj.weight_scale_inv") + ": F32 [2, 2], expected F32 [3, 3]"), std::string::npos)
      << error;
}

TEST(Checkpoint, TruncatedFileNamesTheTensor) {
  const StepShape whole = shape_at(tiny_preset(4), 1);
  const std::vector<TensorToWrite> tensors = layer_tensors(whole, make_weights(whole, 12), kLayer, CheckpointDType::kBF16);
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  ASSERT_TRUE(write_safetensors(path, tensors).ok());
  fs::resize_file(path, fs::file_size(path) - 10);
  const std::string error = load_error({path}, whole);
  EXPECT_NE(error.find(tensors.back().name + ": data ["), std::string::npos) << error;
  EXPECT_NE(error.find("(truncated file)"), std::string::npos) << error;
  EXPECT_NE(error.find(path), std::string::npos) << error;
}

TEST(Checkpoint, BadHeaderNamesTheFileAndBadEntriesTheTensor) {
  const StepShape whole = shape_at(tiny_preset(4), 1);
  TempDir dir;
  const auto write_raw = [&](const std::string& name, const std::string& bytes) {
    std::FILE* f = std::fopen(dir.file(name).c_str(), "wb");
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
    return dir.file(name);
  };
  const auto with_length = [](const std::string& header) {
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char((header.size() >> (8 * i)) & 0xFF);
    return bytes + header;
  };
  const std::string not_json = write_raw("a.safetensors", with_length("{\"x\": [1, 2"));
  std::string error = load_error({not_json}, whole);
  EXPECT_NE(error.find(not_json + ": bad header (JSON: "), std::string::npos) << error;
  const std::string too_long = write_raw("b.safetensors", std::string("\xff\xff\xff\x00\x00\x00\x00\x00{}", 10));
  error = load_error({too_long}, whole);
  EXPECT_NE(error.find(too_long + ": bad header (length 16777215 bytes"), std::string::npos) << error;
  const std::string tiny = write_raw("c.safetensors", "abc");
  error = load_error({tiny}, whole);
  EXPECT_NE(error.find(tiny + ": bad header"), std::string::npos) << error;
  const std::string bad_entry = write_raw(
      "d.safetensors", with_length("{\"" + layer_name("o_proj.weight") + "\": {\"dtype\": \"BF16\", \"shape\": [2]}, "
                                   "\"w2\": {\"dtype\": \"BF16\", \"shape\": [2, 2], \"data_offsets\": [0, 4]}}"));
  error = load_error({bad_entry}, whole);
  EXPECT_NE(error.find(layer_name("o_proj.weight") + ": bad header entry"), std::string::npos) << error;
  EXPECT_NE(error.find("w2: data_offsets span 4 bytes, but BF16 [2, 2] is 8 bytes"), std::string::npos) << error;
  error = load_error({dir.file("absent.safetensors")}, whole);
  EXPECT_NE(error.find(dir.file("absent.safetensors") + ": cannot open"), std::string::npos) << error;
}

TEST(Checkpoint, IndexNamingAnAbsentShardNamesTheTensor) {
  const StepShape whole = shape_at(tiny_preset(4), 1);
  const std::vector<TensorToWrite> tensors = layer_tensors(whole, make_weights(whole, 13), kLayer, CheckpointDType::kBF16);
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model-00001-of-00002.safetensors"), tensors).ok());
  std::map<std::string, std::string> weight_map;
  for (const TensorToWrite& t : tensors) weight_map[t.name] = "model-00001-of-00002.safetensors";
  weight_map[layer_name("o_proj.weight")] = "model-00002-of-00002.safetensors";
  ASSERT_TRUE(write_safetensors_index(dir.path(), weight_map).ok());
  const std::string error = load_error({dir.path()}, whole);
  EXPECT_NE(error.find(layer_name("o_proj.weight") + ": in model-00002-of-00002.safetensors, which is not in"),
            std::string::npos)
      << error;
}

TEST(Checkpoint, AbsentLayerSaysWhichLayersTheFilesHold) {
  const StepShape whole = shape_at(tiny_preset(4), 1);
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"),
                                layer_tensors(whole, make_weights(whole, 14), kLayer, CheckpointDType::kBF16))
                  .ok());
  HostWeights w;
  CheckpointLoad info;
  const Status status = load_layer_weights({dir.path()}, 7, whole, &w, &info);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("14 tensor problems"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("model.layers.7.self_attn.q_a_proj.weight: missing"), std::string::npos);
  EXPECT_NE(status.message().find("(layers with attention tensors in the checkpoint: 3)"), std::string::npos)
      << status.message();
}

TEST(Checkpoint, ConfigJsonEpsIsTheNormsEpsilon) {
  const StepShape whole = shape_at(tiny_preset(4), 1);
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"),
                                layer_tensors(whole, make_weights(whole, 15), kLayer, CheckpointDType::kBF16))
                  .ok());
  std::FILE* config = std::fopen(dir.file("config.json").c_str(), "wb");
  std::fputs("{\"model_type\": \"glm5_next\", \"rms_norm_eps\": 1e-06, \"name\": \"a \\\"quoted\\\" \\u00e9\"}", config);
  std::fclose(config);
  HostWeights w;
  CheckpointLoad info;
  ASSERT_TRUE(load({dir.path()}, whole, &w, &info).ok());
  EXPECT_EQ(w.eps, 1e-6f);
  EXPECT_EQ(info.eps_source, "config.json's rms_norm_eps");
}

TEST(Checkpoint, WeightsPathsSplitAtCommas) {
  EXPECT_EQ(split_weight_paths("a.safetensors"), (std::vector<std::string>{"a.safetensors"}));
  EXPECT_EQ(split_weight_paths("a,b,,c"), (std::vector<std::string>{"a", "b", "c"}));
}

// A whole glm5next layer (TP1 shapes) twice: BF16 in one file (~250 MB) and
// FP8 with block scales in two shards with an index (~130 MB). Each loads to
// the values written (the synthetic layer of seed 1, or its block
// dequantization) at TP1 and to their rank-0 slice at TP8, and says how fast.
// DSA_CHECKPOINT_OUT: the directory to leave them in, as bf16/ and fp8/ (the
// program tests' fixture); otherwise a temporary one.
TEST(Checkpoint, FullSizeGlm5nextLoadsAndReportsSpeed) {
  ModelPreset glm5next{};
  ASSERT_TRUE(find_preset("glm5next", &glm5next).ok());
  const StepShape whole = shape_at(glm5next, 1);
  const HostWeights w = make_weights(whole, 1);
  TempDir temp;
  const char* keep = std::getenv("DSA_CHECKPOINT_OUT");
  const std::string root = keep != nullptr && *keep != '\0' ? keep : temp.path();
  for (const CheckpointDType dtype : {CheckpointDType::kBF16, CheckpointDType::kFp8Block}) {
    const bool fp8 = dtype == CheckpointDType::kFp8Block;
    const std::string directory = root + (fp8 ? "/fp8" : "/bf16");
    fs::remove_all(directory);
    fs::create_directories(directory);
    HostWeights expected;
    {
      const std::vector<TensorToWrite> tensors = layer_tensors(whole, w, kLayer, dtype);
      if (fp8) {
        std::vector<TensorToWrite> shards[2];
        std::map<std::string, std::string> weight_map;
        for (const TensorToWrite& t : tensors) {
          const int shard = t.name.find(".indexer.") != std::string::npos ? 1 : 0;
          const std::string file = shard == 0 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
          weight_map[t.name] = file;
          shards[shard].push_back(t);
        }
        ASSERT_TRUE(write_safetensors(directory + "/model-00001-of-00002.safetensors", shards[0]).ok());
        ASSERT_TRUE(write_safetensors(directory + "/model-00002-of-00002.safetensors", shards[1]).ok());
        ASSERT_TRUE(write_safetensors_index(directory, weight_map).ok());
        expected = fp8_values(whole, w, tensors);
      } else {
        ASSERT_TRUE(write_safetensors(directory + "/model.safetensors", tensors).ok());
        expected = w;
      }
    }
    for (const int tp : {1, 8}) {
      HostWeights loaded;
      CheckpointLoad info;
      const Status status = load({directory}, shape_at(glm5next, tp), &loaded, &info);
      ASSERT_TRUE(status.ok()) << status.to_string();
      expect_same_weights(loaded, tp == 1 ? expected : rank0_slice(whole, expected, tp));
      std::printf("glm5next layer, %s, TP%d rank 0: %zu files, %.1f MB read in %.3f s: %.2f GB/s (a file just "
                  "written: from the page cache)\n",
                  fp8 ? "FP8 blocks" : "BF16", tp, info.files, info.bytes / 1e6, info.seconds, info.gb_per_s());
      RecordProperty(std::string("load_GBps_") + (fp8 ? "fp8" : "bf16") + "_tp" + std::to_string(tp),
                     std::to_string(info.gb_per_s()));
    }
  }
}


// A checkpoint of another indexer shape (16 heads, pools of 16) loads at that
// shape, bit for bit; loading it at the default shape names the indexer's
// three shaped tensors.
TEST(Checkpoint, IndexerShapeFollowsThePreset) {
  ModelPreset whole_preset{};
  ASSERT_TRUE(with_indexer_shape(tiny_preset(4), 16, 16, 1024, &whole_preset).ok());
  const StepShape whole = shape_at(whole_preset, 1);
  ASSERT_EQ(whole.index_heads, 16);
  ASSERT_EQ(whole.index_pool, 16);
  const HostWeights w = make_weights(whole, 16);
  EXPECT_EQ(w.index_wq_b.size(), size_t(16) * 128 * 192);
  EXPECT_EQ(w.index_weights_proj.size(), size_t(16) * 320);
  EXPECT_EQ(w.index_ape.size(), size_t(16) * 128);
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"), layer_tensors(whole, w, kLayer, CheckpointDType::kBF16)).ok());
  HostWeights loaded;
  const Status status = load({dir.path()}, whole, &loaded);
  ASSERT_TRUE(status.ok()) << status.to_string();
  expect_same_weights(loaded, w);
  const std::string error = load_error({dir.path()}, shape_at(tiny_preset(4), 1));
  for (const char* part : {"indexer.wq_b.weight", "[4096, 192]", "indexer.weights_proj.weight", "[32, 320]",
                           "indexer.index_kpool_compress_ape", "[4, 128]"}) {
    EXPECT_NE(error.find(part), std::string::npos) << part << " missing from: " << error;
  }
  EXPECT_EQ(error.find("indexer.wk.weight"), std::string::npos) << error;
}

// ---- config.json (dsa-decode --config) ----

constexpr const char* kGoodConfig = R"({
  "architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next",
  "hidden_size": 2048, "num_attention_heads": 32, "q_lora_rank": 1024, "kv_lora_rank": 512,
  "qk_nope_head_dim": 192, "qk_rope_head_dim": 0, "v_head_dim": 128, "rms_norm_eps": 1e-05,
  "index_n_heads": 16, "index_kpool": 16, "index_topk": 2048, "index_head_dim": 128,
  "index_kpool_always_select_tail": true, "rope_scaling": null
})";

TEST(ModelConfig, ReadsTheIndexerShapeAndTheSizesPresent) {
  ModelConfig c;
  const Status s = parse_model_config(kGoodConfig, "config.json", &c);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(c.index_n_heads, 16);
  EXPECT_EQ(c.index_kpool, 16);
  EXPECT_EQ(c.index_topk, 2048);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.q_lora_rank, 1024);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 192);
  EXPECT_EQ(c.qk_rope_head_dim, 0);
  EXPECT_EQ(c.v_head_dim, 128);

  ModelPreset glm5next{}, applied{};
  ASSERT_TRUE(find_preset("glm5next", &glm5next).ok());
  ASSERT_TRUE(apply_model_config(glm5next, c, &applied).ok());
  EXPECT_EQ(applied.index_heads, 16);
  EXPECT_EQ(applied.pool_size, 16);
  EXPECT_EQ(applied.topk, 2048);
  EXPECT_EQ(applied.topk_row_width, 2176);  // 2048 + 15, rounded up to 128
  EXPECT_EQ(applied.hidden, 2048);
  EXPECT_EQ(applied.heads, 32);
  EXPECT_EQ(applied.q_lora, 1024);
  EXPECT_EQ(applied.qk_nope, 192);
  EXPECT_EQ(applied.v_head, 128);
  EXPECT_FLOAT_EQ(applied.softmax_scale, 1.0f / std::sqrt(192.0f));

  // Only the indexer's fields: the preset keeps every size; a nested text_config is read too.
  ModelConfig indexer_only;
  ASSERT_TRUE(parse_model_config(
                  R"({"text_config": {"index_n_heads": 64, "index_kpool": 8, "index_topk": 1024, "index_head_dim": 128}})",
                  "nested.json", &indexer_only)
                  .ok());
  ASSERT_TRUE(apply_model_config(glm5next, indexer_only, &applied).ok());
  EXPECT_EQ(applied.index_heads, 64);
  EXPECT_EQ(applied.pool_size, 8);
  EXPECT_EQ(applied.topk, 1024);
  EXPECT_EQ(applied.topk_row_width, 1152);
  EXPECT_EQ(applied.hidden, glm5next.hidden);
  EXPECT_EQ(applied.heads, glm5next.heads);
  EXPECT_EQ(applied.softmax_scale, glm5next.softmax_scale);
}

TEST(ModelConfig, NamesEveryMissingMistypedAndUnsupportedFieldInOneError) {
  ModelConfig c;
  // Missing: all four of the indexer's.
  Status s = parse_model_config(R"({"hidden_size": 4096})", "a/config.json", &c);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "a/config.json: missing fields index_n_heads, index_kpool, index_topk, index_head_dim");
  // Mistyped and unsupported together, each with what it must be and what it is.
  s = parse_model_config(R"({"index_n_heads": "16", "index_kpool": 12, "index_topk": 2048.0, "index_head_dim": 64,
                             "hidden_size": 4100, "q_lora_rank": null, "kv_lora_rank": 256, "qk_rope_head_dim": 64,
                             "v_head_dim": true, "num_attention_heads": 0})",
                         "b.json", &c);
  ASSERT_FALSE(s.ok());
  for (const char* part : {"index_n_heads: expected an integer, got \"16\"", "index_kpool: expected 4, 8 or 16, got 12",
                           "index_topk: expected an integer, got 2048.0", "index_head_dim: expected 128, got 64",
                           "hidden_size: expected a positive multiple of 8, got 4100",
                           "q_lora_rank: expected an integer, got null", "kv_lora_rank: expected 512",
                           "qk_rope_head_dim: expected 0 (NoPE", "v_head_dim: expected an integer, got true",
                           "num_attention_heads: expected 1 to 1024 heads, got 0"}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " missing from: " << s.message();
  }
  EXPECT_EQ(s.message().find("missing"), std::string::npos) << s.message();
  // A top-k that is not a multiple of the pool, or past 512 pools; a missing field beside a bad one.
  s = parse_model_config(R"({"index_n_heads": 24, "index_kpool": 8, "index_topk": 2044})", "c.json", &c);
  ASSERT_FALSE(s.ok());
  for (const char* part : {"c.json: missing field index_head_dim; ", "index_n_heads: expected 16, 32 or 64, got 24",
                           "index_topk: expected a multiple of index_kpool = 8 from 8 to 4096, got 2044"}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " missing from: " << s.message();
  }
  s = parse_model_config(R"({"index_n_heads": 16, "index_kpool": 4, "index_topk": 4096, "index_head_dim": 128})",
                         "d.json", &c);
  EXPECT_NE(s.message().find("index_topk: expected a multiple of index_kpool = 4 from 4 to 2048, got 4096"),
            std::string::npos)
      << s.message();
  // Not JSON, not an object, not there.
  EXPECT_NE(parse_model_config("{\"index_n_heads\": ", "e.json", &c).message().find("e.json: bad JSON"),
            std::string::npos);
  EXPECT_NE(parse_model_config("[1, 2]", "f.json", &c).message().find("f.json: not a JSON object"), std::string::npos);
  EXPECT_NE(read_model_config("/no/such/dir/config.json", &c).message().find("cannot read it"), std::string::npos);
}

TEST(ModelConfig, ReadsAFileOrTheConfigJsonOfADirectory) {
  TempDir dir;
  {
    std::FILE* f = std::fopen(dir.file("config.json").c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(kGoodConfig, f);
    std::fclose(f);
  }
  for (const std::string& path : {dir.path(), dir.file("config.json")}) {
    ModelConfig c;
    const Status s = read_model_config(path, &c);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(c.index_n_heads, 16);
    EXPECT_EQ(c.path, dir.file("config.json"));
  }
}

TEST(ModelPresets, WithIndexerShapeReplacesTheShapeAndNamesItsFields) {
  ModelPreset glm5next{}, shaped{};
  ASSERT_TRUE(find_preset("glm5next", &glm5next).ok());
  // The default shape is glm5next's first configuration.
  EXPECT_EQ(glm5next.index_heads, kIndexerHeads);
  EXPECT_EQ(glm5next.pool_size, kIndexerPoolSize);
  EXPECT_EQ(glm5next.topk, kIndexerTopK);
  EXPECT_EQ(glm5next.topk_row_width, kIndexerRowWidth);
  EXPECT_EQ(glm5next.index_dim, kIndexerDim);
  ASSERT_TRUE(with_indexer_shape(glm5next, 16, 4, 512, &shaped).ok());
  EXPECT_EQ(shaped.index_heads, 16);
  EXPECT_EQ(shaped.pool_size, 4);
  EXPECT_EQ(shaped.topk, 512);
  EXPECT_EQ(shaped.topk_row_width, 640);
  EXPECT_EQ(shaped.hidden, glm5next.hidden);
  const auto rejected = [&](int heads, int pool, int topk, const char* name, const char* words) {
    ModelPreset out{};
    const Status s = with_indexer_shape(glm5next, heads, pool, topk, &out);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find(std::string("'") + name + "'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(words), std::string::npos) << s.message();
  };
  rejected(48, 4, 2048, "index_heads", "16, 32 or 64 index heads, got 48");
  rejected(32, 32, 2048, "pool_size", "4, 8 or 16 tokens per pool, got 32");
  rejected(32, 8, 2052, "topk", "a multiple of the pool size 8 from 8 to 4096");
  rejected(32, 4, 0, "topk", "got 0");
  ModelPreset dsv32{};
  ASSERT_TRUE(find_preset("dsv32", &dsv32).ok());
  const Status rope = with_indexer_shape(dsv32, 32, 4, 2048, &shaped);
  EXPECT_NE(rope.message().find("'preset'"), std::string::npos) << rope.message();
  EXPECT_NE(rope.message().find("dsv32 (pool_size 1)"), std::string::npos) << rope.message();
}

}  // namespace
}  // namespace dsa::cli
