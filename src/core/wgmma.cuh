// Hopper warpgroup MMA (wgmma, sm_90a) primitives: the 128-byte-swizzled
// K-major shared-memory layout, its descriptors (K-major, and N-major for a
// K-major tile read transposed), and the instructions the 64-head sparse_mla
// kernel (src/sparse_mla/sparse_mla_wgmma.cu) uses: FP16 Q.K^T with both
// operands in shared memory, FP16 P.V with P in registers and V N-major; plus
// the FP8 forms measured and set aside (docs/sparse_mla.md, "Why FP16 products").
// tests/wgmma_test.cu checks the layouts on the host and several instructions
// against a CPU product on the GPU (the sparse_mla tests cover the rest). Sources:
// PTX ISA 9.7.15.5 (wgmma.mma_async, its register fragments, shared-memory
// layouts and descriptor) and 9.7.15.7 (fence, commit, wait).
//
// All four warps of a warpgroup (128 consecutive threads, the first a
// multiple of 128) execute every function here together.
#pragma once

#include <cstdint>

namespace dsa::wgmma {

// K-major 128B-swizzle layout: each row of the operand (an M row of A or an N
// row of B) holds 128 bytes of K (128 FP8 or 64 FP16 values); 8 rows form a
// 1024-byte atom, atoms follow each other (1024-byte aligned), and inside an
// atom 16-byte chunk c of row r is stored at chunk c ^ (r % 8). Byte offset of
// chunk `chunk` (0..7) of row `row` from the tile's start:
__host__ __device__ constexpr uint32_t k_major_sw128_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row % 8)) * 16));
}

// Descriptor of a K-major 128B-swizzle operand whose K slice starts `address`
// (a shared-memory address: the tile's 1024-byte aligned start plus 32 bytes
// per FP8 k32 or FP16 k16 step inside the 128-byte rows). Fields: start
// address >> 4 (bits 0-13), leading byte offset (16-29; unused by swizzled
// K-major layouts, 1 by convention), stride byte offset 1024 >> 4 (32-45: the
// next 8-row atom), base offset 0 (49-51: atoms are 1024-byte aligned),
// swizzle mode 1 = 128B (62-63).
__host__ __device__ constexpr uint64_t k_major_sw128_descriptor(uint32_t address) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// Descriptor of an N-major (for A: M-major) 128B-swizzle FP16 operand, used
// "transposed" (imm-trans = 1): one row of 128 bytes per k holds 64 values
// along N (16-byte chunk c of row k at chunk c ^ (k % 8), as above), 8 rows
// per 1024-byte atom, the next 8 k one atom further (stride byte offset
// 1024), and the next 64 values along N `n_group_bytes` further (leading byte
// offset). So the bytes of a K-major tile [rows][64 dims] read as an N-major
// operand [k = rows][n = dims]: one layout serves Q.K^T and P.V. The k16 step
// s starts 16 rows (2048 bytes) in.
__host__ __device__ constexpr uint64_t n_major_sw128_descriptor(uint32_t address, uint32_t n_group_bytes) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t((n_group_bytes & 0x3FFFF) >> 4) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Orders this thread's generic-proxy writes to shared memory (st.shared,
// cp.async) before later wgmma reads of them (the async proxy).
__device__ __forceinline__ void fence_shared_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Before the first wgmma, and between register writes of accumulators or A
// fragments and a wgmma that reads them.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit_group() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most kPending committed groups are in flight; their
// accumulators may be read after it.
template <int kPending>
__device__ __forceinline__ void wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Pins accumulator registers at this point of the program. The mma asm
// statements name the accumulators, the fence / commit / wait ones do not,
// so without it the compiler could move a read or write of an accumulator
// across the wait that completes the wgmma writing it. Used right before a
// batch is issued and right after the wait that completes it.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Accumulator element i of thread t (0..127) of an m64nN f32 result: row
// 16 (t / 32) + (t % 32) / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (t % 4) + i % 2.
__host__ __device__ constexpr int accumulator_row(int thread, int i) {
  return 16 * (thread / 32) + (thread % 32) / 4 + 8 * ((i / 2) % 2);
}
__host__ __device__ constexpr int accumulator_column(int thread, int i) { return 8 * (i / 4) + 2 * (thread % 4) + i % 2; }

// D[64 x 8] = A[64 x 32] B[32 x 8] (+ D when `accumulate`): e4m3 operands,
// both K-major in shared memory (descriptors above), f32 accumulators.
__device__ __forceinline__ void mma_m64n8k32_e4m3(float (&d)[4], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
}

// D[64 x 64] = A[64 x 32] B[32 x 64] (+ D when `accumulate`), as above with N = 64.
__device__ __forceinline__ void mma_m64n64k32_e4m3(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
}

// D[64 x 8] = A[64 x 16] B[16 x 8] (+ D when `accumulate`): FP16 A from
// registers (warp w supplies rows 16w..16w+15 in mma.m16n8k16's A layout:
// a[0] rows g, columns 2c, 2c+1; a[1] rows g+8; a[2] columns 2c+8, 2c+9; a[3]
// both, with g = lane / 4, c = lane % 4), FP16 B K-major in shared memory,
// f32 accumulators.
__device__ __forceinline__ void mma_m64n8k16_f16_a_in_registers(float (&d)[4], const uint32_t (&a)[4], uint64_t b,
                                                               bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
}

// D[64 x 64] = A[64 x 16] B[16 x 64] (+ D when `accumulate`): FP16 operands,
// both K-major in shared memory, f32 accumulators.
__device__ __forceinline__ void mma_m64n64k16_f16(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
}

// D[64 x 256] = A[64 x 16] B[16 x 256] (+ D when `accumulate`): FP16 A K-major
// in shared memory, FP16 B N-major in shared memory (n_major_sw128_descriptor),
// f32 accumulators.
__device__ __forceinline__ void mma_m64n256k16_f16_b_n_major(float (&d)[128], uint64_t a, uint64_t b,
                                                             bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
}

// D[64 x 256] = A[64 x 16] B[16 x 256] (+ D when `accumulate`): FP16 A from
// registers (the layout of mma_m64n8k16_f16_a_in_registers), FP16 B N-major
// ("transposed") in shared memory (n_major_sw128_descriptor), f32 accumulators.
__device__ __forceinline__ void mma_m64n256k16_f16_a_in_registers_b_n_major(float (&d)[128], const uint32_t (&a)[4],
                                                                            uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
}

}  // namespace dsa::wgmma
