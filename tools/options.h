// dsa-decode's command line: the options, their defaults and their parsing.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace dsa::cli {

struct Options {
  std::string preset = "glm5next";
  int tp = 1;
  int tokens = 4;                // m, decode tokens of the step
  int64_t context = 32768;       // tokens already in the KV cache
  int steps = 200;               // graph replays per timing
  uint64_t seed = 1;             // of the synthetic layer
  std::string json_path;         // empty: no JSON report
  bool force_cpu = false;
  bool help = false;
};

// The largest context: its KV cache (512 bytes a token at glm5next) is held
// twice on the GPU (fused and stock path) and three times on the host (checks).
inline constexpr int64_t kMaxContext = int64_t{1} << 20;
inline constexpr int kMaxSteps = 10000;
inline constexpr int kMaxTp = 1024;  // the preset's head count must also divide by it

void print_usage(FILE* to);

// Fills `options` from argv ("--name VALUE" or "--name=VALUE"). On a bad
// command line returns false and a message naming the option, what was given
// and what is expected.
bool parse_options(int argc, char** argv, Options* options, std::string* error);

}  // namespace dsa::cli
