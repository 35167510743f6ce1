#include "core/shared_memory.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <vector>

#include "dsa_decode/cuda_check.h"

namespace dsa {

Status raise_shared_memory_limit(const void* kernel, int bytes, const char* name) {
  struct Raised {
    const void* kernel;
    int device, bytes;
  };
  static std::mutex mutex;
  static std::vector<Raised> raised;
  int device = 0;
  DSA_CUDA_RETURN(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  for (const Raised& r : raised) {
    if (r.kernel == kernel && r.device == device && r.bytes >= bytes) return Status();
  }
  const std::string what = std::string("cudaFuncSetAttribute(") + name + ", max dynamic shared memory " +
                           std::to_string(bytes) + " bytes, device " + std::to_string(device) + ")";
  DSA_RETURN_IF_ERROR(
      cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what.c_str()));
  raised.push_back(Raised{kernel, device, bytes});
  return Status();
}

}  // namespace dsa
