// Raising a kernel's dynamic shared-memory limit above the 48 KiB default.
#pragma once

#include "dsa_decode/status.h"

namespace dsa {

// cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes) once per
// (kernel, device) for the life of the process: the attribute is per device,
// and setting it once up front keeps every later launch, inside a CUDA-graph
// capture or not, free of attribute changes. `name` goes into the error.
Status raise_shared_memory_limit(const void* kernel, int bytes, const char* name);

}  // namespace dsa
