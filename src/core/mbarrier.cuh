// Shared-memory mbarriers (PTX ISA 9.7.13.15) for handovers between
// warpgroups of one CTA: init, arrive (release) and a parity wait (acquire).
// Phase k of a barrier is waited for with parity k % 2, so a waiter must
// never fall two phases behind (src/sparse_mla/sparse_mla_handover_check.h
// checks protocols for that). Named barriers (bar.sync / bar.arrive)
// measured within 1.5% in sparse_mla_wgmma, but two warpgroups reach them
// from different instructions, which compute-sanitizer's synccheck reports
// as divergence (bar.sync is the aligned form), and racecheck did not
// follow bar.arrive.
#pragma once

#include <cstdint>

namespace dsa {

__device__ __forceinline__ void mbarrier_init(uint32_t barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t barrier) {  // release
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint32_t barrier, int phase) {  // acquire; phase i % 2 == parity
  asm volatile(
      "{\n.reg .pred complete;\nretry:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 complete, [%0], %1;\n"
      "@!complete bra retry;\n}\n" ::"r"(barrier),
      "r"(phase % 2)
      : "memory");
}

}  // namespace dsa
