// Function attributes a kernel needs before its first launch: a dynamic
// shared-memory limit above the 48 KiB default, and cluster sizes above the
// portable 8; and the device's answers about a kernel that cannot change
// while the process runs (occupancy), asked once.
#pragma once

#include <functional>

#include "dsa_decode/status.h"

namespace dsa {

// cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes) once per
// (kernel, device) for the life of the process: the attribute is per device,
// and setting it once up front keeps every later launch, inside a CUDA-graph
// capture or not, free of attribute changes. `name` goes into the error.
Status raise_shared_memory_limit(const void* kernel, int bytes, const char* name);

// cudaFuncSetAttribute(kernel, NonPortableClusterSizeAllowed, 1), once per
// (kernel, device) in the same way: clusters of up to 16 CTAs on Hopper.
Status allow_non_portable_clusters(const void* kernel, const char* name);

// cudaFuncSetAttribute(kernel, PreferredSharedMemoryCarveout, MaxShared),
// once per (kernel, device). An SM holds CTAs of one shared-memory/L1 split
// at a time, so kernels the driver gives different splits cannot share an
// SM: a GEMV with 3 KiB of shared memory then keeps the indexer's logits
// kernel (42 KiB) off every SM it runs on until its CTAs drain (H200 trace,
// dsa-decode --trace: the logits started 9 us after their inputs were
// ready). Every PDL launch asks for the largest split (launch.cuh).
Status prefer_max_shared_carveout(const void* kernel);

// An answer about `kernel` on the current device that cannot change while the
// process runs (an occupancy count): `ask` runs on the first call for
// (kernel, variant, device) and its answer is kept; `variant` tells apart the
// questions asked about one kernel (e.g. a cluster size). Host work only, so
// a first call may come inside a CUDA-graph capture.
Status kernel_answer_once(const void* kernel, int variant, const std::function<Status(int*)>& ask, int* answer);

}  // namespace dsa
