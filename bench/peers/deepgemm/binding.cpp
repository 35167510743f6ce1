// Our binding of DeepGEMM's attention APIs (issue 37): DeepGEMM's own
// register_apis of csrc/apis/attention.hpp (get_paged_mqa_logits_metadata,
// fp8_fp4_paged_mqa_logits, ...) and csrc/apis/runtime.hpp (init, set_num_sms,
// ...), as a module of its own: DeepGEMM's csrc/python_api.cpp also binds its
// GEMM, einsum, mega-MoE and hyperconnection APIs, which the benchmark does
// not use. DeepGEMM compiles its kernels at run time through NVCC (its JIT);
// _C.init points it at the headers (bench/peers/peers.py).
#include <pybind11/pybind11.h>
#include <torch/python.h>

#include "apis/attention.hpp"
#include "apis/runtime.hpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "DeepGEMM attention kernels (paged MQA logits), built by dsa-decode's bench/peers";
  deep_gemm::attention::register_apis(m);
  deep_gemm::runtime::register_apis(m);
}
