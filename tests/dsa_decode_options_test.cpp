// dsa-decode's command line (tools/options.h): --value-up-tokens's parsing,
// its errors, the measured default and the choice it makes per step;
// --projections, --indexer-projections, --indexer-logits and --head-gemv-sums;
// which options the CPU path names as GPU-only; the no-GPU message's words
// (tools/gpu_probe.h); the RoPE presets' GPU run as the report --json and
// --report write (tools/report.h's rope_run_report, where the build links
// the reports: DSA_TEST_REPORTS).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <utility>

#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dsa_decode/stage.h"
#include "stage/stage_steps.h"
#include "tools/gpu_probe.h"
#include "tools/html_report.h"
#include "tools/options.h"
#include "tools/report.h"

#include <fstream>
#include <sstream>

namespace dsa::cli {
namespace {

// parse_options over "dsa-decode" followed by `arguments`.
bool parse(std::initializer_list<std::string> arguments, Options* options, std::string* error) {
  std::vector<std::string> storage = {"dsa-decode"};
  storage.insert(storage.end(), arguments);
  std::vector<char*> argv;
  for (std::string& argument : storage) argv.push_back(argument.data());
  return parse_options(static_cast<int>(argv.size()), argv.data(), options, error);
}

// The set a valid --value-up-tokens value parses to (nullopt: auto).
std::optional<std::set<int>> parsed_tokens(const std::string& value) {
  Options options;
  std::string error;
  EXPECT_TRUE(parse({"--value-up-tokens", value}, &options, &error)) << value << ": " << error;
  return options.value_up_tokens;
}

// The error a bad --value-up-tokens value gives.
std::string rejection(const std::string& value) {
  Options options;
  std::string error;
  EXPECT_FALSE(parse({"--value-up-tokens=" + value}, &options, &error)) << value;
  return error;
}

TEST(DsaDecodeOptions, ValueUpTokensDefaultsToAuto) {
  Options options;
  std::string error;
  ASSERT_TRUE(parse({"--tokens", "8"}, &options, &error)) << error;
  EXPECT_FALSE(options.value_up_tokens.has_value());
  EXPECT_FALSE(parsed_tokens("auto").has_value());
}

TEST(DsaDecodeOptions, ValueUpTokensParsesListsAndNone) {
  EXPECT_EQ(parsed_tokens("1,2"), std::set<int>({1, 2}));
  EXPECT_EQ(parsed_tokens("16,4,1"), std::set<int>({1, 4, 16}));
  EXPECT_EQ(parsed_tokens("7"), std::set<int>({7}));
  EXPECT_EQ(parsed_tokens("none"), std::set<int>());
  Options options;
  std::string error;
  ASSERT_TRUE(parse({"--value-up-tokens=3,5"}, &options, &error)) << error;
  EXPECT_EQ(options.value_up_tokens, std::set<int>({3, 5}));
}

TEST(DsaDecodeOptions, ValueUpTokensErrorsNameTheOptionAndTheBadItem) {
  const std::string expected = "--value-up-tokens: got '";
  const std::string syntax = "expected a comma-separated list of token counts from 1 to 16 (e.g. 1,2), none or auto";
  for (const std::string value : {"0", "17", "1,,2", "1,2,", "", "x", "1;2", "-1", "2.0", "AUTO"}) {
    const std::string error = rejection(value);
    EXPECT_EQ(error.rfind(expected + value + "', " + syntax, 0), 0u) << error;
  }
  EXPECT_NE(rejection("1,17").find("('17' is not a token count from 1 to 16)"), std::string::npos);
  EXPECT_NE(rejection("1,,2").find("('' is not a token count"), std::string::npos);
  EXPECT_NE(rejection("2,4,2").find("(2 is listed twice)"), std::string::npos);
  Options options;
  std::string error;
  EXPECT_FALSE(parse({"--value-up-tokens"}, &options, &error));
  EXPECT_EQ(error, "--value-up-tokens: missing value, " + syntax);
}

// The stage's measured sets: where head_gemv beat cuBLAS's bmm (docs/head_gemv.md).
TEST(DsaDecodeOptions, MeasuredValueUpTokens) {
  EXPECT_EQ(dsa_stage_measured_value_up_tokens(64, HeadGemvSums::kSeedOrder), std::set<int>({1, 2}));
  EXPECT_EQ(dsa_stage_measured_value_up_tokens(8, HeadGemvSums::kSeedOrder), std::set<int>({1, 2, 3, 4}));
  EXPECT_EQ(dsa_stage_measured_value_up_tokens(16, HeadGemvSums::kSeedOrder), std::set<int>({1, 2}));
}

TEST(DsaDecodeOptions, ChooseValueUpFollowsTheSet) {
  Options automatic;  // tensor-core sums, the default
  const ValueUpChoice tc_m16 = choose_value_up(automatic, 64, 16);
  EXPECT_EQ(tc_m16.kernel, ValueUpKernel::kCublasBmm);
  EXPECT_EQ(tc_m16.reason,
            "m=16 not in --value-up-tokens 1,2,3,4,5,6,7,8 (auto: tensor-cores sums, measured at 64 heads)");
  EXPECT_EQ(choose_value_up(automatic, 64, 8).kernel, ValueUpKernel::kHeadGemv);
  EXPECT_EQ(choose_value_up(automatic, 8, 16).kernel, ValueUpKernel::kHeadGemv);
  Options seed;
  seed.head_gemv_sums = HeadGemvSums::kSeedOrder;
  EXPECT_EQ(choose_value_up(seed, 64, 2).kernel, ValueUpKernel::kHeadGemv);
  const ValueUpChoice tp1_m4 = choose_value_up(seed, 64, 4);
  EXPECT_EQ(tp1_m4.kernel, ValueUpKernel::kCublasBmm);
  EXPECT_EQ(tp1_m4.reason, "m=4 not in --value-up-tokens 1,2 (auto: seed-order sums, measured at 64 heads)");
  EXPECT_EQ(choose_value_up(seed, 8, 4).kernel, ValueUpKernel::kHeadGemv);
  EXPECT_EQ(choose_value_up(seed, 8, 8).kernel, ValueUpKernel::kCublasBmm);
  EXPECT_EQ(choose_value_up(seed, 32, 1).reason,
            "m=1 in --value-up-tokens 1,2 (auto: seed-order sums, not measured at 32 heads)");

  Options listed;
  listed.value_up_tokens = std::set<int>{4, 16};
  const ValueUpChoice m16 = choose_value_up(listed, 64, 16);
  EXPECT_EQ(m16.kernel, ValueUpKernel::kHeadGemv);
  EXPECT_EQ(m16.reason, "m=16 in --value-up-tokens 4,16");
  EXPECT_EQ(choose_value_up(listed, 64, 1).kernel, ValueUpKernel::kCublasBmm);
  listed.value_up_tokens = std::set<int>{1};
  EXPECT_EQ(choose_value_up(listed, 8, 2).kernel, ValueUpKernel::kCublasBmm) << "a given list wins over auto";
  Options none;
  none.value_up_tokens = std::set<int>();
  EXPECT_EQ(choose_value_up(none, 8, 1).reason, "m=1 not in --value-up-tokens none");
  Options invariant;
  invariant.batch_invariant = true;
  invariant.value_up_tokens = std::set<int>();
  EXPECT_EQ(choose_value_up(invariant, 64, 16).kernel, ValueUpKernel::kHeadGemv) << "--batch-invariant wins";
  EXPECT_EQ(token_list({}), "none");
  EXPECT_EQ(token_list({2, 1, 8}), "1,2,8");
}

// A choice option: unset means the first (default) value, each name sets its
// value, anything else is refused with the names listed.
template <class E, size_t N>
void expect_choices(const std::string& option, const Choice<E> (&choices)[N], E Options::*field,
                    const std::vector<std::string>& bad_values) {
  Options options;
  std::string error;
  ASSERT_TRUE(parse({"--tokens", "2"}, &options, &error)) << error;
  EXPECT_TRUE(options.*field == choices[0].value) << option << ": the default is the first choice";
  for (const Choice<E>& c : choices) {
    ASSERT_TRUE(parse({option, c.name}, &options, &error)) << error;
    EXPECT_TRUE(options.*field == c.value) << option << " " << c.name;
    ASSERT_TRUE(parse({option + "=" + c.name}, &options, &error)) << error;
  }
  for (const std::string& value : bad_values) {
    EXPECT_FALSE(parse({option + "=" + value}, &options, &error)) << value;
    EXPECT_EQ(error, option + ": got '" + value + "', expected " + choice_list(choices));
  }
}


// --projections maps to the stage plan's projection_gemv_tokens: auto leaves
// it unset (the stage's measured set), gemv lists every count linear_gemv
// takes, cublaslt none.
TEST(DsaDecodeOptions, ProjectionsDefaultsToAutoAndMapsToTheStagesTokenCounts) {
  Options options;
  std::string error;
  ASSERT_TRUE(parse({"--tokens", "2"}, &options, &error)) << error;
  EXPECT_EQ(options.projections, "auto");
  EXPECT_FALSE(projection_gemv_tokens(options).has_value());
  ASSERT_TRUE(parse({"--projections", "gemv"}, &options, &error)) << error;
  EXPECT_EQ(projection_gemv_tokens(options), std::set<int>({1, 2, 3, 4, 5, 6, 7, 8}));
  ASSERT_TRUE(parse({"--projections=cublaslt"}, &options, &error)) << error;
  EXPECT_EQ(projection_gemv_tokens(options), std::set<int>());
  ASSERT_TRUE(parse({"--projections", "auto"}, &options, &error)) << error;
  EXPECT_FALSE(projection_gemv_tokens(options).has_value());
  for (const std::string value : {"", "GEMV", "cublas", "none", "1,2", "gemv,cublaslt"}) {
    EXPECT_FALSE(parse({"--projections=" + value}, &options, &error)) << value;
    EXPECT_EQ(error, "--projections: got '" + value + "', expected auto, gemv or cublaslt");
  }
  EXPECT_FALSE(parse({"--projections"}, &options, &error));
  EXPECT_EQ(error, "--projections: missing value, expected auto, gemv or cublaslt");
}

TEST(DsaDecodeOptions, IndexerLogitsDefaultsToFp32AccumulationAndTakesOnlyItsValues) {
  expect_choices("--indexer-logits", kIndexerLogitsChoices, &Options::indexer_logits,
                 {"", "fp8", "FP32-accumulation", "exact,fp32-accumulation"});
}

TEST(DsaDecodeOptions, AttentionPlanDefaultsToAutoAndTakesOnlyItsValues) {
  expect_choices("--attention-plan", kSparseMlaPlanChoices, &Options::attention_plan,
                 {"", "8", "Auto", "latency", "by-batch", "whole-row", "auto,batch-invariant"});
}

TEST(DsaDecodeOptions, HeadGemvSumsDefaultsToTensorCoresAndTakesOnlyItsValues) {
  expect_choices("--head-gemv-sums", kHeadGemvSumsChoices, &Options::head_gemv_sums,
                 {"", "tc", "Tensor-Cores", "seed-order,tensor-cores"});
}

TEST(DsaDecodeOptions, BatchInvariantIsAFlagAndOptionsGivenAreRecorded) {
  Options options;
  std::string error;
  ASSERT_TRUE(parse({"--tokens", "2"}, &options, &error)) << error;
  EXPECT_FALSE(options.batch_invariant);
  EXPECT_EQ(options.given, std::set<std::string>({"--tokens"}));
  ASSERT_TRUE(parse({"--batch-invariant", "--steps=3"}, &options, &error)) << error;
  EXPECT_TRUE(options.batch_invariant);
  EXPECT_EQ(options.given.count("--steps"), 1u);
  EXPECT_FALSE(parse({"--batch-invariant=1"}, &options, &error));
  EXPECT_EQ(error, "--batch-invariant: takes no value, got '1'");
}

TEST(DsaDecodeOptions, IndexerProjectionsDefaultsToTheGemvAndTakesOnlyItsTwoKernels) {
  Options options;
  std::string error;
  ASSERT_TRUE(parse({"--tokens", "2"}, &options, &error)) << error;
  EXPECT_FALSE(options.indexer_projections_cublaslt);
  ASSERT_TRUE(parse({"--indexer-projections", "cublaslt"}, &options, &error)) << error;
  EXPECT_TRUE(options.indexer_projections_cublaslt);
  ASSERT_TRUE(parse({"--indexer-projections=gemv"}, &options, &error)) << error;
  EXPECT_FALSE(options.indexer_projections_cublaslt);
  for (const std::string value : {"", "GEMV", "cublas", "gemv,cublaslt"}) {
    EXPECT_FALSE(parse({"--indexer-projections=" + value}, &options, &error)) << value;
    EXPECT_EQ(error, "--indexer-projections: got '" + value + "', expected gemv or cublaslt");
  }
}

TEST(DsaDecodeOptions, TheCpuPathNamesTheGpuOnlyOptionsGivenAndNoOthers) {
  Options options;
  std::string error;
  ASSERT_TRUE(parse({"--tokens", "2", "--context", "100", "--seed", "3", "--json", "out.json", "--cpu"}, &options,
                    &error))
      << error;
  EXPECT_TRUE(gpu_only_options_given(options).empty());
  Options gpu_only;
  ASSERT_TRUE(parse({"--trace", "--steps", "3", "--indexer-projections", "cublaslt", "--json=x.json",
                     "--value-up-tokens", "1,2", "--projections", "gemv", "--head-gemv-sums", "seed-order",
                     "--indexer-logits", "exact", "--attention-plan", "auto", "--batch-invariant"},
                    &gpu_only, &error))
      << error;
  EXPECT_EQ(gpu_only_options_given(gpu_only),
            std::vector<std::string>({"--indexer-logits", "--head-gemv-sums", "--projections", "--attention-plan",
                                      "--batch-invariant", "--steps", "--indexer-projections", "--value-up-tokens",
                                      "--trace"}));
}

TEST(DsaDecodeOptions, ReportTakesAnHtmlFileAndTurnsTheTraceOn) {
  Options options;
  std::string error;
  ASSERT_TRUE(parse({"--report", "run.html"}, &options, &error)) << error;
  EXPECT_EQ(options.report_path, "run.html");
  EXPECT_TRUE(options.trace);
  EXPECT_EQ(gpu_only_options_given(options), std::vector<std::string>({"--report"}));
  Options bad;
  EXPECT_FALSE(parse({"--report", "run.svg"}, &bad, &error));
  EXPECT_EQ(error, "--report: got 'run.svg', expected a file name ending in .html");
  EXPECT_FALSE(parse({"--report"}, &bad, &error));
  EXPECT_EQ(error, "--report: missing value, expected a file name ending in .html");
}

TEST(DsaDecodeGpuProbe, NoDriverSaysNoGpuOrDriverWasFoundNotUpgradeTheDriver) {
  // cudaGetDeviceCount's cudaErrorInsufficientDriver with no driver loaded
  // (cudaDriverGetVersion gives 0): the usual machine without a GPU.
  const GpuProblem problem = device_count_problem(false, 0, 13000);
  EXPECT_EQ(problem, GpuProblem::kNoDriver);
  GpuAvailability gpu{problem, gpu_problem_summary(problem),
                      "cudaGetDeviceCount: CUDA driver version is insufficient for CUDA runtime version"};
  EXPECT_EQ(gpu.text(),
            "no NVIDIA GPU or driver was found (cudaGetDeviceCount: CUDA driver version is insufficient for CUDA "
            "runtime version)");
}

TEST(DsaDecodeGpuProbe, AnOldDriverNoDeviceAndOtherErrorsSayWhatTheyAre) {
  EXPECT_EQ(device_count_problem(false, 12040, 13000), GpuProblem::kOldDriver);
  EXPECT_EQ(gpu_problem_summary(GpuProblem::kOldDriver, 12040, 13000),
            "the NVIDIA driver (CUDA 12.4) is older than the CUDA runtime dsa-decode was built with (13.0); update "
            "the driver to run the GPU path");
  EXPECT_EQ(device_count_problem(true, 13000, 13000), GpuProblem::kNoDevice);
  EXPECT_EQ(gpu_problem_summary(GpuProblem::kNoDevice), "an NVIDIA driver but no NVIDIA GPU was found");
  EXPECT_EQ(device_count_problem(false, 13000, 13000), GpuProblem::kOther);
  EXPECT_EQ(gpu_problem_summary(GpuProblem::kNotSm90), "no sm_90 GPU (H100/H200) was found");
  EXPECT_EQ(gpu_problem_summary(GpuProblem::kNone), "");
}

TEST(DsaDecodeOptions, WeightsAndLayer) {
  Options options;
  std::string error;
  ASSERT_TRUE(parse({"--weights", "/ckpt", "--layer", "3"}, &options, &error)) << error;
  EXPECT_EQ(options.weights, "/ckpt");
  EXPECT_EQ(options.layer, 3);
  Options defaults;
  ASSERT_TRUE(parse({}, &defaults, &error)) << error;
  EXPECT_TRUE(defaults.weights.empty());
  EXPECT_EQ(defaults.layer, 0);
  Options files;
  ASSERT_TRUE(parse({"--weights=a.safetensors,b.safetensors"}, &files, &error)) << error;
  EXPECT_EQ(files.weights, "a.safetensors,b.safetensors");
}

TEST(DsaDecodeOptions, WeightsAndLayerRejections) {
  Options options;
  std::string error;
  EXPECT_FALSE(parse({"--layer", "2"}, &options, &error));
  EXPECT_EQ(error, "--layer: names a layer of the checkpoint of --weights, and no --weights was given");
  Options negative;
  EXPECT_FALSE(parse({"--weights", "/ckpt", "--layer", "-1"}, &negative, &error));
  EXPECT_EQ(error, "--layer: got '-1', expected an integer from 0 to 9999");
  Options empty;
  EXPECT_FALSE(parse({"--weights="}, &empty, &error));
  EXPECT_EQ(error, "--weights: got '', expected a checkpoint directory or .safetensors files separated by commas");
  Options missing;
  EXPECT_FALSE(parse({"--weights"}, &missing, &error));
  EXPECT_EQ(error, "--weights: missing value, expected a checkpoint directory or .safetensors files separated by commas");
}


// --index-heads, --index-pool, --index-topk and --config: parsed values, and
// the model resolve_model makes of the preset, the config and the options.
TEST(DsaDecodeOptions, IndexerShapeOptionsParseAndNameTheirValues) {
  Options options;
  std::string error;
  ASSERT_TRUE(parse({"--index-heads", "16", "--index-pool=16", "--index-topk", "1024"}, &options, &error)) << error;
  EXPECT_EQ(options.index_heads, 16);
  EXPECT_EQ(options.index_pool, 16);
  EXPECT_EQ(options.index_topk, 1024);
  Options defaults;
  ASSERT_TRUE(parse({}, &defaults, &error));
  EXPECT_FALSE(defaults.index_heads || defaults.index_pool || defaults.index_topk);
  EXPECT_TRUE(defaults.config_path.empty());
  for (const auto& [arguments, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--index-heads", "24"}, "--index-heads: got '24', expected 16, 32 or 64"},
           {{"--index-heads", "x"}, "--index-heads: got 'x', expected 16, 32 or 64"},
           {{"--index-pool", "2"}, "--index-pool: got '2', expected 4, 8 or 16"},
           {{"--index-topk", "0"}, "--index-topk: got '0', expected a multiple of the pool size"},
           {{"--index-topk", "9000"}, "--index-topk: got '9000', expected a multiple of the pool size from the pool "
                                      "size to 8192"},
           {{"--config"}, "--config: missing value, expected a config.json file or a directory holding one"},
           {{"--config="}, "--config: got '', expected a config.json file"}}) {
    Options o;
    std::string e;
    std::vector<std::string> storage = {"dsa-decode"};
    storage.insert(storage.end(), arguments.begin(), arguments.end());
    std::vector<char*> argv;
    for (std::string& a : storage) argv.push_back(a.data());
    EXPECT_FALSE(parse_options(int(argv.size()), argv.data(), &o, &e)) << arguments[0];
    EXPECT_NE(e.find(message), std::string::npos) << e;
  }
}

// A config.json in a fresh temporary file, removed with the object.
class ConfigFile {
 public:
  explicit ConfigFile(const std::string& text) {
    char pattern[] = "/tmp/dsa_config_XXXXXX";
    const int fd = ::mkstemp(pattern);
    path_ = fd >= 0 ? pattern : "";
    if (fd >= 0) {
      EXPECT_EQ(::write(fd, text.data(), text.size()), ssize_t(text.size()));
      ::close(fd);
    }
  }
  ~ConfigFile() {
    if (!path_.empty()) std::remove(path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(DsaDecodeOptions, ResolveModelTakesThePresetThenTheConfigThenTheOptions) {
  ModelPreset whole{};
  std::string source, error;
  Options options;
  ASSERT_TRUE(resolve_model(options, &whole, &source, &error)) << error;
  EXPECT_EQ(source, "preset glm5next");
  EXPECT_EQ(whole.index_heads, 32);
  EXPECT_EQ(whole.pool_size, 4);
  EXPECT_EQ(whole.topk, 2048);
  EXPECT_EQ(whole.topk_row_width, 2176);

  const ConfigFile config(R"({"index_n_heads": 16, "index_kpool": 16, "index_topk": 2048, "index_head_dim": 128,
                              "num_attention_heads": 32, "hidden_size": 2048})");
  ASSERT_FALSE(config.path().empty());
  options.config_path = config.path();
  ASSERT_TRUE(resolve_model(options, &whole, &source, &error)) << error;
  EXPECT_EQ(source, "preset glm5next, config.json " + config.path());
  EXPECT_EQ(whole.index_heads, 16);
  EXPECT_EQ(whole.pool_size, 16);
  EXPECT_EQ(whole.heads, 32);
  EXPECT_EQ(whole.hidden, 2048);
  EXPECT_EQ(whole.q_lora, 1536);  // absent from the config: the preset's

  // Explicit options override the config.
  options.index_heads = 64;
  options.index_pool = 8;
  ASSERT_TRUE(resolve_model(options, &whole, &source, &error)) << error;
  EXPECT_EQ(source, "preset glm5next, config.json " + config.path() + ", --index-heads, --index-pool");
  EXPECT_EQ(whole.index_heads, 64);
  EXPECT_EQ(whole.pool_size, 8);
  EXPECT_EQ(whole.topk, 2048);  // the config's
  EXPECT_EQ(whole.topk_row_width, 2176);
  options.index_topk = 1004;  // not a multiple of 8
  EXPECT_FALSE(resolve_model(options, &whole, &source, &error));
  EXPECT_EQ(error, "--index-topk: top-k 1004 (--index-topk) and pool size 8 (--index-pool): expected a top-k that "
                   "is a multiple of the pool size from 8 to 4096");
  // A pool the preset's top-k does not fit is named by the option that changed it.
  Options pool_only;
  pool_only.index_pool = 16;
  pool_only.index_topk = 8192;
  ASSERT_TRUE(resolve_model(pool_only, &whole, &source, &error)) << error;
  EXPECT_EQ(whole.topk_row_width, 8192 + 128);
  Options too_many_pools;
  too_many_pools.index_topk = 4096;  // 1024 pools of the preset's 4
  EXPECT_FALSE(resolve_model(too_many_pools, &whole, &source, &error));
  EXPECT_NE(error.find("--index-topk: top-k 4096 (--index-topk) and pool size 4 (preset glm5next)"), std::string::npos)
      << error;

  // A bad config: every field named, under --config.
  const ConfigFile bad(R"({"index_n_heads": 16, "index_kpool": 3, "index_head_dim": 256})");
  Options with_bad;
  with_bad.config_path = bad.path();
  EXPECT_FALSE(resolve_model(with_bad, &whole, &source, &error));
  EXPECT_EQ(error.rfind("--config: " + bad.path() + ": missing field index_topk; ", 0), 0u) << error;
  EXPECT_NE(error.find("index_kpool: expected 4, 8 or 16, got 3"), std::string::npos) << error;
  EXPECT_NE(error.find("index_head_dim: expected 128, got 256"), std::string::npos) << error;
  Options absent;
  absent.config_path = "/no/such/config.json";
  EXPECT_FALSE(resolve_model(absent, &whole, &source, &error));
  EXPECT_NE(error.find("--config: /no/such/config.json: cannot read it"), std::string::npos) << error;
  // The RoPE presets have no pooled indexer to shape.
  Options rope;
  rope.preset = "dsv32";
  rope.index_pool = 8;
  EXPECT_FALSE(resolve_model(rope, &whole, &source, &error));
  EXPECT_NE(error.find("--index-pool: preset 'dsv32' has no pooled indexer"), std::string::npos) << error;
  rope.preset = "nope";
  EXPECT_FALSE(resolve_model(rope, &whole, &source, &error));
  EXPECT_NE(error.find("--preset: got 'nope'"), std::string::npos) << error;
}

// The RoPE presets run on the GPU kernel by kernel (without the stage): the
// GPU path takes them with the shape, seed, --steps and the kernels' choices
// it has, and refuses, naming them and pointing at --cpu, the options only
// the stage's path or the CPU chain takes. The NoPE preset takes any.
TEST(DsaDecodeOptions, TheGpuPathRunsTheRopePresetsAndNamesWhatItDoesNotTake) {
  const auto parsed = [](std::vector<std::string> args) {
    args.insert(args.begin(), "dsa-decode");
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    Options options;
    std::string error;
    EXPECT_TRUE(parse_options(int(argv.size()), argv.data(), &options, &error)) << error;
    return options;
  };
  for (const char* name : {"dsv32", "glm5"}) {
    ModelPreset preset{};
    ASSERT_TRUE(find_preset(name, &preset).ok());
    EXPECT_EQ(gpu_path_refusal(parsed({"--preset", name, "--tp", "8", "--tokens", "2", "--context", "4096"}), preset),
              "");
    EXPECT_EQ(gpu_path_refusal(parsed({"--preset", name, "--steps", "5", "--indexer-logits", "exact",
                                       "--head-gemv-sums", "seed-order", "--projections", "gemv",
                                       "--indexer-projections", "gemv", "--seed", "3"}),
                               preset),
              "");
    // The reports: the chain's and the stage's checks and timings (rope_run_report).
    EXPECT_EQ(gpu_path_refusal(parsed({"--preset", name, "--json", "out.json", "--report", "run.html"}), preset), "");
    const std::string refusal =
        gpu_path_refusal(parsed({"--preset", name, "--json", "out.json", "--trace", "--indexer-projections", "cublaslt",
                                 "--projections", "cublaslt"}),
                         preset);
    EXPECT_NE(refusal.find(std::string("--trace, --projections cublaslt, --indexer-projections cublaslt: "
                                       "preset '") + name + "' uses RoPE (64 rope dims per head); its GPU path runs "
                                       "the step kernel by kernel"),
              std::string::npos)
        << refusal;
    EXPECT_EQ(refusal.find("--json"), std::string::npos) << refusal;
    EXPECT_NE(refusal.find("does not take these; drop them, or add --cpu for its CPU reference chain"),
              std::string::npos)
        << refusal;
    const std::string one = gpu_path_refusal(parsed({"--preset", name, "--break", "cache-scale"}), preset);
    EXPECT_NE(one.find("--break: preset '"), std::string::npos) << one;
    EXPECT_NE(one.find("does not take this; drop it, or add --cpu"), std::string::npos) << one;
  }
  ModelPreset nope{};
  ASSERT_TRUE(find_preset("glm5next", &nope).ok());
  EXPECT_EQ(gpu_path_refusal(parsed({"--json", "out.json", "--trace", "--projections", "cublaslt"}), nope), "");
}

// --break takes the chain's link names (default none) and applies to the
// RoPE presets only.
TEST(DsaDecodeOptions, BreakNamesALinkOfTheRopeChain) {
  Options defaults;
  EXPECT_EQ(defaults.chain_break, RopeChainBreak::kNone);
  for (const auto& [name, link] : std::vector<std::pair<std::string, RopeChainBreak>>{
           {"none", RopeChainBreak::kNone},
           {"attention-rope-style", RopeChainBreak::kAttentionRopeStyle},
           {"indexer-rope-style", RopeChainBreak::kIndexerRopeStyle},
           {"cache-scale", RopeChainBreak::kCacheScale}}) {
    Options options;
    std::string error;
    ASSERT_TRUE(parse({"--break", name}, &options, &error)) << name << ": " << error;
    EXPECT_EQ(options.chain_break, link) << name;
    EXPECT_EQ(rope_chain_break_name(link), name);
  }
  Options options;
  std::string error;
  EXPECT_FALSE(parse({"--break", "rope"}, &options, &error));
  EXPECT_EQ(error, "--break: got 'rope', expected none, attention-rope-style, indexer-rope-style or cache-scale");
  ASSERT_TRUE(parse({"--break=cache-scale"}, &options, &error)) << error;
  ModelPreset dsv32{}, glm5next{};
  ASSERT_TRUE(find_preset("dsv32", &dsv32).ok());
  ASSERT_TRUE(find_preset("glm5next", &glm5next).ok());
  EXPECT_EQ(chain_break_refusal(options, dsv32), "");
  EXPECT_EQ(chain_break_refusal(options, glm5next),
            "--break: breaks a link of the RoPE presets' CPU chain (dsv32, glm5); preset 'glm5next' has no RoPE");
  EXPECT_EQ(chain_break_refusal(Options(), glm5next), "");
}

#if DSA_TEST_REPORTS

// Every RoPE step list the stage can issue (stage_steps: either path, GEMV or
// cuBLASLt projections, value-up on head_gemv or cuBLAS, the indexer or the
// caller's rows), as a RoPE GPU run's timings: each step, then the two
// halves and the two whole stages.
std::vector<StageStepTime> rope_times(int m, bool gemv, bool caller_rows) {
  StepChoices c;
  c.rope = true;
  c.hidden = 7168;
  c.q_lora = 1536;
  c.heads_v = 16 * 128;
  for (int t = 1; t <= 16; ++t) c.value_up_tokens.insert(gemv ? t : 100);
  for (int t = 1; t <= 8; ++t) c.projection_gemv_tokens.insert(gemv ? t : 100);
  std::vector<StageStepTime> times;
  for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
    const StepList list = stage_steps(path, c, m, caller_rows);
    const std::string name = path == DsaPath::kFused ? "fused" : "stock";
    for (int i = 0; i < list.count; ++i) times.push_back({name, step_name(list.steps[i], false), 1.0 + i});
    times.push_back({name, "attention half (norm .. value_up)", 40.0});
    times.push_back({name, "whole stage (qkv_a_proj .. o_proj)", name == "fused" ? 60.0 : 90.0});
  }
  return times;
}

StepShape dsv32_tp8(int m) {
  ModelPreset preset{}, rank{};
  EXPECT_TRUE(find_preset("dsv32", &preset).ok());
  EXPECT_TRUE(per_rank(preset, 8, &rank).ok());
  return make_step_shape(rank, m, 4096);
}

const Timing* timing(const RunReport& r, const std::string& name) {
  for (const Timing& t : r.timings) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// The RoPE GPU run's report: every step the stage issues has its row (named
// as the NoPE rows where the kernel is the same), the halves and whole
// stages carry the sums of their steps' floor bytes, the fused rows stand
// against the stock ones they replace, and the GPU chain's row is there.
TEST(DsaDecodeReports, TheRopeRunReportNamesEveryStepTheStageIssues) {
  const StepShape s = dsv32_tp8(2);
  Options options;
  const std::vector<Check> checks = {judged("a chain check", true, "fine"), judged("stage fused: a check", false, "x")};
  for (const bool gemv : {true, false}) {
    for (const bool caller_rows : {false, true}) {
      const std::vector<StageStepTime> times = rope_times(2, gemv, caller_rows);
      RunReport r;
      ASSERT_TRUE(rope_run_report(s, options, "NVIDIA H100 80GB HBM3", 3000, 3, checks, times, 70.5, &r).ok());
      ASSERT_EQ(r.timings.size(), times.size() + 1);
      for (const Timing& t : r.timings) {
        EXPECT_GT(t.bytes, 0) << t.name;
        EXPECT_FALSE(t.label.empty()) << t.name;
      }
      const Timing *whole = timing(r, "whole_stage"), *stock_whole = timing(r, "stock_whole_stage");
      const Timing *half = timing(r, "chain"), *chain = timing(r, "gpu_chain");
      ASSERT_TRUE(whole != nullptr && stock_whole != nullptr && half != nullptr && chain != nullptr);
      EXPECT_EQ(&r.timings[whole->baseline], stock_whole);
      EXPECT_EQ(&r.timings[half->baseline], timing(r, "stock_chain"));
      EXPECT_EQ(chain->us, 70.5);
      EXPECT_LT(half->bytes, whole->bytes);
      // The floor of the whole stage: every weight once (dsv32 TP8: 73.3 MB, the indexer's projections 27.9 MB
      // more) and, per token, its rows' entries and keys (2048 x 656 and 4097 x 132 bytes: 1.9 MB).
      const double weights = 73.27e6 + (caller_rows ? 0 : 27.92e6);
      EXPECT_GT(whole->bytes, weights) << caller_rows;
      EXPECT_LT(whole->bytes, weights + 2 * 2e6 + 1e6) << caller_rows;
      const Timing* value_up = timing(r, gemv ? "value_up" : "value_up_bmm");
      ASSERT_NE(value_up, nullptr);
      EXPECT_EQ(r.value_up_kernel, gemv ? "head_gemv" : "cuBLAS bmm");
      if (gemv) {
        EXPECT_EQ(&r.timings[timing(r, "q_b_proj_gemv")->baseline], timing(r, "stock_q_b_proj"));
        EXPECT_EQ(&r.timings[timing(r, "o_proj_gemv")->baseline], timing(r, "stock_o_proj"));
        EXPECT_EQ(&r.timings[value_up->baseline], timing(r, "stock_value_up_bmm"));
      }
      EXPECT_NE(timing(r, "rope_absorb"), nullptr);
      EXPECT_NE(timing(r, "stock_cache_write_v32"), nullptr);
      EXPECT_NE(timing(r, caller_rows ? "indexer_remap" : "indexer_select"), nullptr);
      EXPECT_EQ(r.checks.size(), 2u);
      EXPECT_TRUE(r.trace_problem.empty());
      ASSERT_EQ(r.fused_projection_kernels.size(), 3u);
      EXPECT_EQ(r.fused_projection_kernels[1].second, gemv ? "GEMV" : "cuBLASLt");
    }
  }
  // --report turns the trace on; this path takes none, and says so in the report.
  options.trace = true;
  RunReport traced;
  ASSERT_TRUE(rope_run_report(s, options, "gpu", 3000, 1, {}, rope_times(2, true, false), 0, &traced).ok());
  EXPECT_NE(traced.trace_problem.find("takes no trace"), std::string::npos);
  EXPECT_EQ(timing(traced, "gpu_chain"), nullptr);  // no chain time given
}

TEST(DsaDecodeReports, AStepTheReportDoesNotKnowIsNamed) {
  std::vector<StageStepTime> times = rope_times(1, true, false);
  times.insert(times.begin() + 2, {"fused", "a new kernel", 3.0});
  RunReport r;
  const Status st = rope_run_report(dsv32_tp8(1), Options(), "gpu", 3000, 1, {}, times, 10, &r);
  EXPECT_EQ(st.code(), ErrorCode::kUnsupported);
  EXPECT_NE(st.message().find("'a new kernel' (fused path)"), std::string::npos) << st.message();
  times = rope_times(1, true, false);
  times[0].path = "both";
  EXPECT_NE(rope_run_report(dsv32_tp8(1), Options(), "gpu", 3000, 1, {}, times, 10, &r).message().find("'both'"),
            std::string::npos);
}

std::string read_file(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// --json and --report of a RoPE run: the RoPE fields, the rows with their
// floors and baselines, the checks; the paths recorded as written.
TEST(DsaDecodeReports, TheRopeRunsReportsAreWrittenAndRecorded) {
  const StepShape s = dsv32_tp8(2);
  const std::string dir = testing::TempDir();
  Options options;
  options.json_path = dir + "/dsa_decode_rope_run.json";
  options.report_path = dir + "/dsa_decode_rope_run.html";
  RunReport r;
  ASSERT_TRUE(rope_run_report(s, options, "NVIDIA H100 80GB HBM3", 3000, 3,
                              {judged("stage fused: rope_absorb", true, "bit for bit")}, rope_times(2, true, false), 70.5,
                              &r)
                  .ok());
  EXPECT_FALSE(report_written(options.json_path));
  ASSERT_TRUE(write_run_reports(r, options).ok());
  EXPECT_TRUE(report_written(options.json_path) && report_written(options.report_path));
  const std::string json = read_file(options.json_path);
  for (const char* part : {"\"preset\": \"dsv32\", \"tp\": 8", "\"params\": {\"H\": 16, \"m\": 2, \"context\": 4096}",
                           "\"rope\": {\"dims\": 64, \"kv_cache\": \"fp8_ds_mla\", \"entry_bytes\": 656}",
                           "\"indexer\": {\"heads\": 64, \"pool\": 1, \"topk\": 2048",
                           "{\"name\": \"whole_stage\", \"label\": \"stage qkv_a_proj .. o_proj\"",
                           "\"baseline\": \"stock stage qkv_a_proj .. o_proj\", \"baseline_us\": 90, \"speedup\": 1.5",
                           "{\"name\": \"rope_absorb\"", "{\"name\": \"gpu_chain\"",
                           "\"name\": \"stage fused: rope_absorb\", \"result\": \"PASS\"",
                           "the RoPE layer's step (dsv32"}) {
    EXPECT_NE(json.find(part), std::string::npos) << part << "\n" << json;
  }
  const std::string html = read_file(options.report_path);
  EXPECT_NE(html.find("RoPE: 64 rotated dims a head, the 656-byte FP8 cache"), std::string::npos);
  EXPECT_NE(html.find("rope_absorb (absorb + q_pe and k_pe RoPE, one launch)"), std::string::npos);
  EXPECT_EQ(html, html_report(r));
  std::remove(options.json_path.c_str());
  std::remove(options.report_path.c_str());
  Options unwritable;
  unwritable.json_path = "/nonexistent-dir/run.json";
  EXPECT_NE(write_run_reports(r, unwritable).message().find("--json"), std::string::npos);
  EXPECT_FALSE(report_written(unwritable.json_path));
}

#endif  // DSA_TEST_REPORTS

}  // namespace
}  // namespace dsa::cli
