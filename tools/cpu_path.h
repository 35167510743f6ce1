// The CPU path of dsa-decode: the reference chain of the stage's step at the
// preset (hidden states in, o_proj's output out), for machines without the
// GPU (or with --cpu). It shows what the GPU path computes and checks
// against; it times nothing of the GPU's.
#pragma once

#include <string>

#include "options.h"
#include "synthetic_layer.h"

namespace dsa::cli {

// Runs and prints the chain on the synthetic layer of options.seed, checks
// its products against float64 within the numerics contract's bounds
// (cpu_checks.h), prints PASS or FAIL and writes --json; returns the process
// exit code (1 when a check fails). `why_cpu`: "--cpu", or why no GPU was used.
int run_cpu_path(const StepShape& shape, const Options& options, const std::string& why_cpu);

// The same for a RoPE preset (shape.R > 0: dsv32, glm5): the chain of
// tools/rope_chain.h, with options.chain_break's link broken if set.
int run_cpu_path_rope(const StepShape& shape, const Options& options, const std::string& why_cpu);

}  // namespace dsa::cli
