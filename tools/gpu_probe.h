// Why dsa-decode runs the CPU path on this machine, in words a user can act
// on: what was (not) found first, the CUDA runtime's own reason after it.
// No CUDA here, so that the command-line tests can check the words.
#pragma once

#include <string>

namespace dsa::cli {

enum class GpuProblem {
  kNone,       // device 0 runs the sm_90a kernels
  kNoDriver,   // no NVIDIA driver answered (no GPU, or a machine or container without one)
  kOldDriver,  // a driver older than the CUDA runtime dsa-decode was built with
  kNoDevice,   // a driver, but no GPU
  kNotSm90,    // a GPU the kernels are not built for
  kOther,      // another CUDA error
};

// What cudaGetDeviceCount's failure means: `driver_version` is
// cudaDriverGetVersion's (0: no driver loaded), `runtime_version` the
// runtime's, `no_device` whether the error was cudaErrorNoDevice.
inline GpuProblem device_count_problem(bool no_device, int driver_version, int runtime_version) {
  if (no_device) return GpuProblem::kNoDevice;
  if (driver_version <= 0) return GpuProblem::kNoDriver;
  if (driver_version < runtime_version) return GpuProblem::kOldDriver;
  return GpuProblem::kOther;
}

// "12.8" of CUDA's 12080.
inline std::string cuda_version_text(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

// The line's headline; `raw` (the runtime's words) goes in parentheses after it.
inline std::string gpu_problem_summary(GpuProblem problem, int driver_version = 0, int runtime_version = 0) {
  switch (problem) {
    case GpuProblem::kNone:
      return "";
    case GpuProblem::kNoDriver:
      return "no NVIDIA GPU or driver was found";
    case GpuProblem::kOldDriver:
      return "the NVIDIA driver (CUDA " + cuda_version_text(driver_version) +
             ") is older than the CUDA runtime dsa-decode was built with (" + cuda_version_text(runtime_version) +
             "); update the driver to run the GPU path";
    case GpuProblem::kNoDevice:
      return "an NVIDIA driver but no NVIDIA GPU was found";
    case GpuProblem::kNotSm90:
      return "no sm_90 GPU (H100/H200) was found";
    case GpuProblem::kOther:
      return "the NVIDIA GPU could not be used";
  }
  return "";
}

struct GpuAvailability {
  GpuProblem problem = GpuProblem::kNone;
  std::string summary;  // gpu_problem_summary's words; empty when usable
  std::string raw;      // the CUDA call and its error string, e.g. "cudaGetDeviceCount: ..."
  std::string text() const { return summary + " (" + raw + ")"; }
};

}  // namespace dsa::cli
