// A hint to the L2: bring a byte range of device memory in, so that a later
// kernel's reads of it hit in L2 instead of going to memory. Nothing is
// written and nothing waits for it; a kernel that reads the bytes before the
// prefetch lands, or after the L2 evicted them, reads memory as usual. The
// stage issues it for the weights its last steps read (W_UV, then o_proj)
// while the attention, a chain of dependent gathers, leaves memory idle.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "dsa_decode/status.h"

namespace dsa {

// Prefetches [data, data + bytes) rounded inward to 16-byte boundaries
// (cp.async.bulk.prefetch.L2, one 64 KiB piece per thread). No PDL: it runs
// after the work before it on `stream`. bytes 0: no launch.
Status l2_prefetch(const void* data, size_t bytes, cudaStream_t stream);

}  // namespace dsa
