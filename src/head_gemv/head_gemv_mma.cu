// head_gemv's tensor-core kernel (HeadGemvSums::kTensorCores) with its own
// tail, the fused KV-cache write: the instance head_gemv() launches. The
// kernel template is in head_gemv_mma.cuh; contract and bound:
// include/dsa_decode/head_gemv.h; design: docs/head_gemv.md.
#include <cstdint>

#include "head_gemv/head_gemv_kernels.h"
#include "head_gemv/head_gemv_mma.cuh"

namespace dsa {

using head_gemv_mma_detail::kMaxRows;
using head_gemv_mma_detail::kRowsPerWarp;

int head_gemv_mma_tile(int heads, int rows, int cols, int m) {
  // Warps the H200 needed in flight (bench rows "* (tensor cores)_tile" of
  // bench/results/head_gemv.json, after the four-column epilogue): 256 up to m = 8, 512 at m = 16, where more tokens mean more
  // MMAs and epilogue per warp. Tile 128 was within 0.3 us of 64 either way
  // at H = 64 and slower at H = 8, so 64 stays the widest the rule picks.
  const int64_t enough_warps = m <= 8 ? 256 : 512;
  for (int tile : {64, 32}) {
    if (cols % tile == 0 && int64_t(heads) * (cols / tile) * (rows / kRowsPerWarp) >= enough_warps) return tile;
  }
  return 16;
}

bool head_gemv_mma_supports(int rows, int cols) {
  return rows >= kRowsPerWarp && rows <= kMaxRows && rows % kRowsPerWarp == 0 && cols % 16 == 0;
}

Status launch_head_gemv_mma(const HeadGemvParams& p, int cache_ctas, cudaStream_t stream) {
  return launch_head_gemv_mma_with_tail<head_gemv_mma_detail::CacheWriteTail>(p, {}, cache_ctas, stream);
}

}  // namespace dsa
