// Ours, standing in for vLLM's csrc/torch_utils.h when bench/peers compiles
// vLLM's csrc/cooperative_topk.cu (issue 37). vLLM 0.34 builds against torch
// 2.14's libtorch stable ABI, and its header also wraps a cuBLAS handle call
// that older torch versions lack; the launcher needs only the stable tensor
// API, a checked CUDA stream and the device properties, given here against
// the torch on the GPU machine.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/shim_utils.h>

#include <cuda_runtime.h>

#include <string>

// The current device's properties (queried once per device).
inline cudaDeviceProp* get_device_prop() {
  static cudaDeviceProp props[64];
  static bool known[64] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  STD_TORCH_CHECK(err == cudaSuccess, "cudaGetDevice failed: ", cudaGetErrorString(err));
  STD_TORCH_CHECK(device >= 0 && device < 64, "device index out of range: ", device);
  if (!known[device]) {
    err = cudaGetDeviceProperties(&props[device], device);
    STD_TORCH_CHECK(err == cudaSuccess, "cudaGetDeviceProperties failed: ", cudaGetErrorString(err));
    known[device] = true;
  }
  return &props[device];
}

// PyTorch's current CUDA stream of a device (-1: the current device), through the stable C shim.
inline cudaStream_t get_current_cuda_stream(int32_t device_index = -1) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return reinterpret_cast<cudaStream_t>(stream);
}
