// Our binding of FlashMLA's sparse FP8 decode (issue 37): FlashMLA's own
// host interface, sparse_attn_decode_interface (csrc/api/sparse_decode.h,
// which flash_mla.cuda.sparse_decode_fwd binds in FlashMLA's api.cpp), as a
// module of its own, so that only the SM90 sparse-decode sources need to be
// compiled (api.cpp also binds the dense, prefill and SM100 paths).
// FlashMLA's Python interface (flash_mla/flash_mla_interface.py) imports this
// module as flash_mla.cuda: bench/peers/peers.py places it there.
#include <pybind11/pybind11.h>

#include "api/sparse_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FlashMLA sparse FP8 decode (SM90), built by dsa-decode's bench/peers";
  m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
}
