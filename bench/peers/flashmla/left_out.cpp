// The kernels FlashMLA's sparse-decode interface can dispatch to that this
// build leaves out: the SM100 ones (never taken on an SM90 GPU). Each is an
// explicit specialization of FlashMLA's declared template that raises instead
// of running, so that the module links without compiling their sources. The
// SM90 MODEL1 (d_qk 512) and V32 (d_qk 576) kernels are compiled from
// FlashMLA's own instantiation files (bench/peers/peers.py). A separate
// translation unit: binding.cpp instantiates the declarations these specialize.
#include <torch/extension.h>

#include "params.h"
#include "sm100/decode/head64/kernel.h"
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"

namespace {
[[noreturn]] void left_out(const char* what) {
  TORCH_CHECK(false, "FlashMLA: ", what, " is not built by bench/peers (SM90 sparse decode only)");
}
}  // namespace

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
