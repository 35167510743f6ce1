#include "core/l2_prefetch.h"

#include <cstdint>

#include "dsa_decode/cuda_check.h"

namespace dsa {
namespace {

constexpr uint32_t kPieceBytes = 64 * 1024;
constexpr int kThreads = 128;

// Thread i prefetches piece i of [begin, begin + bytes): bytes a multiple of
// 16, begin 16-byte aligned, as cp.async.bulk requires.
__global__ void l2_prefetch_kernel(const char* begin, uint64_t bytes) {
  const uint64_t piece = uint64_t(blockIdx.x) * kThreads + threadIdx.x;
  const uint64_t offset = piece * kPieceBytes;
  if (offset >= bytes) return;
  const uint32_t size = static_cast<uint32_t>(bytes - offset < kPieceBytes ? bytes - offset : kPieceBytes);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(begin + offset), "r"(size) : "memory");
}

}  // namespace

Status l2_prefetch(const void* data, size_t bytes, cudaStream_t stream) {
  const uintptr_t first = (reinterpret_cast<uintptr_t>(data) + 15) / 16 * 16;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / 16 * 16;
  if (data == nullptr || end <= first) return Status();
  const uint64_t span = end - first;
  const uint64_t pieces = (span + kPieceBytes - 1) / kPieceBytes;
  const unsigned ctas = static_cast<unsigned>((pieces + kThreads - 1) / kThreads);
  l2_prefetch_kernel<<<ctas, kThreads, 0, stream>>>(reinterpret_cast<const char*>(first), span);
  return cuda_status(cudaGetLastError(), "l2_prefetch_kernel");
}

}  // namespace dsa
