// The GPU path of dsa-decode: the fused and the stock chain of one decode
// step on the synthetic layer, their checks against each other and against
// the CPU reference, and their timings.
#pragma once

#include <string>

#include "gpu_probe.h"
#include "options.h"
#include "synthetic_layer.h"

namespace dsa::cli {

// Whether device 0 can run the sm_90a kernels, and if not why (gpu_probe.h).
GpuAvailability probe_gpu();

// Runs, checks, times and prints; returns the process exit code (1 when a
// check fails or a CUDA/cuBLAS call does).
int run_gpu_path(const StepShape& shape, const Options& options);

}  // namespace dsa::cli
