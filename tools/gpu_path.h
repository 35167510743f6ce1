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
// A RoPE preset's shape (shape.rope()) runs run_gpu_path_rope.
int run_gpu_path(const StepShape& shape, const Options& options);

// The RoPE presets' step on the GPU kernel by kernel through the library's
// public functions, without the stage (tools/gpu_path_rope.cpp): each product
// checked against the CPU chain's reference of its kernel (tools/rope_chain.h)
// on the GPU's inputs, the whole chain timed by CUDA-graph replay; prints PASS
// or FAIL and returns the exit code. Takes the options gpu_path_refusal allows.
int run_gpu_path_rope(const StepShape& shape, const Options& options);

}  // namespace dsa::cli
