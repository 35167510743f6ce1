"""dsa-decode: the decode step of a DeepSeek-Sparse-Attention layer's
attention on Hopper GPUs, from Python.

Framework-free: every tensor is a DLPack array (PyTorch, CuPy, JAX), used in
place; launches go to the caller's current PyTorch stream (or the stream
given); nothing allocates or synchronizes on the run path, so every call can
be captured in a CUDA graph. Errors from the C++ checks arrive as
exceptions with the same message:

  InvalidArgument (ValueError)        a tensor, shape, dtype or value is wrong
  Unsupported (NotImplementedError)   valid, but not a case the library runs
  CudaError, CublasError, NoDevice (RuntimeError)

Kernels: qkv_rmsnorm, head_gemv, linear_gemv, sparse_mla, indexer_*.
The whole stage: Stage (with LayerConfig, StagePlan, StepArgs).
Optional: dsa_decode.torch_ops registers the ops with torch.library;
dsa_decode.vllm installs the stage on a vLLM MLA wrapper. docs/python.md.

Every default is the fastest path within the numerics contract's bounds
(the same bits on every run); StagePlan(batch_invariant=True) is the one
switch that makes a token's bits independent of the batch around it.
HEAD_GEMV_SUMS, INDEXER_LOGITS and ATTENTION_PLANS name each kernel's
choices, the default first.
"""

from . import _C
from ._C import CublasError, CudaError, InvalidArgument, NoDevice, Unsupported
from ._C import reference
from .ops import (
    ATTENTION_PLANS,
    HEAD_GEMV_SUMS,
    INDEXER_LOGITS,
    IndexerPlan,
    IndexerState,
    KvCacheWrite,
    head_gemv,
    indexer_prefill,
    indexer_prepare,
    indexer_project,
    indexer_remap,
    indexer_select,
    linear_gemv,
    linear_gemv_supports,
    qkv_rmsnorm,
    sparse_mla,
    sparse_mla_split_counter_count,
    sparse_mla_split_partials_count,
)
from .stage import MAX_TOKENS, WEIGHT_NAMES, LayerConfig, Stage, StagePlan, StepArgs, layer_config, supports

__version__ = "0.1.0"


def describe(array, fp8: bool = False) -> str:
    """The tensor view the library sees for this array, e.g.
    'bf16[4, 64, 256] strides [16384, 256, 1] on cuda:0'."""
    return _C.describe(array, fp8)


__all__ = [
    "ATTENTION_PLANS",
    "CublasError",
    "CudaError",
    "HEAD_GEMV_SUMS",
    "INDEXER_LOGITS",
    "IndexerPlan",
    "IndexerState",
    "InvalidArgument",
    "KvCacheWrite",
    "LayerConfig",
    "MAX_TOKENS",
    "NoDevice",
    "Stage",
    "StagePlan",
    "StepArgs",
    "Unsupported",
    "WEIGHT_NAMES",
    "describe",
    "head_gemv",
    "indexer_prefill",
    "indexer_prepare",
    "indexer_project",
    "indexer_remap",
    "indexer_select",
    "layer_config",
    "linear_gemv",
    "linear_gemv_supports",
    "qkv_rmsnorm",
    "reference",
    "sparse_mla",
    "sparse_mla_split_counter_count",
    "sparse_mla_split_partials_count",
    "supports",
]
