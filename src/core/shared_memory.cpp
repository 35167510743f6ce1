#include "core/shared_memory.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <vector>

#include "dsa_decode/cuda_check.h"

namespace dsa {
namespace {

// Sets `attribute` of `kernel` on the current device to `value` unless a
// value at least as large was set before (the attributes here only allow
// more as they grow, or are only ever set to one value).
Status set_attribute_once(const void* kernel, cudaFuncAttribute attribute, int value, const std::string& what) {
  struct Set {
    const void* kernel;
    int device;
    cudaFuncAttribute attribute;
    int value;
  };
  static std::mutex mutex;
  static std::vector<Set> done;
  int device = 0;
  DSA_CUDA_RETURN(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  for (const Set& s : done) {
    if (s.kernel == kernel && s.device == device && s.attribute == attribute && s.value >= value) return Status();
  }
  const std::string call = "cudaFuncSetAttribute(" + what + ", device " + std::to_string(device) + ")";
  DSA_RETURN_IF_ERROR(cuda_status(cudaFuncSetAttribute(kernel, attribute, value), call.c_str()));
  done.push_back(Set{kernel, device, attribute, value});
  return Status();
}

}  // namespace

Status raise_shared_memory_limit(const void* kernel, int bytes, const char* name) {
  return set_attribute_once(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes,
                            std::string(name) + ", max dynamic shared memory " + std::to_string(bytes) + " bytes");
}

Status allow_non_portable_clusters(const void* kernel, const char* name) {
  return set_attribute_once(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1,
                            std::string(name) + ", non-portable cluster sizes");
}

Status prefer_max_shared_carveout(const void* kernel) {
  return set_attribute_once(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared,
                            "a PDL kernel, preferred shared-memory carveout MaxShared");
}

Status kernel_answer_once(const void* kernel, int variant, const std::function<Status(int*)>& ask, int* answer) {
  struct Answer {
    const void* kernel;
    int variant, device, value;
  };
  static std::mutex mutex;
  static std::vector<Answer> answers;
  int device = 0;
  DSA_CUDA_RETURN(cudaGetDevice(&device));
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const Answer& a : answers) {
      if (a.kernel == kernel && a.variant == variant && a.device == device) {
        *answer = a.value;
        return Status();
      }
    }
  }
  DSA_RETURN_IF_ERROR(ask(answer));  // outside the lock: `ask` may call kernel_answer_once itself
  std::lock_guard<std::mutex> lock(mutex);
  answers.push_back(Answer{kernel, variant, device, *answer});
  return Status();
}

}  // namespace dsa
