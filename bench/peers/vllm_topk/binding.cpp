// Our registration of vLLM's decode top-k launcher (issue 37): vLLM's
// csrc/cooperative_topk.cu, compiled unchanged beside this file, registered
// with the op schema of vLLM's csrc/torch_bindings.cpp under a namespace of
// our own: torch.ops.dsa_peer_vllm.cooperative_topk(logits, lengths, output,
// workspace, k, max_seq_len).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>

// Defined in vLLM's csrc/cooperative_topk.cu (declared in its csrc/ops.h).
void cooperative_topk(const torch::stable::Tensor& logits, const torch::stable::Tensor& lengths,
                      torch::stable::Tensor& output, torch::stable::Tensor& workspace, int64_t k,
                      int64_t max_seq_len);

STABLE_TORCH_LIBRARY(dsa_peer_vllm, ops) {
  ops.def(
      "cooperative_topk(Tensor logits, Tensor lengths, Tensor! output, "
      "Tensor workspace, int k, int max_seq_len) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(dsa_peer_vllm, CUDA, ops) { ops.impl("cooperative_topk", TORCH_BOX(&cooperative_topk)); }
