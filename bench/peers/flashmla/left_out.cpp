// The kernels FlashMLA's sparse-decode interface can dispatch to that this
// build leaves out: the SM100 ones (never taken on an SM90 GPU) and the SM90
// V32 (d_qk = 576) ones (the benchmark runs the MODEL1 format, d_qk = 512, the
// shape of dsa-decode's glm5next). Each is an explicit specialization of
// FlashMLA's declared template that raises instead of running, so that the
// module links without compiling their sources. A separate translation unit:
// binding.cpp instantiates the declarations these specialize.
#include <torch/extension.h>

#include "params.h"
#include "sm100/decode/head64/kernel.h"
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"

namespace {
[[noreturn]] void left_out(const char* what) {
  TORCH_CHECK(false, "FlashMLA: ", what, " is not built by bench/peers (SM90 MODEL1 sparse decode only)");
}
}  // namespace

namespace sm90::decode::sparse_fp8 {
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 64>(const SparseAttnDecodeParams&) {
  left_out("the SM90 V32 (d_qk 576) kernel, 64 heads");
}
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 128>(const SparseAttnDecodeParams&) {
  left_out("the SM90 V32 (d_qk 576) kernel, 128 heads");
}
}  // namespace sm90::decode::sparse_fp8

namespace sm100::decode::head64 {
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32>(const SparseAttnDecodeParams&) {
  left_out("the SM100 head64 V32 kernel");
}
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(const SparseAttnDecodeParams&) {
  left_out("the SM100 head64 MODEL1 kernel");
}
}  // namespace sm100::decode::head64

namespace sm100::fwd_for_small_topk::head128 {
template <>
void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV, 512>(
    const SparseFwdArgT<SparseAttnFwdMode::DecodeWithSplitKV>&) {
  left_out("the SM100 head128 decode kernel");
}
}  // namespace sm100::fwd_for_small_topk::head128
