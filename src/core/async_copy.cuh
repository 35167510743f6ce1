// Shared-memory addresses, the async-copy (LDGSTS) primitives the kernels
// that stage global data in shared memory use (head_gemv's weight slabs and
// sparse_mla's gathered cache rows), the streaming load of data read once,
// and an L2 load of data read for the last time.
#pragma once

#include <cstdint>

namespace dsa {

// Shared-memory address of a generic pointer, for the async-copy, ldmatrix and
// mbarrier instructions.
__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes from global to shared memory, bypassing L1 (the data is read once).
__device__ __forceinline__ void async_copy_16(uint32_t shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared), "l"(global) : "memory");
}

// The same, except that with `valid` false nothing is read and the 16 bytes are zero.
__device__ __forceinline__ void async_copy_16_or_zero(uint32_t shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared), "l"(global), "r"(valid ? 16 : 0)
               : "memory");
}

// 16 bytes to shared memory at a shared-memory address.
__device__ __forceinline__ void store_shared(uint32_t address, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// 16 bytes from shared memory at a shared-memory address (ordered after the
// barrier that published them: the memory clobber).
__device__ __forceinline__ uint4 load_shared_v4(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address)
               : "memory");
  return v;
}

// 4 bytes to shared memory at a shared-memory address.
__device__ __forceinline__ void store_shared_b32(uint32_t address, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(address), "r"(v));
}

// 16 bytes from global memory into registers, read once: not kept in L1
// (which a large shared-memory carve-out leaves small).
__device__ __forceinline__ uint4 load_streaming(const void* global) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(global));
  return v;
}

// 16 bytes read through L2 (ld.global.cg) for the last time: the line may go
// first (evict_first), so that dead data does not push out live data.
__device__ __forceinline__ uint4 load_l2_last_use(const uint4* global) {
  uint4 v;
  asm volatile(
      "{\n.reg .b64 policy;\n"
      "createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
      "ld.global.cg.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], policy;\n}"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(global)
      : "memory");
  return v;
}

__device__ __forceinline__ void async_copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most `pending` (0..7; more counts as 7) of this thread's
// committed groups are in flight. A compile-time `pending` folds the switch.
__device__ __forceinline__ void async_copy_wait(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
}

}  // namespace dsa
