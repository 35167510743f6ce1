"""The stage installed on vLLM's glm5next MLA wrapper, as the seed's DsaAttentionStage is.

``install(attention)`` takes a glm5next DSA layer's attention module as vLLM
0.33 builds it (vllm/models/glm5next/common/attention.py,
Glm5NextMLAAttention) and names its parts as the seed does::

    w = attention.mla_attn       # the MultiHeadLatentAttentionWrapper (model_executor/layers/mla.py)
    mla = w.mla_attn             # its MLAAttention (KV cache, W_UK_T, W_UV, scales)
    impl = mla.impl              # the attention backend's implementation
    indexer = w.indexer          # the glm5next Indexer (its weights, K cache and tail ring)

It runs the seed's checks (and the ones the real classes add: the backend,
the indexer's shape against what the installed library runs, o_proj) with
vLLM's attribute names, reads the layer's configuration and weights, creates
a dsa_decode.Stage and installs the adapter's forward as ``w.forward``, the
stock forward kept for every step the stage does not run (``uninstall()``
puts it back). Every attribute path is in the tables below, each checked
against vLLM 0.33.0's source (docs/vllm.md has file:line for each).

Weights are used in place (views, no copies) except W_UV: vLLM holds it as
a strided view of kv_b_proj's weight, [H, L, V] with strides ((P+V) L, 1, L),
and the stage's value-up (head_gemv) takes V contiguous; install() copies it
once into a contiguous tensor (H L V BF16: 16 MiB a layer at TP1, 2 MiB at
TP8), as the seed did. A weight reload after install does not reach that
copy: install again.

vLLM's indexer state is taken as vLLM holds it, with one conversion: the K
cache [blocks, pools, 132] uint8 is passed as its 2-D view [blocks, pools *
132] (a view, no copy); the tail ring ``indexer.tail_cache.kv_cache``
[tail_blocks, 2, ring, 128] BF16 is addressed by tail block where the stage
addresses its ring by block-table row, so each step gathers the step's
requests' ring blocks into an adapter-owned buffer [requests, 2, ring, 128]
before the stage runs and writes them back after it (four small copy
kernels and two index conversions into buffers allocated once, at the first
step: nothing allocates on the run path, CUDA-graph capturable).

o_proj: the stage computes this rank's product with vLLM's o_proj weight (the
RowParallelLinear's shard); when that layer reduces (reduce_results and
tp_size > 1) the adapter all-reduces the output with vLLM's own
tensor_model_parallel_all_reduce, as RowParallelLinear.forward does, so TP >
1 gives the full sum.

DeepSeek-V3.2 and GLM-5 layers (vLLM's DeepseekV2MLAAttention with
``index_topk`` in its config: w.rotary_emb and w.indexer_rope_emb present,
qk_rope_head_dim 64, kv_cache_dtype "fp8_ds_mla", the FLASHMLA_SPARSE
backend, DeepSeek-V3.2's unpooled Indexer) are taken too: each rotary is
mapped into a dsa_decode.RopeConfig (rope_config_of: vLLM's
DeepseekScalingRotaryEmbedding, YaRN, or RotaryEmbedding, plain RoPE;
is_neox_style gives the style, and the mapped table must agree with the
rotary's own cos_sin_cache), the stage runs the unpooled indexer plan (pool
1, no ring) over vLLM's indexer K cache [blocks, block_size, 132] (its 2-D
view) and the 656-byte KV cache. One requirement vLLM 0.33 itself does not
meet: the indexer's keys in the stage's basis (install(...,
indexer_keys="hadamard"), ROPE_INDEXER_KEYS below).

PyTorch and vLLM are imported only where a step or an install needs them
(vllm_step_inputs, the ring conversion, the all-reduce): the CPU tests run
the adapter on objects with the same attributes.

The adapter's forward is plain Python calling the extension: run the model
eagerly, or in CUDA graphs captured after each step size ran once uncaptured
(dsa_decode.Stage's rule). Dynamo breaks its graph at this call; a model
compiled whole would call torch.ops.dsa_decode.stage_forward instead
(dsa_decode.torch_ops, with register_stage(adapter.stage)).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .ops import IndexerState
from .stage import ROPE_UNREAD_WEIGHTS, LayerConfig, Stage, StagePlan, StepArgs

# The layer's weights, by dsa_decode.WEIGHT_NAMES key: vLLM's attribute paths
# from w (the wrapper) and mla (its MLAAttention). W_UV is copied once at
# install where its last dimension is not contiguous (vLLM's view); the
# scales are vLLM's 0-dim buffers, passed as their one-element views.
WEIGHT_ATTRIBUTES: Dict[str, str] = {
    "fused_qkv_a_proj": "w.fused_qkv_a_proj.weight",
    "q_a_norm": "w.q_a_layernorm.weight",
    "kv_a_norm": "w.kv_a_layernorm.weight",
    "q_b_proj": "w.q_b_proj.weight",
    "w_uk_t": "mla.W_UK_T",
    "w_uv": "mla.W_UV",
    "o_proj": "w.o_proj.weight",
    "q_scale": "mla._q_scale",
    "k_scale": "mla._k_scale",
}

# The glm5next indexer's weights, by WEIGHT_NAMES key: (attribute path from
# w.indexer, rows). vLLM fuses wk and weights_proj into one
# MergedColumnParallelLinear, wk_weights_proj.weight [head_dim + n_heads, D]:
# rows [:head_dim] are wk, rows [head_dim:] weights_proj (row views, no
# copy). The pool gate and the positional term are bare parameters.
INDEXER_WEIGHT_ATTRIBUTES: Dict[str, Tuple[str, Optional[str]]] = {
    "index_wq_b": ("wq_b.weight", None),  # [n_heads * 128, Q] BF16
    "index_wk": ("wk_weights_proj.weight", "head"),  # rows [:128]: [128, D] BF16
    "index_weights_proj": ("wk_weights_proj.weight", "rest"),  # rows [128:]: [n_heads, D] BF16
    "index_compress_gate": ("index_kpool_compress_gate", None),  # [128, D] BF16
    "index_k_norm_weight": ("k_norm.weight", None),  # [128] f32
    "index_k_norm_bias": ("k_norm.bias", None),  # [128] f32
    "index_ape": ("index_kpool_compress_ape", None),  # [kpool, 128] f32
}

# The LayerConfig's sizes and scales: vLLM's attribute paths. softmax_scale is
# the MLAAttention's `scale` (glm5next: (P + rope)^-0.5 = 256^-0.5),
# rms_norm_eps the q a-norm's variance_epsilon (the fused norm uses it for
# both). hidden_size is fused_qkv_a_proj's weight's dim 1.
CONFIG_ATTRIBUTES: Dict[str, str] = {
    "num_heads": "w.num_heads",  # H on this rank
    "q_lora_rank": "w.q_lora_rank",
    "kv_lora_rank": "w.kv_lora_rank",
    "qk_nope_head_dim": "w.qk_nope_head_dim",
    "qk_rope_head_dim": "w.qk_rope_head_dim",
    "v_head_dim": "w.v_head_dim",
    "softmax_scale": "mla.scale",
    "rms_norm_eps": "w.q_a_layernorm.variance_epsilon",
}

# The indexer's shape: the model config the Indexer holds (w.indexer.config,
# transformers' Glm5NextTextConfig as vLLM reads it), by the adapter's names.
INDEXER_CONFIG_ATTRIBUTES: Dict[str, str] = {
    "heads": "index_n_heads",
    "pool": "index_kpool",
    "topk": "index_topk",
    "head_dim": "index_head_dim",
    "always_select_tail": "index_kpool_always_select_tail",
}

# Where the installed library takes the indexer's shape when it does not
# publish it (dsa_decode.stage.INDEXER_CONFIG_FIELDS, StagePlan field -> HF
# name, is asked first): the StagePlan (or LayerConfig) field of each part,
# the first present. A library with none runs one shape: its Stage's weight
# checks and plan checks say which (and the adapter names the layer's).
LIBRARY_INDEXER_FIELDS: Dict[str, Tuple[str, ...]] = {
    "heads": ("indexer_heads", "heads", "index_heads"),
    "pool": ("indexer_pool", "pool", "index_pool"),
    "topk": ("indexer_topk", "topk", "index_topk"),
}

# The attention backends whose KV cache the stage reads as it is: a flat FP8
# (or BF16) [blocks, block_size, 512] cache with one per-tensor k_scale. On
# SM90 vLLM picks FLASHINFER_MLA_SPARSE_SM90 for this model (head size 512);
# the seed ran on FLASHINFER_MLA_SPARSE (SM100). The backend's own attention
# is not run on the steps the stage takes (the stage runs its own, on an FP8
# query: see docs/vllm.md for what that changes against the BF16 query of
# the Hopper backend).
KV_CACHE_BACKENDS: Tuple[str, ...] = ("FLASHINFER_MLA_SPARSE_SM90", "FLASHINFER_MLA_SPARSE")

# A RoPE layer's (DeepSeek-V3.2, GLM-5): the backend whose cache is
# DeepSeek-V3.2's 656-byte fp8_ds_mla entries [blocks, block_size, 656]
# (vLLM canonicalizes any quantized KV cache dtype to fp8_ds_mla for it; on
# Hopper it is vLLM's choice for a quantized cache of head size 576).
ROPE_KV_CACHE_BACKENDS: Tuple[str, ...] = ("FLASHMLA_SPARSE",)
ROPE_KV_CACHE_DTYPE = "fp8_ds_mla"
ROPE_DIMS = 64  # the 656-byte entry's RoPE part

# The weights a RoPE layer's stage does not read (dsa_decode.stage.ROPE_UNREAD_WEIGHTS,
# imported above): install() does not look them up on such a layer.

# vLLM's rotary classes a dsa_decode.RopeConfig expresses, by class name:
# DeepSeek's YaRN (get_rope's deepseek_yarn / deepseek_llama_scaling branch)
# and plain RoPE (rope_type "default"). Read: head_size, rotary_dim, base,
# is_neox_style, max_position_embeddings (YaRN: the original positions),
# cos_sin_cache (its rows: the positions it serves), and for YaRN
# scaling_factor, beta_fast, beta_slow, mscale (the cos/sin factor).
ROTARY_CLASSES: Tuple[str, ...] = ("DeepseekScalingRotaryEmbedding", "RotaryEmbedding")
# The mapped RopeConfig's table against the rotary's cos_sin_cache over its
# first rows: within this much of the table's scale (vLLM's cache: FP32
# angles, often cast to BF16, 2^-9 relative; a wrong theta, factor or ramp
# is off by O(1)).
ROTARY_TABLE_ROWS = 4096
ROTARY_TABLE_TOLERANCE = 4e-3

# The bases of the indexer's K cache a RoPE layer's stage scores correctly.
# The stage (DeepSeek's reference, docs/indexer.md) quantizes the V3.2
# indexer's keys and queries after a Hadamard-128 rotation; vLLM 0.33's
# Indexer quantizes both unrotated (indexer_k_quant_and_cache): dots of a
# rotated query with keys vLLM's prefill wrote are not the logits. install()
# takes a RoPE layer only when told the engine's keys are rotated
# (indexer_keys="hadamard": e.g. its prefill writes them with
# dsa_decode.indexer_prefill).
ROPE_INDEXER_KEYS: Tuple[str, ...] = ("hadamard",)

# vllm_step_inputs: the step's tensors on the layer's attention metadata md =
# forward_context.attn_metadata[mla.layer_name] (SparseMLACommonMetadata,
# which FlashInferMLASparseSM90Metadata extends): the block table [requests,
# width] int32 and each token's row of it, [tokens] int32.
METADATA_ATTRIBUTES: Dict[str, str] = {
    "block_table": "block_table",
    "token_requests": "req_id_per_token",
}

# vllm_step_inputs: the indexer's paged state on w.indexer (bound by vLLM's
# bind_kv_cache): the pooled-key cache [blocks, block_size / kpool, 132]
# uint8 and the tail ring [tail_blocks, 2, ring, 128] BF16. The tail ring's
# slots come from its own metadata, attn_metadata[indexer.tail_cache.prefix]
# .slot_mapping (tail block * ring + pos % ring, per token).
INDEXER_STATE_ATTRIBUTES: Dict[str, str] = {
    "k_cache": "k_cache.kv_cache",
    "tail": "tail_cache.kv_cache",
    "tail_layer_name": "tail_cache.prefix",
}

_MISSING = object()


def _resolve(root: Any, dotted: str) -> Any:
    """getattr along a dotted path; _MISSING where a link is absent or None."""
    value = root
    for name in dotted.split("."):
        value = getattr(value, name, None)
        if value is None:
            return _MISSING
    return value


def _backend_name(mla: Any) -> str:
    return mla.attn_backend.get_name()


def _rope_layer(w: Any) -> bool:
    """A RoPE layer (DeepSeek-V3.2, GLM-5): a rotary and rotary dims. Either
    alone is a NoPE layer's failed check."""
    return getattr(w, "rotary_emb", None) is not None and bool(getattr(w, "qk_rope_head_dim", 0))


# The seed's checks, in its order and with its words, then the ones vLLM's
# real classes need. Each: (what the stage needs, the condition as vLLM's
# attributes say it, the condition as code over w, mla and impl, the layers
# it applies to: "nope", "rope" or "both").
_CHECKS: Tuple[Tuple[str, str, Callable[[Any, Any, Any], bool], str], ...] = (
    (
        "a fused q/kv a-norm",
        "w.q_lora_rank is not None and w.fuse_qkv_rmsnorm",
        lambda w, mla, impl: w.q_lora_rank is not None and bool(w.fuse_qkv_rmsnorm),
        "nope",
    ),
    # vLLM's DeepseekV2MLAAttention norms q_c and kv_c apart (fuse_qkv_rmsnorm
    # False): the stage's one launch computes the same two RMSNorms, each
    # over its own part, with one eps.
    (
        "a q a-norm and a kv a-norm of one eps",
        "w.q_lora_rank is not None and w.q_a_layernorm.variance_epsilon == w.kv_a_layernorm.variance_epsilon",
        lambda w, mla, impl: w.q_lora_rank is not None
        and w.q_a_layernorm.variance_epsilon == w.kv_a_layernorm.variance_epsilon,
        "rope",
    ),
    (
        "NoPE",
        "w.rotary_emb is None and w.qk_rope_head_dim == 0",
        lambda w, mla, impl: w.rotary_emb is None and w.qk_rope_head_dim == 0,
        "nope",
    ),
    (
        f"{ROPE_DIMS} RoPE dims with the indexer's rotary",
        f"w.qk_rope_head_dim == {ROPE_DIMS} and w.indexer_rope_emb is not None",
        lambda w, mla, impl: w.qk_rope_head_dim == ROPE_DIMS and w.indexer_rope_emb is not None,
        "rope",
    ),
    (
        "its own indexer",
        "w.indexer is not None and not w.skip_topk",
        lambda w, mla, impl: w.indexer is not None and not w.skip_topk,
        "both",
    ),
    (
        "no gate or DCP query",
        "w.g_proj is None and not w.dcp_q_replicate",
        lambda w, mla, impl: w.g_proj is None and not w.dcp_q_replicate,
        "both",
    ),
    (
        "an FP8 KV cache",
        "str(mla.kv_cache_dtype) in ('fp8', 'fp8_e4m3')",
        lambda w, mla, impl: str(mla.kv_cache_dtype) in ("fp8", "fp8_e4m3"),
        "nope",
    ),
    (
        "an FP8 KV cache of DeepSeek-V3.2's 656-byte entries",
        f"str(mla.kv_cache_dtype) == '{ROPE_KV_CACHE_DTYPE}'",
        lambda w, mla, impl: str(mla.kv_cache_dtype) == ROPE_KV_CACHE_DTYPE,
        "rope",
    ),
    (
        "no padding or PCP",
        "mla.q_pad_num_heads is None and not mla.use_pcp",
        lambda w, mla, impl: mla.q_pad_num_heads is None and not mla.use_pcp,
        "both",
    ),
    (
        "no HiSparse",
        "mla.hisparse_cache is None and impl.dcp_world_size == 1",
        lambda w, mla, impl: mla.hisparse_cache is None and impl.dcp_world_size == 1,
        "both",
    ),
    (
        "a column-major W_UK",
        "mla.W_UK_T.stride(-1) == 1",
        lambda w, mla, impl: mla.W_UK_T.stride(-1) == 1,
        "both",
    ),
    (
        "a flat FP8 KV cache backend",
        f"mla.attn_backend.get_name() in {KV_CACHE_BACKENDS}",
        lambda w, mla, impl: _backend_name(mla) in KV_CACHE_BACKENDS,
        "nope",
    ),
    (
        "a backend of the 656-byte FP8 cache",
        f"mla.attn_backend.get_name() in {ROPE_KV_CACHE_BACKENDS}",
        lambda w, mla, impl: _backend_name(mla) in ROPE_KV_CACHE_BACKENDS,
        "rope",
    ),
    (
        "no other layer reading its selection",
        "impl.index_group is None or impl.index_group.num_layers == 1",
        lambda w, mla, impl: getattr(getattr(impl, "index_group", None), "num_layers", 1) <= 1,
        "both",
    ),
    (
        "an o_proj without bias on this rank's heads",
        "w.o_proj.bias is None and w.o_proj.input_is_parallel",
        lambda w, mla, impl: getattr(w.o_proj, "bias", None) is None and bool(w.o_proj.input_is_parallel),
        "both",
    ),
)


def _parts(attention: Any) -> Tuple[Any, Any, Any]:
    """(w, mla, impl) of vLLM's attention module, as the seed reads them."""
    try:
        w = attention.mla_attn
        mla = w.mla_attn
        return w, mla, mla.impl
    except AttributeError as error:
        raise ValueError(
            f"DSA attention stage needs a vLLM attention module with mla_attn.mla_attn.impl ({error})"
        ) from None


def _missing_requirements(w: Any, mla: Any, impl: Any) -> List[str]:
    kind = "rope" if _rope_layer(w) else "nope"
    missing = []
    for what, condition, holds, applies in _CHECKS:
        if applies not in ("both", kind):
            continue
        try:
            if not holds(w, mla, impl):
                missing.append(f"{what} ({condition})")
        except AttributeError as error:
            # An engine version without one of the names: say which, as a
            # failed requirement, rather than stop at the first.
            missing.append(f"{what} ({condition}: {error})")
    return missing


def _numpy(table: Any):
    """A cos/sin cache as float64 NumPy (a torch tensor on any device, or an array)."""
    import numpy as np

    if hasattr(table, "detach") and hasattr(table, "cpu"):
        return table.detach().float().cpu().numpy().astype(np.float64)
    return np.asarray(table, dtype=np.float64)


def rope_config_of(rotary: Any, path: str, model_config: Any = None) -> Tuple[Optional[Any], List[str]]:
    """vLLM's rotary module (``w.rotary_emb`` or ``w.indexer_rope_emb``) as a
    dsa_decode.RopeConfig, and what keeps it from being one (named with
    `path`): a class of ROTARY_CLASSES (by name), rotary_dim == head_size
    (every rope dim rotated), its attributes, its cos_sin_cache (the rows
    the table serves), and the mapped config's own table within
    ROTARY_TABLE_TOLERANCE of that cache over its first ROTARY_TABLE_ROWS
    rows. The style is is_neox_style's ("half-split" when True, else
    "interleaved"). YaRN's mscale and mscale_all_dim: the model config's
    (rope_parameters or rope_scaling) where they give the rotary's cos/sin
    factor, else any pair that does (the softmax scale is the attention's
    own, mla.scale, not derived from them)."""
    from .ops import RopeConfig, rope_cos_sin_table
    from ._C import InvalidArgument

    problems: List[str] = []
    name = type(rotary).__name__
    if name not in ROTARY_CLASSES:
        return None, [f"a rotary the stage computes ({path}: {' or '.join(ROTARY_CLASSES)}, got {name})"]
    values = {}
    yarn = name == "DeepseekScalingRotaryEmbedding"
    attributes = ["head_size", "rotary_dim", "base", "is_neox_style", "max_position_embeddings", "cos_sin_cache"]
    if yarn:
        attributes += ["scaling_factor", "beta_fast", "beta_slow", "mscale"]
    for attribute in attributes:
        value = getattr(rotary, attribute, None)
        if value is None:
            problems.append(f"the rotary's {path}.{attribute}")
        values[attribute] = value
    if problems:
        return None, problems
    cache = values["cos_sin_cache"]
    shape = tuple(getattr(cache, "shape", ()))
    R = int(values["rotary_dim"])
    if int(values["head_size"]) != R:
        problems.append(f"a rotary of every rope dim ({path}.rotary_dim == head_size: {R} != {values['head_size']})")
    if len(shape) != 2 or shape[1] != R or shape[0] < 1:
        problems.append(f"a cos/sin table [positions, {R}] ({path}.cos_sin_cache: shape {list(shape)})")
    if problems:
        return None, problems
    fields = dict(
        rope_dim=R,
        theta=float(values["base"]),
        max_position=int(shape[0]),
        original_max_position=int(values["max_position_embeddings"]),
        style="half-split" if bool(values["is_neox_style"]) else "interleaved",
    )
    if yarn:
        factor = float(values["scaling_factor"])
        fields.update(factor=factor, beta_fast=float(values["beta_fast"]), beta_slow=float(values["beta_slow"]))
        fields.update(_yarn_magnitudes(factor, float(values["mscale"]), model_config))
    try:
        config = RopeConfig(**fields)
    except InvalidArgument as error:
        return None, [f"a rotary the library's RopeConfig takes ({path}: {error})"]
    rows = min(ROTARY_TABLE_ROWS, fields["max_position"])
    ours = rope_cos_sin_table(config, 0, rows).astype("float64")
    theirs = _numpy(cache[:rows])
    scale = max(abs(config.table_scale), 1.0)
    worst = float(abs(ours - theirs).max()) if rows else 0.0
    if not worst <= ROTARY_TABLE_TOLERANCE * scale:
        problems.append(
            f"a rotary whose table the stage rebuilds ({path}.cos_sin_cache against the RopeConfig read from its "
            f"attributes, {config}: {worst:.3g} apart over its first {rows} rows, tolerance "
            f"{ROTARY_TABLE_TOLERANCE * scale:.3g})"
        )
        return None, problems
    return config, []


def _yarn_mscale(factor: float, mscale: float) -> float:
    import math

    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_magnitudes(factor: float, ratio: float, model_config: Any) -> Dict[str, float]:
    """mscale and mscale_all_dim giving the cos/sin factor `ratio` (vLLM's
    DeepseekScalingRotaryEmbedding.mscale): the model config's where they do."""
    import math

    for name in ("rope_parameters", "rope_scaling"):
        scaling = getattr(model_config, name, None) if model_config is not None else None
        if isinstance(scaling, Mapping):
            mscale, all_dim = scaling.get("mscale", 1.0), scaling.get("mscale_all_dim", 0.0)
            try:
                given = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dim))
            except (TypeError, ValueError, ZeroDivisionError):
                continue
            if abs(given - ratio) <= 1e-9 * max(1.0, abs(ratio)):
                return {"mscale": float(mscale), "mscale_all_dim": float(all_dim)}
    if factor <= 1:
        return {"mscale": 1.0, "mscale_all_dim": 0.0}
    return {"mscale": (ratio - 1.0) / (0.1 * math.log(factor)), "mscale_all_dim": 0.0}


@dataclass(frozen=True)
class IndexerShape:
    """The layer's indexer as the model config gives it (heads, pool, topk,
    head_dim, always_select_tail: HF index_n_heads, index_kpool, index_topk,
    index_head_dim, index_kpool_always_select_tail) and as vLLM lays out its
    state: ring (the tail ring's slots: kpool x next_power_of_2(ceil((kpool
    + speculative tokens) / kpool)), vLLM's Glm5NextTailCache) and
    block_size (tokens per KV block, the indexer's page holding block_size /
    kpool pools). A RoPE layer's (DeepSeek-V3.2's Indexer) has no pools:
    pool 1, ring 1, a key per token (unpooled True)."""

    heads: int
    pool: int
    topk: int
    head_dim: int
    always_select_tail: bool
    ring: int
    block_size: int
    unpooled: bool = False

    def describe(self) -> str:
        if self.unpooled:
            return (
                f"index_n_heads={self.heads}, index_topk={self.topk}, index_head_dim={self.head_dim}, unpooled "
                f"(DeepSeek-V3.2's indexer), block_size {self.block_size}"
            )
        return (
            f"index_n_heads={self.heads}, index_kpool={self.pool}, index_topk={self.topk}, "
            f"index_head_dim={self.head_dim}, index_kpool_always_select_tail={self.always_select_tail}, "
            f"tail ring {self.ring}, block_size {self.block_size}"
        )


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def vllm_tail_ring(pool: int, speculative_tokens: int) -> int:
    """vLLM's tail ring size for a pool size and speculative token count:
    pool * next_power_of_2(ceil((pool + speculative_tokens) / pool))."""
    span = pool + speculative_tokens
    return pool * _next_power_of_2(-(-span // pool))


# A RoPE layer's indexer config fields (DeepSeek-V3.2's Indexer: no pools).
ROPE_INDEXER_CONFIG_ATTRIBUTES: Dict[str, str] = {
    "heads": "index_n_heads",
    "topk": "index_topk",
    "head_dim": "index_head_dim",
}


def _block_size(w: Any, mla: Any, missing: List[str]) -> Optional[int]:
    """Tokens per KV block: the MLA cache's where it is bound, else the cache config's."""
    kv_cache = getattr(mla, "kv_cache", None)
    if kv_cache is not None and len(getattr(kv_cache, "shape", ())) == 3 and kv_cache.shape[0] > 0:
        return int(kv_cache.shape[1])
    block_size = _resolve(w.indexer, "k_cache.cache_config.block_size")
    if block_size is _MISSING:
        missing.append("the KV block size (mla.kv_cache bound, or w.indexer.k_cache.cache_config.block_size)")
        return None
    return int(block_size)


def _indexer_shape(w: Any, mla: Any, missing: List[str]) -> Optional[IndexerShape]:
    """The indexer's shape from its model config and its caches; None (with
    what is absent added to missing) where they cannot be read."""
    indexer = w.indexer
    config = getattr(indexer, "config", None)
    rope = _rope_layer(w)
    values: Dict[str, Any] = {}
    for field, name in (ROPE_INDEXER_CONFIG_ATTRIBUTES if rope else INDEXER_CONFIG_ATTRIBUTES).items():
        value = getattr(config, name, None) if config is not None else None
        if value is None:
            missing.append(f"the indexer's config field w.indexer.config.{name}")
        values[field] = value
    if any(value is None for value in values.values()):
        return None
    if rope:
        block_size = _block_size(w, mla, missing)
        if block_size is None:
            return None
        return IndexerShape(
            heads=int(values["heads"]),
            pool=1,
            topk=int(values["topk"]),
            head_dim=int(values["head_dim"]),
            always_select_tail=True,
            ring=1,
            block_size=block_size,
            unpooled=True,
        )
    pool = int(values["pool"])
    # The ring: the tail cache's own size where it is bound, else vLLM's rule.
    tail = _resolve(indexer, INDEXER_STATE_ATTRIBUTES["tail"])
    if tail is not _MISSING and len(getattr(tail, "shape", ())) == 4 and tail.shape[0] > 0:
        ring = int(tail.shape[2])
    else:
        speculative = _resolve(indexer, "vllm_config.num_speculative_tokens")
        ring = vllm_tail_ring(pool, int(speculative) if speculative is not _MISSING else 0)
    block_size = _block_size(w, mla, missing)
    if block_size is None:
        return None
    return IndexerShape(
        heads=int(values["heads"]),
        pool=pool,
        topk=int(values["topk"]),
        head_dim=int(values["head_dim"]),
        always_select_tail=bool(values["always_select_tail"]),
        ring=ring,
        block_size=block_size,
    )


def _library_field(cls: Any, field: str) -> Optional[str]:
    names = {f.name for f in dataclasses.fields(cls)}
    return next((name for name in LIBRARY_INDEXER_FIELDS[field] if name in names), None)


def library_indexer_fields() -> Dict[str, Tuple[str, str]]:
    """Where the installed dsa_decode takes each part of the indexer's shape
    (heads, pool, topk): {part: ("StagePlan" or "LayerConfig", field name)}:
    the library's own table (dsa_decode.stage.INDEXER_CONFIG_FIELDS: StagePlan
    field -> the HF config name) where it has one, else the first field of
    LIBRARY_INDEXER_FIELDS present. Empty for a library that runs one fixed
    shape (then its Stage's checks of the indexer weights and of plan.ring
    say what it takes)."""
    from . import stage as stage_module

    published = getattr(stage_module, "INDEXER_CONFIG_FIELDS", None)
    if published:
        part_of = {name: part for part, name in INDEXER_CONFIG_ATTRIBUTES.items()}
        plan_fields = {f.name for f in dataclasses.fields(StagePlan)}
        return {
            part_of[name]: ("StagePlan", field)
            for field, name in published.items()
            if name in part_of and field in plan_fields
        }
    found = {}
    for field in LIBRARY_INDEXER_FIELDS:
        for owner, cls in (("StagePlan", StagePlan), ("LayerConfig", LayerConfig)):
            name = _library_field(cls, field)
            if name is not None:
                found[field] = (owner, name)
                break
    return found


def _stage_plan(
    shape: IndexerShape, plan: Optional[StagePlan], max_context: Optional[int]
) -> Tuple[StagePlan, Dict[str, Any]]:
    """The stage plan for this layer (the given one, or the defaults with the
    layer's ring, block size, context and shape) and the LayerConfig fields
    that carry the shape in this library (if any). Raises ValueError naming
    the mismatch where the given plan disagrees with the layer, and
    dsa_decode.InvalidArgument (the library's own check) where the library
    does not run the shape."""
    fields = library_indexer_fields()
    plan_values = {"ring": shape.ring, "block_size": shape.block_size}
    config_values: Dict[str, Any] = {}
    for part, (owner, name) in fields.items():
        (plan_values if owner == "StagePlan" else config_values)[name] = getattr(shape, part)
    if plan is None:
        plan_values["batch_invariant"] = vllm_batch_invariant()
        if max_context is not None:
            plan_values["max_context"] = max_context
        return StagePlan(**plan_values), config_values
    disagree = [
        f"plan.{name} = {getattr(plan, name)!r} where the layer has {value!r}"
        for name, value in plan_values.items()
        if getattr(plan, name) != value
    ]
    if disagree:
        raise ValueError("a plan that matches the layer's indexer (" + "; ".join(disagree) + ")")
    return plan, config_values


def read_layer(
    attention: Any, plan: Optional[StagePlan] = None, *, indexer_keys: Optional[str] = None
) -> Tuple[LayerConfig, Dict[str, Any], StagePlan]:
    """The layer's dsa_decode.LayerConfig, weights (a dict with the
    WEIGHT_NAMES keys: the wrapper's own tensors or views of them; W_UV a
    contiguous copy where vLLM's view is not; a RoPE layer's without
    ROPE_UNREAD_WEIGHTS) and StagePlan (the one given, checked against the
    layer, or the defaults with the layer's indexer ring, block size,
    max_model_len and, where the library takes it, shape) from vLLM's
    attention module, after the checks. A RoPE layer's config carries its
    rotaries (rope_config_of of w.rotary_emb and w.indexer_rope_emb).

    Raises ValueError("DSA attention stage needs " + every missing
    requirement): each failed check with its condition in vLLM's attribute
    names, each configuration attribute or weight that is absent, a rotary
    the stage does not compute, the indexer key basis of a RoPE layer
    (indexer_keys: ROPE_INDEXER_KEYS), and an indexer shape the installed
    library does not run (the library's own words, with the layer's shape).
    Creates nothing on a device except the W_UV copy; the stage's creation
    checks the tensors (shapes, dtypes, strides) and names what is wrong."""
    return _read_layer(*_parts(attention), plan, indexer_keys=indexer_keys)[:3]


def _rows(weight: Any, rows: Optional[str], head_dim: int) -> Any:
    if rows is None or weight is _MISSING:
        return weight
    return weight[:head_dim] if rows == "head" else weight[head_dim:]


def _one_element(scale: Any) -> Any:
    """vLLM's 0-dim scale as the [1] view the stage takes (same memory)."""
    if scale is not _MISSING and len(getattr(scale, "shape", (1,))) == 0:
        return scale.view(1)
    return scale


def _read_layer(
    w: Any, mla: Any, impl: Any, plan: Optional[StagePlan] = None, *, indexer_keys: Optional[str] = None
) -> Tuple[LayerConfig, Dict[str, Any], StagePlan, IndexerShape]:
    roots = {"w": w, "mla": mla}
    missing = _missing_requirements(w, mla, impl)
    rope = _rope_layer(w)

    def lookup(path: str) -> Any:
        root, _, rest = path.partition(".")
        return _resolve(roots[root], rest)

    values = {}
    for field, path in CONFIG_ATTRIBUTES.items():
        value = lookup(path)
        if value is _MISSING and field != "q_lora_rank":  # a None q_lora_rank is a failed check already
            missing.append(f"the attribute {path}")
        values[field] = value
    weights = {}
    for name, path in WEIGHT_ATTRIBUTES.items():
        if rope and name in ROPE_UNREAD_WEIGHTS:
            continue
        weights[name] = lookup(path)
        if weights[name] is _MISSING:
            missing.append(f"the weight {path} ({name})")
    shape = None
    indexer = getattr(w, "indexer", None)
    if indexer is not None:  # else the indexer check failed: its weights go unlisted
        shape = _indexer_shape(w, mla, missing)
        head_dim = shape.head_dim if shape is not None else 128
        for name, (path, rows) in INDEXER_WEIGHT_ATTRIBUTES.items():
            if rope and name in ROPE_UNREAD_WEIGHTS:
                continue
            weights[name] = _rows(_resolve(indexer, path), rows, head_dim)
            if weights[name] is _MISSING:
                where = {"head": f" rows [:{head_dim}]", "rest": f" rows [{head_dim}:]"}.get(rows, "")
                missing.append(f"the indexer weight w.indexer.{path}{where} ({name})")
        if shape is not None:
            pages = _resolve(indexer, INDEXER_STATE_ATTRIBUTES["k_cache"])
            if pages is not _MISSING and len(getattr(pages, "shape", ())) == 3 and pages.shape[0] > 0:
                if rope and (int(pages.shape[1]) != shape.block_size or int(pages.shape[2]) != 132):
                    missing.append(
                        "an indexer page of a key per token of the KV block (w.indexer.k_cache.kv_cache.shape[1:] "
                        f"== (block_size, 132): {tuple(int(d) for d in pages.shape[1:])} with block_size "
                        f"{shape.block_size})"
                    )
                elif not rope and int(pages.shape[1]) * shape.pool != shape.block_size:
                    missing.append(
                        "an indexer page of the KV block's pools (w.indexer.k_cache.kv_cache.shape[1] * "
                        f"index_kpool == block_size: {int(pages.shape[1])} * {shape.pool} != {shape.block_size})"
                    )
            if not shape.always_select_tail:
                missing.append("an indexer that always selects the tail pool (index_kpool_always_select_tail)")
            if shape.head_dim != 128:
                missing.append(f"index_head_dim 128 (the layer has {shape.head_dim})")
    rotaries: Dict[str, Any] = {}
    if rope:
        model_config = getattr(indexer, "config", None)
        for field, path in (("rope", "w.rotary_emb"), ("indexer_rope", "w.indexer_rope_emb")):
            rotary = getattr(w, path[2:], None)
            if rotary is None:
                continue  # the failed check names it
            config, problems = rope_config_of(rotary, path, model_config)
            missing.extend(problems)
            rotaries[field] = config
        if indexer_keys not in ROPE_INDEXER_KEYS:
            missing.append(
                "the indexer's keys in the stage's basis, Hadamard-rotated as DeepSeek's reference and "
                "dsa_decode.indexer_prefill write them (install(..., indexer_keys='hadamard') where the engine's "
                "prefill does; vLLM's own Indexer writes them unrotated, indexer_k_quant_and_cache: got "
                f"indexer_keys={indexer_keys!r})"
            )
    qkv_weight = weights["fused_qkv_a_proj"]
    if qkv_weight is not _MISSING and len(getattr(qkv_weight, "shape", ())) != 2:
        missing.append("a 2-D w.fused_qkv_a_proj.weight [q_lora_rank + kv_lora_rank (+ rope dims), hidden]")
    config_values: Dict[str, Any] = {}
    if shape is not None:
        max_context = _resolve(indexer, "vllm_config.model_config.max_model_len")
        try:
            plan, config_values = _stage_plan(shape, plan, None if max_context is _MISSING else int(max_context))
        except ValueError as error:  # dsa_decode.InvalidArgument is one: the library's words
            missing.append(f"an indexer the installed dsa_decode runs (this layer: {shape.describe()}: {error})")
    if missing:
        raise ValueError("DSA attention stage needs " + ", ".join(missing))

    if not rope:
        weights["q_scale"] = _one_element(weights["q_scale"])
        weights["k_scale"] = _one_element(weights["k_scale"])
    # vLLM's W_UV is kv_b_proj's weight seen as [H, L, V] with V strided by
    # L: value-up's head_gemv takes V contiguous, so it is copied once here.
    w_uv = weights["w_uv"]
    if hasattr(w_uv, "stride") and len(w_uv.shape) == 3 and w_uv.stride(-1) != 1:
        weights["w_uv"] = w_uv.contiguous()

    config = LayerConfig(
        hidden_size=int(qkv_weight.shape[1]),
        num_heads=int(values["num_heads"]),
        q_lora_rank=int(values["q_lora_rank"]),
        kv_lora_rank=int(values["kv_lora_rank"]),
        qk_nope_head_dim=int(values["qk_nope_head_dim"]),
        qk_rope_head_dim=int(values["qk_rope_head_dim"]),
        v_head_dim=int(values["v_head_dim"]),
        softmax_scale=float(values["softmax_scale"]),
        rms_norm_eps=float(values["rms_norm_eps"]),
        # The checks' flags as the layer has them (all passed here): the
        # stage's creation checks them again, its own word on the layer.
        fuse_qkv_rmsnorm=bool(w.fuse_qkv_rmsnorm) or rope,  # a RoPE layer's two norms: the check above
        rotary_embedding=w.rotary_emb is not None,
        indexer=w.indexer is not None,
        skip_topk=bool(w.skip_topk),
        gate_proj=w.g_proj is not None,
        dcp_query_replicate=bool(w.dcp_q_replicate),
        kv_cache_dtype=str(mla.kv_cache_dtype),
        padded_heads=mla.q_pad_num_heads is not None,
        prefill_context_parallel=bool(mla.use_pcp),
        hisparse_cache=mla.hisparse_cache is not None,
        decode_context_parallel_size=int(impl.dcp_world_size),
        **rotaries,
        **config_values,
    )
    return config, weights, plan, shape


class TailRing:
    """vLLM's tail ring as the stage's per-request ring, for one step.

    vLLM: tail [tail_blocks, 2, ring, 128] BF16, a request's ring in its own
    tail block (tail slot // ring). The stage: ring [requests, 2, ring, 128],
    a request's ring at its block-table row. gather() copies each token's
    tail block into the row of its request in `rows` (an adapter buffer),
    scatter() copies the rows back after the stage wrote them. Tokens of one
    request carry the same block and row, so the repeated copies write equal
    values. The buffers are allocated by prepare(), on the first step (and
    again only if the engine's tables grow); gather and scatter allocate
    nothing and capture into CUDA graphs."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.rows = None  # [requests, 2, ring, 128]: the stage's ring
        self.staged = None  # [max_tokens, 2, ring, 128]
        self.row_index = None  # [max_tokens] int64: each token's block-table row
        self.block_index = None  # [max_tokens] int64: each token's tail block

    def prepare(self, tail: Any, requests: int) -> None:
        import torch

        shape = (requests,) + tuple(tail.shape[1:])
        if (
            self.rows is not None
            and tuple(self.rows.shape) == shape
            and self.rows.device == tail.device
            and self.rows.dtype == tail.dtype
        ):
            return
        self.rows = torch.zeros(shape, dtype=tail.dtype, device=tail.device)
        self.staged = torch.empty((self.max_tokens,) + shape[1:], dtype=tail.dtype, device=tail.device)
        self.row_index = torch.zeros(self.max_tokens, dtype=torch.int64, device=tail.device)
        self.block_index = torch.zeros(self.max_tokens, dtype=torch.int64, device=tail.device)

    def gather(self, tail: Any, token_requests: Any, tail_slots: Any, m: int) -> None:
        import torch

        ring = tail.shape[2]
        rows, blocks, staged = self.row_index[:m], self.block_index[:m], self.staged[:m]
        rows.copy_(token_requests[:m])
        torch.floor_divide(tail_slots[:m], ring, out=blocks)
        torch.index_select(tail, 0, blocks, out=staged)
        self.rows.index_copy_(0, rows, staged)

    def scatter(self, tail: Any, m: int) -> None:
        import torch

        staged = self.staged[:m]
        torch.index_select(self.rows, 0, self.row_index[:m], out=staged)
        tail.index_copy_(0, self.block_index[:m], staged)


@dataclass
class StepInputs:
    """The engine's tensors of one step, beyond positions and hidden states
    (which the wrapper's forward is given), for m = hidden_states.shape[0]:

    num_actual_tokens, num_decode_tokens: the step's counts from the
    attention metadata (the stage runs only a pure decode step, both equal
    to m, m <= plan.max_tokens); token_requests [m] int32, each token's row
    of the block table (negative: padding); slot_mapping [n >= m] int64, the
    step's KV-cache slots (negative: not written); kv_cache [blocks,
    block_size, kv_lora_rank] FP8 e4m3 (or its uint8 view); indexer: the
    dsa_decode.IndexerState (block_table [requests, width] int32, shared with
    the KV cache; ring [requests, 2, RING, 128] BF16; k_cache [blocks,
    block_size / pool * 132] uint8, 2-D). topk_positions: optional [m, row
    width] int32 request-local rows to use instead of running the indexer
    (MTP draft steps 1+); error_count: an optional int32 CUDA counter of
    untrusted device values met. before / after: optional callables run
    right before and after the stage's forward (vllm_step_inputs: the tail
    ring's gather and scatter), not on a stock step."""

    num_actual_tokens: int
    num_decode_tokens: int
    token_requests: Any
    slot_mapping: Any
    kv_cache: Any
    indexer: IndexerState
    topk_positions: Any = None
    error_count: Any = None
    before: Optional[Callable[[], None]] = None
    after: Optional[Callable[[], None]] = None


# (adapter, positions, hidden_states) -> StepInputs, or None for the stock forward.
StepInputsSource = Callable[["DsaStageAdapter", Any, Any], Optional[StepInputs]]


def _engine_tensor(value: Any, context: Any) -> Any:
    """A cache as the forward context holds it: a tensor, or (older vLLM) a
    list of one tensor per virtual engine."""
    if isinstance(value, (list, tuple)):
        return value[getattr(context, "virtual_engine", 0)]
    return value


def pooled_key_view(k_cache: Any) -> Any:
    """vLLM's indexer K cache [blocks, pools, 132] uint8 (DeepSeek-V3.2's:
    [blocks, block_size, 132], a key per token) as the stage's 2-D [blocks,
    pools * 132] (a view: raises where the pools of a block are not
    contiguous); a 2-D cache as it is."""
    if len(k_cache.shape) == 3:
        return k_cache.view(k_cache.shape[0], k_cache.shape[1] * k_cache.shape[2])
    return k_cache


def vllm_step_inputs(adapter: "DsaStageAdapter", positions: Any, hidden_states: Any) -> Optional[StepInputs]:
    """The step's inputs from vLLM's forward context, the seed's way: md =
    context.attn_metadata[mla.layer_name] (its num_actual_tokens,
    num_decode_tokens, block_table, req_id_per_token cut to [m]),
    slot_mapping = context.slot_mapping[mla.layer_name] (md.slot_mapping
    where the context has none), kv_cache = mla.kv_cache; the indexer's K
    cache (its 2-D view) and tail ring from INDEXER_STATE_ATTRIBUTES, the
    ring converted by adapter.tail_ring around the stage's forward with the
    tail slots of attn_metadata[indexer.tail_cache.prefix].slot_mapping. No
    topk_positions (a layer that reuses another's selection, skip_topk, is
    refused at install) and no error counter. A RoPE layer's (adapter.rope):
    the indexer's K cache only (no tail ring, no ring conversion).

    Answers None, so that the stock forward runs, when vLLM cannot be
    imported, no forward context is set, the layer has no metadata this
    step (profile and dummy runs), or any of these attributes is absent (said
    once per layer in a RuntimeWarning); it never raises for those. Reads
    attributes and makes views only: the ring's copies run in before/after."""
    try:
        from vllm.forward_context import get_forward_context
    except ImportError:
        return None
    w, mla = adapter.wrapper, adapter.attention
    rope = getattr(adapter, "rope", False)
    try:
        context = get_forward_context()  # asserts that a context is set
        layer_name = mla.layer_name
        metadata = context.attn_metadata[layer_name]
        slot_mappings = getattr(context, "slot_mapping", None)
        slot_mapping = slot_mappings[layer_name] if slot_mappings is not None else metadata.slot_mapping
        state = {field: _resolve(metadata, path) for field, path in METADATA_ATTRIBUTES.items()}
        if rope:  # DeepSeek-V3.2's indexer: its K cache only, no tail ring
            state["k_cache"] = _resolve(w.indexer, INDEXER_STATE_ATTRIBUTES["k_cache"])
        else:
            state.update({field: _resolve(w.indexer, path) for field, path in INDEXER_STATE_ATTRIBUTES.items()})
            tail_metadata = None
            if state["tail_layer_name"] is not _MISSING:
                tail_metadata = context.attn_metadata.get(state["tail_layer_name"])
            state["tail_slots"] = (
                _resolve(tail_metadata, "slot_mapping") if tail_metadata is not None else _MISSING
            )
        missing = [field for field, value in state.items() if value is _MISSING]
        if missing:
            # Not a step the stage can run, but maybe a wrong name in the
            # tables above: say so once per layer, or every step would run
            # stock silently.
            if not adapter.warned_missing_state:
                adapter.warned_missing_state = True
                warnings.warn(
                    f"dsa_decode.vllm: layer {layer_name}: no {', '.join(missing)} found "
                    "(METADATA_ATTRIBUTES / INDEXER_STATE_ATTRIBUTES); its steps run the stock forward",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return None
        m = hidden_states.shape[0]
        token_requests = state["token_requests"][:m]  # vLLM's buffer may be longer; a view
        block_table = state["block_table"]
        inputs = StepInputs(
            num_actual_tokens=metadata.num_actual_tokens,
            num_decode_tokens=metadata.num_decode_tokens,
            token_requests=token_requests,
            slot_mapping=slot_mapping,
            kv_cache=_engine_tensor(mla.kv_cache, context),
            indexer=IndexerState(
                block_table=block_table,
                ring=None,  # unpooled: none; pooled: adapter.tail_ring.rows once before() ran
                k_cache=pooled_key_view(_engine_tensor(state["k_cache"], context)),
            ),
        )
        if rope:
            return inputs
        tail = _engine_tensor(state["tail"], context)
        ring = adapter.tail_ring
        tail_slots = state["tail_slots"]

        def before() -> None:
            ring.prepare(tail, block_table.shape[0])
            ring.gather(tail, token_requests, tail_slots, m)

        def after() -> None:
            ring.scatter(tail, m)

        inputs.before, inputs.after = before, after
        return inputs
    except (AssertionError, AttributeError, KeyError, IndexError, TypeError):
        # AssertionError: no forward context; KeyError: no metadata for the
        # layer; TypeError: attn_metadata None or a list (micro-batches).
        return None


def vllm_batch_invariant() -> bool:
    """vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT set to a nonzero
    integer, read as vLLM reads it): the plan install() takes when given
    none turns the stage's batch_invariant switch on with it."""
    try:
        return int(os.environ.get("VLLM_BATCH_INVARIANT", "0")) != 0
    except ValueError:
        return False


def _o_proj_reduction(o_proj: Any) -> Optional[Callable[[Any], Any]]:
    """What vLLM's RowParallelLinear.forward does after its product: the
    all-reduce of tensor_model_parallel_all_reduce when reduce_results and
    tp_size > 1; None where it does nothing."""
    if not (getattr(o_proj, "reduce_results", False) and int(getattr(o_proj, "tp_size", 1)) > 1):
        return None
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce


class DsaStageAdapter:
    """A dsa_decode.Stage installed as a vLLM MLA wrapper's forward (the
    seed's DsaAttentionStage, running this library's stage). Create it with
    install().

    Attributes: wrapper (w, the MultiHeadLatentAttentionWrapper), attention
    (mla, its MLAAttention), impl, config (the LayerConfig), weights (the
    WEIGHT_NAMES dict), plan (the StagePlan), stage, stock (the wrapper's
    forward before install), step_inputs (the StepInputs source), tail_ring
    (the TailRing conversion's buffers; unused by a RoPE layer, whose
    indexer keeps no ring), reduce (the o_proj reduction, or None),
    indexer_shape (the IndexerShape read from the layer), rope (whether the
    layer is a RoPE one: DeepSeek-V3.2, GLM-5)."""

    def __init__(
        self,
        attention: Any,
        plan: Optional[StagePlan] = None,
        *,
        step_inputs: Optional[StepInputsSource] = None,
        stage_factory: Callable[[LayerConfig, Mapping[str, Any], Optional[StagePlan]], Any] = Stage,
        indexer_keys: Optional[str] = None,
    ):
        w, mla, impl = _parts(attention)
        if isinstance(getattr(w.forward, "__self__", None), DsaStageAdapter):
            raise RuntimeError("a DsaStageAdapter is already installed on this wrapper: uninstall() it first")
        config, weights, plan, shape = _read_layer(w, mla, impl, plan, indexer_keys=indexer_keys)
        self.wrapper, self.attention, self.impl = w, mla, impl
        self.config, self.weights, self.plan, self.indexer_shape = config, weights, plan, shape
        self.rope = config.qk_rope_head_dim > 0
        self.step_inputs = step_inputs if step_inputs is not None else vllm_step_inputs
        self.reduce = _o_proj_reduction(w.o_proj)
        self.tail_ring = TailRing(plan.max_tokens)
        # Created before the forward is swapped: a stage that cannot be made
        # leaves the wrapper as it was. Its argument errors (the library's
        # checks of every weight's shape, dtype and layout: a library that
        # runs one indexer shape names the indexer weights there) come with
        # the layer's indexer shape.
        try:
            self.stage = stage_factory(config, weights, plan)
        except ValueError as error:  # dsa_decode.InvalidArgument
            raise ValueError(
                f"DSA attention stage needs weights and a plan the installed dsa_decode takes "
                f"(this layer: {shape.describe()}): {error}"
            ) from error
        self.stock = w.forward
        # The wrapper's own attribute, if it had one, comes back on uninstall;
        # else the class's forward shows through again.
        self._had_own_forward = "forward" in getattr(w, "__dict__", {})
        # vllm_step_inputs says once per layer when the engine's state is not
        # where the tables look for it.
        self.warned_missing_state = False
        w.forward = self.forward

    @property
    def installed(self) -> bool:
        """Whether the wrapper's forward is this adapter's."""
        return getattr(self.wrapper.forward, "__self__", None) is self

    def uninstall(self) -> None:
        """Puts the stock forward back on the wrapper (a no-op when not
        installed). RuntimeError if another forward was installed over this
        one since: uninstall that first."""
        if not self.installed:
            if self.wrapper.forward == self.stock:
                return
            raise RuntimeError("the wrapper's forward was replaced after this adapter's: uninstall that first")
        if self._had_own_forward:
            self.wrapper.forward = self.stock
        else:
            del self.wrapper.forward

    def forward(self, positions: Any, hidden_states: Any, llama_4_scaling: Any = None) -> Any:
        """The wrapper's forward: positions [m] int64, hidden_states [m, D]
        BF16 -> [m, D] BF16, o_proj's output (all-reduced as vLLM's o_proj
        does when TP > 1).

        Runs the stock forward, as the seed does, when llama_4_scaling is
        given, when step_inputs answers None (no forward context or
        metadata: profile and dummy runs), or when the stage does not support
        the step (not a pure decode step of 1..plan.max_tokens tokens: a
        prefill, a mixed batch, a padded batch, m > plan.max_tokens). Otherwise the fused
        path writes a new [m, D] tensor (hidden_states.new_empty: PyTorch's
        caching allocator, which a CUDA graph capture serves from its pool)
        and the step's KV cache and indexer entries. positions go to the
        stage as given (int64, contiguous: its checks name anything else);
        its errors (dsa_decode.InvalidArgument, a ValueError, and the others)
        are raised, not turned into a stock step."""
        if llama_4_scaling is not None:
            return self.stock(positions, hidden_states, llama_4_scaling)
        inputs = self.step_inputs(self, positions, hidden_states)
        m = hidden_states.shape[0]
        if inputs is None or not self.stage.supports(m, inputs.num_actual_tokens, inputs.num_decode_tokens):
            return self.stock(positions, hidden_states, llama_4_scaling)
        if inputs.before is not None:
            inputs.before()
        indexer = inputs.indexer
        if indexer.ring is None and not self.rope:  # vllm_step_inputs: the converted ring, ready now
            indexer = IndexerState(indexer.block_table, self.tail_ring.rows, indexer.k_cache)
        out = hidden_states.new_empty((m, self.config.hidden_size))
        self.stage.forward(
            StepArgs(
                hidden=hidden_states,
                positions=positions,
                token_requests=inputs.token_requests,
                slot_mapping=inputs.slot_mapping,
                kv_cache=inputs.kv_cache,
                indexer=indexer,
                out=out,
                topk_positions=inputs.topk_positions,
                error_count=inputs.error_count,
            )
        )
        if inputs.after is not None:
            inputs.after()
        return self.reduce(out) if self.reduce is not None else out


def install(
    attention: Any,
    plan: Optional[StagePlan] = None,
    *,
    step_inputs: Optional[StepInputsSource] = None,
    stage_factory: Callable[[LayerConfig, Mapping[str, Any], Optional[StagePlan]], Any] = Stage,
    indexer_keys: Optional[str] = None,
) -> DsaStageAdapter:
    """Installs a dsa_decode.Stage as the forward of vLLM's MLA wrapper
    ``attention.mla_attn`` and returns the adapter (adapter.uninstall()
    undoes it).

    attention: the glm5next DSA layer's attention module (vLLM's
    Glm5NextMLAAttention: w = attention.mla_attn, mla = w.mla_attn, impl =
    mla.impl). Checks as the seed's DsaAttentionStage does (a fused q/kv
    a-norm, NoPE, its own indexer, no gate or DCP query, an FP8 KV cache, no
    padding or PCP, no HiSparse, a column-major W_UK), with the backend check
    widened to the backends whose flat FP8 cache the stage reads
    (KV_CACHE_BACKENDS: FLASHINFER_MLA_SPARSE_SM90, vLLM's choice on Hopper,
    and the seed's FLASHINFER_MLA_SPARSE), plus no index group, an o_proj
    without bias, the indexer's config fields, and the indexer's shape
    (heads, pool, top-k from the model config; ring and block size from
    vLLM's caches) asked of the installed library (its StagePlan check).
    Any failure, and any absent weight or attribute, raises ValueError("DSA
    attention stage needs ...") naming all of them; the stage's own argument
    errors (dsa_decode.InvalidArgument: a weight's shape, dtype or layout)
    are raised as ValueError("DSA attention stage needs weights and a plan
    the installed dsa_decode takes (this layer: <its indexer shape>): <the
    library's message>"). Either way the wrapper is left as it was.

    plan: the dsa_decode.StagePlan (None: the defaults, the fastest paths
    within the numerics contract, max_tokens 16, with the layer's ring,
    block size and max_model_len, and batch_invariant on when vLLM runs
    batch invariant: vllm_batch_invariant()); a plan given must carry the
    layer's ring and block size. The stage allocates its workspace now
    (call install outside a capture). step_inputs: where each step's engine
    tensors come from (None: vllm_step_inputs, vLLM's forward context); it
    answers None for a step that must run stock. stage_factory: what
    creates the stage from (config, weights, plan), dsa_decode.Stage; tests
    pass one that needs no GPU.

    A RoPE layer (DeepSeek-V3.2, GLM-5: vLLM's DeepseekV2MLAAttention, the
    same attention = w.mla_attn parts): checked as above but for "NoPE",
    the cache dtype and the backend, which become 64 RoPE dims with both
    rotaries (w.rotary_emb, w.indexer_rope_emb, each mapped into a
    dsa_decode.RopeConfig by rope_config_of, or named), kv_cache_dtype
    "fp8_ds_mla" and ROPE_KV_CACHE_BACKENDS; the indexer is DeepSeek-V3.2's
    (index_n_heads, index_topk, index_head_dim 128; no pools, no ring; its K
    cache [blocks, block_size, 132]). indexer_keys: the basis of the keys
    the engine's prefill writes into the indexer's K cache, which the
    stage's decode steps score: "hadamard" (ROPE_INDEXER_KEYS) is the only
    one the stage runs; without it a RoPE layer is refused, naming it
    (vLLM 0.33's Indexer writes unrotated keys). Not read for NoPE layers."""
    return DsaStageAdapter(
        attention, plan, step_inputs=step_inputs, stage_factory=stage_factory, indexer_keys=indexer_keys
    )


__all__ = [
    "CONFIG_ATTRIBUTES",
    "DsaStageAdapter",
    "INDEXER_CONFIG_ATTRIBUTES",
    "INDEXER_STATE_ATTRIBUTES",
    "INDEXER_WEIGHT_ATTRIBUTES",
    "IndexerShape",
    "KV_CACHE_BACKENDS",
    "LIBRARY_INDEXER_FIELDS",
    "ROPE_INDEXER_CONFIG_ATTRIBUTES",
    "ROPE_INDEXER_KEYS",
    "ROPE_KV_CACHE_BACKENDS",
    "ROPE_KV_CACHE_DTYPE",
    "ROPE_UNREAD_WEIGHTS",
    "ROTARY_CLASSES",
    "METADATA_ATTRIBUTES",
    "StepInputs",
    "StepInputsSource",
    "TailRing",
    "WEIGHT_ATTRIBUTES",
    "install",
    "library_indexer_fields",
    "pooled_key_view",
    "read_layer",
    "rope_config_of",
    "vllm_batch_invariant",
    "vllm_step_inputs",
    "vllm_tail_ring",
]
