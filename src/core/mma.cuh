// Warp-level tensor-core primitives (mma.sync m16n8k16, ldmatrix) shared by
// the kernels that use them with 16-bit operands: sparse_mla's 8-head kernel
// (FP16) and head_gemv's tensor-core sums (BF16). Source: PTX ISA 9.7.14
// (mma.sync fragments for .m16n8k16, ldmatrix).
//
// Fragments of d += A [16 x 16] B [16 x 8], lane (g, c) = (lane / 4, lane % 4):
//   a[0] = A[g][2c, 2c + 1]       a[1] = A[g + 8][2c, 2c + 1]
//   a[2] = A[g][2c + 8, 2c + 9]   a[3] = A[g + 8][2c + 8, 2c + 9]
//   b0   = B[2c, 2c + 1][g]       b1   = B[2c + 8, 2c + 9][g]
//   d    = D[g][2c], D[g][2c + 1], D[g + 8][2c], D[g + 8][2c + 1]
// (two 16-bit values per register, the lower k in the lower half).
#pragma once

#include <cstdint>

namespace dsa {

// Four 8x8 16-bit matrices from shared memory: lane l gives the address of
// row l % 8 of matrix l / 8 (16 bytes) and receives register i of matrix i
// as rows g, columns 2c, 2c + 1.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// The same, transposed: register i of matrix i holds rows 2c, 2c + 1 of
// column g (the A fragment of a matrix stored column by column).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// Two 8x8 matrices (lanes 0..15 give the row addresses).
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
}

// d += a * b, FP16 inputs, FP32 accumulators.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a * b, BF16 inputs, FP32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace dsa
