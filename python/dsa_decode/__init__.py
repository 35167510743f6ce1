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

Kernels: qkv_rmsnorm, head_gemv, linear_gemv, sparse_mla, indexer_*; for
the RoPE presets (dsv32, glm5): rope_absorb (with RopeConfig,
rope_preset_config, rope_cos_sin_table, rope_softmax_scale), sparse_mla_v32
and sparse_mla_v32_cache_write (DeepSeek-V3.2's 656-byte FP8 cache).
The whole stage: Stage (with LayerConfig, StagePlan, StepArgs), for glm5next
and for the RoPE layers (LayerConfig's rope and indexer_rope:
layer_config("dsv32"), LayerConfig.from_model_config of a config.json);
Stage.from_checkpoint and load_layer_weights read a layer of a Hugging Face
checkpoint (safetensors, BF16 or FP8 with 128 x 128 block scales).
Optional: dsa_decode.torch_ops registers the ops with torch.library;
dsa_decode.vllm installs the stage on a vLLM MLA wrapper (glm5next,
DeepSeek-V3.2, GLM-5). docs/python.md.

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
    ROPE_STYLES,
    ROPE_TARGETS,
    SPARSE_MLA_V32_LAYOUT,
    IndexerPlan,
    IndexerState,
    KvCacheWrite,
    RopeConfig,
    head_gemv,
    indexer_prefill,
    indexer_prepare,
    indexer_project,
    indexer_remap,
    indexer_ring_for,
    indexer_select,
    linear_gemv,
    linear_gemv_supports,
    qkv_rmsnorm,
    rope_absorb,
    rope_cos_sin_table,
    rope_preset_config,
    rope_softmax_scale,
    sparse_mla,
    sparse_mla_split_counter_count,
    sparse_mla_split_partials_count,
    sparse_mla_v32,
    sparse_mla_v32_cache_write,
)
from .checkpoint import Checkpoint, LayerWeights, load_layer_weights
from .stage import (
    INDEXER_CONFIG_FIELDS,
    MAX_TOKENS,
    WEIGHT_NAMES,
    LayerConfig,
    Stage,
    StagePlan,
    StepArgs,
    layer_config,
    stage_plan_for,
    supports,
)

__version__ = "0.1.0"


def describe(array, fp8: bool = False) -> str:
    """The tensor view the library sees for this array, e.g.
    'bf16[4, 64, 256] strides [16384, 256, 1] on cuda:0'."""
    return _C.describe(array, fp8)


__all__ = [
    "ATTENTION_PLANS",
    "Checkpoint",
    "CublasError",
    "CudaError",
    "HEAD_GEMV_SUMS",
    "INDEXER_CONFIG_FIELDS",
    "INDEXER_LOGITS",
    "IndexerPlan",
    "IndexerState",
    "InvalidArgument",
    "KvCacheWrite",
    "LayerConfig",
    "LayerWeights",
    "MAX_TOKENS",
    "NoDevice",
    "ROPE_STYLES",
    "ROPE_TARGETS",
    "RopeConfig",
    "SPARSE_MLA_V32_LAYOUT",
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
    "indexer_ring_for",
    "indexer_select",
    "layer_config",
    "linear_gemv",
    "linear_gemv_supports",
    "load_layer_weights",
    "qkv_rmsnorm",
    "reference",
    "rope_absorb",
    "rope_cos_sin_table",
    "rope_preset_config",
    "rope_softmax_scale",
    "sparse_mla",
    "sparse_mla_split_counter_count",
    "sparse_mla_split_partials_count",
    "sparse_mla_v32",
    "sparse_mla_v32_cache_write",
    "stage_plan_for",
    "supports",
]
