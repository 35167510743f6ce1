// dsa-bench: runs the benchmarks registered with DSA_BENCH (bench/*.cu and
// src/<family>/*_bench.cu), prints each one's table and writes its JSON
// report (DESIGN.md section 4) under the output directory.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <set>
#include <string>
#include <vector>

#include "dsa_decode/cuda_check.h"
#include "harness.h"

namespace {

using dsa::bench::RegisteredBench;

constexpr int kExitOk = 0;
constexpr int kExitBenchFailed = 1;
constexpr int kExitUsage = 2;

struct Options {
  std::vector<std::string> benches;  // empty: all
  std::string out_dir = "bench/results";
  bool quick = false;
  bool list = false;
  bool help = false;
};

void print_usage(FILE* to) {
  std::fprintf(to,
               "usage: dsa-bench [--bench NAME[,NAME..]|all] [--out DIR] [--quick] [--list] [--help]\n"
               "  --bench  benchmarks to run, in name order whatever the order given (default: all)\n"
               "  --out    directory for the JSON reports (default: bench/results)\n"
               "  --quick  fewer graph replays: a smoke run, not numbers to quote\n"
               "  --list   print the registered benchmark names and exit\n"
               "  env DSA_COMMIT names the commit in the reports (default: unknown)\n");
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    parts.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return parts;
    start = comma + 1;
  }
}

// Accepts "--name VALUE" and "--name=VALUE"; false with a message otherwise.
bool parse_options(int argc, char** argv, Options* options, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (const size_t equals = arg.find('='); arg.rfind("--", 0) == 0 && equals != std::string::npos) {
      value = arg.substr(equals + 1);
      arg = arg.substr(0, equals);
      has_value = true;
    }
    const bool takes_value = arg == "--bench" || arg == "--out";
    if (takes_value && !has_value) {
      if (i + 1 >= argc) {
        *error = arg + " needs a value";
        return false;
      }
      value = argv[++i];
    } else if (!takes_value && has_value) {
      *error = arg + " takes no value";
      return false;
    }

    if (arg == "--bench") {
      for (const std::string& name : split_commas(value)) {
        if (name.empty()) {
          *error = "empty benchmark name in --bench '" + value + "'";
          return false;
        }
        options->benches.push_back(name);
      }
    } else if (arg == "--out") {
      if (value.empty()) {
        *error = "--out needs a directory";
        return false;
      }
      options->out_dir = value;
    } else if (arg == "--quick") {
      options->quick = true;
    } else if (arg == "--list") {
      options->list = true;
    } else if (arg == "--help" || arg == "-h") {
      options->help = true;
    } else {
      *error = "unknown option '" + arg + "'";
      return false;
    }
  }
  return true;
}

// The registered benches the options name, in name order; false with a
// message for a name nobody registered or a name registered twice.
bool select_benches(const Options& options, std::vector<RegisteredBench>* selected, std::string* error) {
  const std::vector<RegisteredBench> registered = dsa::bench::registered_benches();
  std::string known;
  for (size_t i = 0; i < registered.size(); ++i) {
    if (i > 0 && registered[i].name == registered[i - 1].name) {
      *error = "benchmark '" + registered[i].name + "' is registered twice";
      return false;
    }
    known += (known.empty() ? "" : ", ") + registered[i].name;
  }
  std::set<std::string> wanted;
  bool all = options.benches.empty();
  for (const std::string& name : options.benches) {
    if (name == "all") {
      all = true;
      continue;
    }
    bool found = false;
    for (const RegisteredBench& bench : registered) found = found || bench.name == name;
    if (!found) {
      *error = "unknown benchmark '" + name + "' (registered: " + (known.empty() ? "none" : known) + ")";
      return false;
    }
    wanted.insert(name);
  }
  for (const RegisteredBench& bench : registered) {
    if (all || wanted.count(bench.name) > 0) selected->push_back(bench);
  }
  return true;
}

// Why device 0 cannot run the sm_90a kernels; empty when it can.
std::string unusable_device_reason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return std::string("cudaGetDeviceCount: ") + cudaGetErrorString(error);
  }
  if (count == 0) return "cudaGetDeviceCount: 0 devices";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cudaGetDeviceProperties(0) failed";
  if (prop.major != 9 || prop.minor != 0) {
    return std::string("device 0 (") + prop.name + ") is sm_" + std::to_string(prop.major * 10 + prop.minor) +
           "; the kernels are built for sm_90a only";
  }
  return "";
}

// A stream of its own (graph capture cannot use the legacy default stream), then the context.
dsa::Status open_main_context(bool quick, dsa::bench::Context* ctx) {
  cudaStream_t stream = nullptr;
  DSA_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return dsa::bench::open_context(stream, quick, ctx);
}

// The bench, then a synchronization, so that its asynchronous faults are
// reported as its own rather than the next bench's.
dsa::Status run_checked(const RegisteredBench& bench, dsa::bench::Context& ctx, dsa::bench::Report& report) {
  DSA_RETURN_IF_ERROR(bench.fn(ctx, report));
  DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
  DSA_CUDA_RETURN(cudaGetLastError());
  return dsa::Status();
}

// Runs one bench; its table is printed even when it fails part way, its
// JSON is written only when it succeeds (the newest file per bench is taken
// as the current numbers).
bool run_bench(const RegisteredBench& bench, dsa::bench::Context& ctx, const std::string& out_dir) {
  std::printf("-- %s\n", bench.name.c_str());
  std::fflush(stdout);
  dsa::bench::Report report(bench.name);
  const dsa::Status ran = run_checked(bench, ctx, report);
  if (!report.rows().empty()) report.print(ctx);
  const dsa::Status status = ran.ok() ? report.write_json(ctx, out_dir) : ran;
  if (!status.ok()) {
    std::fprintf(stderr, "dsa-bench: %s failed: %s\n", bench.name.c_str(), status.to_string().c_str());
    return false;
  }
  std::printf("wrote %s\n", report.json_path(ctx, out_dir).c_str());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  std::string error;
  if (!parse_options(argc, argv, &options, &error)) {
    std::fprintf(stderr, "dsa-bench: %s\n", error.c_str());
    print_usage(stderr);
    return kExitUsage;
  }
  if (options.help) {
    print_usage(stdout);
    return kExitOk;
  }
  std::vector<RegisteredBench> selected;
  if (!select_benches(options, &selected, &error)) {
    std::fprintf(stderr, "dsa-bench: %s\n", error.c_str());
    return kExitUsage;
  }
  if (options.list) {
    for (const RegisteredBench& bench : dsa::bench::registered_benches()) std::printf("%s\n", bench.name.c_str());
    return kExitOk;
  }

  // Like the GPU tests, a machine without the target GPU is not an error.
  if (const std::string reason = unusable_device_reason(); !reason.empty()) {
    std::printf("no CUDA GPU: %s\n", reason.c_str());
    return kExitOk;
  }

  dsa::bench::Context ctx;
  if (const dsa::Status status = open_main_context(options.quick, &ctx); !status.ok()) {
    std::fprintf(stderr, "dsa-bench: device setup failed: %s\n", status.to_string().c_str());
    return kExitBenchFailed;
  }
  std::printf("dsa-bench on %s (%d SMs, L2 %.0f MB), commit %s, %s, copy %.0f GB/s%s\n", ctx.gpu_name.c_str(),
              ctx.sm_count, ctx.l2_bytes / 1e6, ctx.commit.c_str(), ctx.date.c_str(), ctx.copy_GBps,
              ctx.quick ? " [quick]" : "");

  std::vector<std::string> failed;
  for (const RegisteredBench& bench : selected) {
    if (!run_bench(bench, ctx, options.out_dir)) failed.push_back(bench.name);
  }
  cudaStreamDestroy(ctx.stream);

  if (!failed.empty()) {
    std::string names;
    for (const std::string& name : failed) names += (names.empty() ? "" : ", ") + name;
    std::fprintf(stderr, "dsa-bench: %zu of %zu benchmarks failed: %s\n", failed.size(), selected.size(),
                 names.c_str());
    return kExitBenchFailed;
  }
  return kExitOk;
}
