"""The DSA attention stage (stage.h): one decode step of a DSA layer's
attention half, hidden states in and o_proj's output out."""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping, Optional

from . import _C
from ._C import InvalidArgument
from ._tensors import fp8_view, plain, stream_of
from .ops import IndexerPlan, IndexerState, RopeConfig, indexer_ring_for, rope_softmax_scale

_ABSENT = object()

MAX_TOKENS = 16

# Tokens per KV block of DeepSeek-V3.2's layers in vLLM (FlashMLA's and
# DeepGEMM's pages): the block size from_model_config gives an unpooled plan.
V32_BLOCK_SIZE = 64

# The weights a stage takes (DsaLayerWeights), BF16 unless noted; nn.Linear's
# [out, in] layout for the projections. R = qk_rope_head_dim (0 for NoPE).
WEIGHT_NAMES = (
    "fused_qkv_a_proj",  # [Q + L + R, D]: q_c | kv_c | k_pe
    "q_a_norm",  # [Q]
    "kv_a_norm",  # [L]
    "q_b_proj",  # [H * (P + R), Q]: each head [P nope | R rope]
    "w_uk_t",  # [H, P, L], L contiguous (vLLM's W_UK_T)
    "w_uv",  # [H, L, V], V contiguous (vLLM's W_UV)
    "o_proj",  # [D, H * V]
    "q_scale",  # [1] f32 (the attention's _q_scale); NoPE only
    "k_scale",  # [1] f32 (_k_scale); NoPE only
    "index_wq_b",  # [HI * 128, Q] (HI = StagePlan.indexer_heads)
    "index_wk",  # [128, D]
    "index_weights_proj",  # [HI, D]
    "index_compress_gate",  # [128, D]; the pooled (NoPE) indexer only
    "index_k_norm_weight",  # [128] f32
    "index_k_norm_bias",  # [128] f32
    "index_ape",  # [S, 128] f32 (S = StagePlan.indexer_pool); the pooled (NoPE) indexer only
)

# The weights a RoPE layer's stage does not read (its query stays BF16, its
# cache entries hold their own scales, its indexer has no pools): omit them
# or pass anything.
ROPE_UNREAD_WEIGHTS = ("q_scale", "k_scale", "index_compress_gate", "index_ape")

# The Hugging Face config fields of the indexer's shape, by StagePlan field.
INDEXER_CONFIG_FIELDS = {
    "indexer_heads": "index_n_heads",
    "indexer_pool": "index_kpool",
    "indexer_topk": "index_topk",
}


@dataclass
class LayerConfig:
    """What the engine knows of one DSA layer on this rank (DsaLayerConfig;
    vLLM's attribute names in stage.h). The flags are the seed's checks: a
    layer the stage cannot run is refused at creation, every missing
    requirement named. rms_norm_eps must be finite and > 0 (checked at
    construction).

    A RoPE layer (qk_rope_head_dim R = 64: DeepSeek-V3.2, GLM-5) carries
    its two rotaries: rope, the attention's (q_pe and k_pe; vLLM's
    rotary_emb), and indexer_rope, the indexer's (the first R dims of its q
    and k; vLLM's indexer_rope_emb), each a RopeConfig with rope_dim R (a
    mapping of RopeConfig's fields is taken too, so that dataclasses.asdict
    round-trips); rotary_embedding True and kv_cache_dtype "fp8_ds_mla"
    (the 656-byte cache). layer_config("dsv32") and
    LayerConfig.from_model_config fill them."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rms_norm_eps: float
    fuse_qkv_rmsnorm: bool = True
    rotary_embedding: bool = False
    indexer: bool = True
    skip_topk: bool = False
    gate_proj: bool = False
    dcp_query_replicate: bool = False
    kv_cache_dtype: str = "fp8"
    padded_heads: bool = False
    prefill_context_parallel: bool = False
    hisparse_cache: bool = False
    decode_context_parallel_size: int = 1
    rope: Optional[RopeConfig] = None
    indexer_rope: Optional[RopeConfig] = None

    def __post_init__(self):
        _C.check_eps(self.rms_norm_eps, "rms_norm_eps")
        for name in ("rope", "indexer_rope"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                try:
                    value = RopeConfig(**value)
                except InvalidArgument as error:  # names the field: name it within this one
                    raise InvalidArgument(str(error).replace("argument '", f"argument '{name}.", 1)) from None
                except TypeError as error:  # a key RopeConfig does not have
                    raise InvalidArgument(
                        f"invalid argument: argument '{name}': expected RopeConfig's fields, got {dict(value)!r} "
                        f"({error})"
                    ) from None
                setattr(self, name, value)
            if value is not None and not isinstance(value, RopeConfig):
                raise InvalidArgument(
                    f"invalid argument: argument '{name}': expected None or a dsa_decode.RopeConfig, "
                    f"got {type(value).__name__}"
                )
        _C.check_layer_config(self._fields())

    def _fields(self) -> dict:
        # The extension's config dict: the rotaries as RopeConfig's field tuples.
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("rope", "indexer_rope"):
            d[name] = None if d[name] is None else d[name]._fields()
        return d

    @classmethod
    def from_model_config(cls, config: Any, *, tp: int = 1, **overrides) -> "LayerConfig":
        """The layer configuration of a Hugging Face config.json (its dict, or a
        transformers config object; the fields in a "text_config" object where
        it has one) on one of tp ranks, as vLLM builds the layer
        (DeepseekV2MLAAttention, Glm5NextMLAAttention):

        hidden_size, num_attention_heads (/ tp), q_lora_rank, kv_lora_rank,
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rms_norm_eps; with
        qk_rope_head_dim > 0 the rotaries: rope_theta (top level, or in
        rope_parameters), max_position_embeddings, and rope_scaling (or
        rope_parameters) of type "yarn" / "deepseek_yarn" (factor,
        original_max_position_embeddings, beta_fast 32, beta_slow 1, mscale 1,
        mscale_all_dim 0 where absent: vLLM's defaults; vLLM's table rows
        original x factor) or "default" (plain RoPE); the attention's style
        interleaved (vLLM's is_neox_style=False for the MLA), the indexer's
        half-split unless indexer_rope_interleave is true; the softmax scale
        (P + R)^-0.5 x yarn_mscale(factor, mscale_all_dim)^2
        (rope_softmax_scale), kv_cache_dtype "fp8_ds_mla". NoPE
        (qk_rope_head_dim 0): softmax scale P^-0.5, kv_cache_dtype
        "fp8_e4m3". `overrides` replace any field afterwards.

        Raises InvalidArgument naming every missing, mistyped or unsupported
        field (another rope type, a head count tp does not divide) in one
        message."""
        return cls(**{**_layer_fields_from_model_config(config, tp), **overrides})


def _config_getter(config: Any):
    if isinstance(config, Mapping):
        text = config.get("text_config")
        source = text if isinstance(text, Mapping) else config
        return lambda name: source.get(name, _ABSENT)
    text = getattr(config, "text_config", None)
    source = text if text is not None and not isinstance(text, (str, int, float)) else config
    return lambda name: getattr(source, name, _ABSENT)


def _float32(value: float) -> float:
    """The value as the C++ configuration holds it (float)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# vLLM's get_rope defaults for the deepseek_yarn fields a config may leave out.
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def _layer_fields_from_model_config(config: Any, tp: Any) -> dict:
    get = _config_getter(config)
    problems, missing = [], []
    values = {}
    for name in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim"):
        value = get(name)
        if value is _ABSENT or value is None:
            missing.append(name)
        elif not _is_int(value) or value < 0:
            problems.append(f"{name}: expected an int >= 0, got {value!r}")
        else:
            values[name] = value
    eps = get("rms_norm_eps")
    if eps is _ABSENT:
        missing.append("rms_norm_eps")
    elif not _is_number(eps) or eps <= 0:
        problems.append(f"rms_norm_eps: expected a finite value > 0, got {eps!r}")
    if not _is_int(tp) or tp < 1:
        problems.append(f"tp: expected an int >= 1, got {tp!r}")
    elif "num_attention_heads" in values and values["num_attention_heads"] % tp != 0:
        problems.append(f"num_attention_heads: {values['num_attention_heads']} heads do not split over tp = {tp}")
    rope = indexer_rope = None
    R = values.get("qk_rope_head_dim", 0)
    if R > 0:
        rope, indexer_rope = _rotaries_from_model_config(get, R, problems, missing)
    if missing or problems:
        text = (["missing " + ", ".join(missing)] if missing else []) + problems
        raise InvalidArgument(
            f"invalid argument: argument 'config': expected a DSA layer's Hugging Face config, got: {'; '.join(text)}"
        )
    P = values["qk_nope_head_dim"]
    return dict(
        hidden_size=values["hidden_size"],
        num_heads=values["num_attention_heads"] // tp,
        q_lora_rank=values["q_lora_rank"],
        kv_lora_rank=values["kv_lora_rank"],
        qk_nope_head_dim=P,
        qk_rope_head_dim=R,
        v_head_dim=values["v_head_dim"],
        softmax_scale=_float32(rope_softmax_scale(rope, P + R) if rope is not None else (P + R) ** -0.5 if P + R else 0.0),
        rms_norm_eps=_float32(eps),
        rotary_embedding=R > 0,
        kv_cache_dtype="fp8_ds_mla" if R > 0 else "fp8_e4m3",
        rope=rope,
        indexer_rope=indexer_rope,
    )


def _rotaries_from_model_config(get, R: int, problems: list, missing: list):
    """The attention's and the indexer's RopeConfig of a RoPE layer's config
    (vLLM's get_rope over config.rope_parameters), or (None, None) with the
    problems added."""
    parameters = get("rope_parameters")
    scaling = get("rope_scaling")
    source = "rope_scaling"
    if parameters not in (_ABSENT, None):
        if not isinstance(parameters, Mapping):
            problems.append(f"rope_parameters: expected a dict, got {parameters!r}")
            return None, None
        if scaling in (_ABSENT, None):
            scaling, source = parameters, "rope_parameters"
    if scaling in (_ABSENT, None):
        scaling = {}
    elif not isinstance(scaling, Mapping):
        problems.append(f"{source}: expected a dict or null, got {scaling!r}")
        return None, None
    theta = get("rope_theta")
    if theta in (_ABSENT, None) and isinstance(parameters, Mapping):
        theta = parameters.get("rope_theta", _ABSENT)
    max_position = get("max_position_embeddings")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    fields = dict(rope_dim=R)
    ok = True
    if theta in (_ABSENT, None):
        missing.append("rope_theta")
        ok = False
    elif not _is_number(theta) or theta <= 1:
        problems.append(f"rope_theta: expected a finite value > 1, got {theta!r}")
        ok = False
    else:
        fields["theta"] = float(theta)
    if rope_type == "default":
        if max_position in (_ABSENT, None):
            missing.append("max_position_embeddings")
            ok = False
        elif not _is_int(max_position) or max_position < 1:
            problems.append(f"max_position_embeddings: expected an int >= 1, got {max_position!r}")
            ok = False
        else:
            fields["max_position"] = max_position
            fields["original_max_position"] = max_position  # not read without YaRN
    elif rope_type in ("yarn", "deepseek_yarn", "deepseek_llama_scaling"):
        factor = scaling.get("factor", _ABSENT)
        original = scaling.get("original_max_position_embeddings", _ABSENT)
        for name, value, check in (
            ("factor", factor, lambda v: _is_number(v) and v >= 1),
            ("original_max_position_embeddings", original, lambda v: _is_int(v) and v >= 1),
        ):
            if value is _ABSENT or value is None:
                missing.append(f"{source}.{name}")
                ok = False
            elif not check(value):
                problems.append(f"{source}.{name}: expected {'a finite value >= 1' if name == 'factor' else 'an int >= 1'}, got {value!r}")
                ok = False
        for name, default in _YARN_DEFAULTS.items():
            value = scaling.get(name, default)
            if value is None:
                value = default
            if not _is_number(value):
                problems.append(f"{source}.{name}: expected a number, got {value!r}")
                ok = False
            else:
                fields[name] = float(value)
        if ok:
            fields["factor"] = float(factor)
            fields["original_max_position"] = original
            # vLLM's table: original_max_position_embeddings x factor rows.
            fields["max_position"] = int(original * factor)
    else:
        problems.append(
            f"{source}.rope_type: expected 'default', 'yarn' or 'deepseek_yarn' (DeepSeek's YaRN), got {rope_type!r}"
        )
        ok = False
    interleave = get("indexer_rope_interleave")
    if interleave in (_ABSENT, None):
        interleave = False
    elif not isinstance(interleave, bool):
        problems.append(f"indexer_rope_interleave: expected true or false, got {interleave!r}")
        ok = False
    if not ok:
        return None, None
    try:
        attention = RopeConfig(**fields, style="interleaved")
        indexer = RopeConfig(**fields, style="interleaved" if interleave else "half-split")
    except InvalidArgument as error:
        problems.append(f"the rotary: {error}")
        return None, None
    return attention, indexer


def layer_config(preset: str = "glm5next", tp: int = 1, rms_norm_eps: float = 1e-6) -> LayerConfig:
    """The configuration vLLM builds for a preset's layer on one of tp ranks
    (presets: glm5next; the RoPE presets dsv32 and glm5 with their rotaries,
    rope_preset_config's, and kv_cache_dtype "fp8_ds_mla")."""
    fields_ = _C.layer_config(preset, tp, rms_norm_eps)
    for name in ("rope", "indexer_rope"):
        if fields_[name] is not None:
            fields_[name] = RopeConfig(*fields_[name])
    return LayerConfig(**fields_)


@dataclass
class StagePlan:
    """Choices fixed at creation (DsaStagePlan); the workspace is sized from them.

    The defaults are the fastest paths within the numerics contract's bounds
    (head_gemv_sums "tensor-cores", indexer_logits "fp32-accumulation",
    attention_plan "auto"): the same bits on every run, but a token's bits
    may depend on the other tokens of its step. batch_invariant=True is the
    one switch that makes them independent of the batch (vLLM's
    VLLM_BATCH_INVARIANT): it selects every kernel's invariant choice (the
    attention's "batch-invariant" plan, value-up and the projections on the
    fixed-order GEMV kernels at every m), overriding attention_plan,
    value_up_tokens and projection_gemv_tokens on the fused path.

    The indexer's shape, from the model config as vLLM reads it:
    indexer_heads (index_n_heads: 16, 32 or 64), indexer_pool (index_kpool:
    4, 8 or 16), indexer_topk (index_topk: a multiple of the pool, at most
    512 pools); the defaults are glm5next's first shape (32 / 4 / 2048).
    ring is the indexer's RING: the pool, or twice it with draft tokens
    (indexer_ring_for); the default 4 fits the default pool only, so a plan
    of another pool sets it too (from_model_config and stage_plan_for do).

    For experts: head_gemv_sums "seed-order" and indexer_logits "exact" are
    the reproducible opt-ins (bitwise the CPU references); value_up_tokens /
    projection_gemv_tokens: None takes the sets measured on the H200
    (stage.h). Checked at construction: InvalidArgument names a bad field
    (max_tokens 1..16, a choice name, a token count, plan.indexer_heads /
    _pool / _topk, the indexer's plan)."""

    max_tokens: int = MAX_TOKENS
    max_context: int = 131072
    ring: int = 4
    block_size: int = 256
    indexer_heads: int = 32
    indexer_pool: int = 4
    indexer_topk: int = 2048
    batch_invariant: bool = False
    value_up_tokens: Optional[set] = None
    head_gemv_sums: str = "tensor-cores"
    indexer_logits: str = "fp32-accumulation"
    attention_plan: str = "auto"
    indexer_projections_cublaslt: bool = False
    projection_gemv_tokens: Optional[set] = None
    overlap_indexer: bool = True

    def __post_init__(self):
        _C.check_stage_plan(self._fields())

    def _fields(self) -> dict:
        # The extension's plan dict (the token sets: any iterable of ints, or None).
        return asdict(self)

    def indexer_plan(self, config: Optional["LayerConfig"] = None) -> IndexerPlan:
        """The plan the caller's indexer state, workspace and prefill use
        (its row_width, page_bytes, ... are the state's and rows' shapes).
        With a RoPE layer's config: its rotary dims and style too
        (dsa_stage_indexer_plan(config, plan): rope_dims = R, rope_style =
        config.indexer_rope's), the plan indexer_prefill takes with the
        table of config.indexer_rope."""
        rope_dims, rope_style = 0, "half-split"
        if config is not None:
            if not isinstance(config, LayerConfig):
                raise TypeError(f"argument 'config': expected a dsa_decode.LayerConfig, got {type(config).__name__}")
            rope_dims, rope_style = _C.stage_indexer_rope(config._fields(), self._fields())
        return IndexerPlan(
            self.max_tokens,
            self.max_context,
            self.ring,
            self.block_size,
            self.indexer_logits,
            self.indexer_heads,
            self.indexer_pool,
            self.indexer_topk,
            rope_dims,
            rope_style,
        )

    @classmethod
    def from_model_config(cls, config: Any, *, draft_tokens: int = 0, **fields) -> "StagePlan":
        """A plan with the indexer shape of a model config: a Hugging Face
        config.json's dict or a transformers config object (the fields in a
        "text_config" object where it has one): index_n_heads, index_kpool,
        index_topk; index_head_dim must be 128. A config without
        index_kpool whose qk_rope_head_dim is > 0 (DeepSeek-V3.2, GLM-5) has
        DeepSeek-V3.2's unpooled indexer: pool 1, ring 1, block_size 64
        (vLLM's for V3.2) unless given. RING for 1 + draft_tokens tokens of a
        request per step (indexer_ring_for; pool 1 keeps no ring), and
        `fields` for the rest (an explicit indexer_heads / indexer_pool /
        indexer_topk / ring overrides the config). Raises InvalidArgument
        naming every field that is missing, not an int, or unsupported, in
        one message."""
        get = _config_getter(config)

        values, problems, missing = {}, [], []
        rope_dim = get("qk_rope_head_dim")
        unpooled = get("index_kpool") is _ABSENT and _is_int(rope_dim) and rope_dim > 0
        for field, name in list(INDEXER_CONFIG_FIELDS.items()) + [("head_dim", "index_head_dim")]:
            if field == "indexer_pool" and unpooled:
                values[field] = 1
                continue
            value = get(name)
            if value is _ABSENT:
                if field not in fields:
                    missing.append(name)
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                problems.append(f"{name}: expected an int, got {value!r}")
                continue
            values[field] = value
        if values.get("head_dim", 128) != 128:
            problems.append(f"index_head_dim: expected 128, got {values['head_dim']}")
        supported = {"indexer_heads": (16, 32, 64), "indexer_pool": (4, 8, 16)}
        for field, allowed in supported.items():
            if field in values and values[field] not in allowed and not (field == "indexer_pool" and unpooled):
                problems.append(
                    f"{INDEXER_CONFIG_FIELDS[field]}: expected {', '.join(map(str, allowed[:-1]))} or {allowed[-1]}, "
                    f"got {values[field]}"
                )
        if missing or problems:
            text = (["missing " + ", ".join(missing)] if missing else []) + problems
            raise InvalidArgument(f"argument 'config': expected the indexer's shape fields, got: {'; '.join(text)}")
        values.pop("head_dim", None)
        values.update({k: v for k, v in fields.items() if k in INDEXER_CONFIG_FIELDS})
        if "ring" not in fields:
            ring = indexer_ring_for(values["indexer_pool"], 1 + draft_tokens)
            if ring == 0:
                raise InvalidArgument(
                    f"argument 'draft_tokens': expected at most {values['indexer_pool']} draft tokens (a ring of "
                    f"2 * index_kpool), got {draft_tokens}"
                )
            values["ring"] = ring
        if values["indexer_pool"] == 1 and "block_size" not in fields:
            values["block_size"] = V32_BLOCK_SIZE
        rest = {k: v for k, v in fields.items() if k not in INDEXER_CONFIG_FIELDS}
        return cls(**{**values, **rest})


def stage_plan_for(preset: str = "glm5next", **fields) -> StagePlan:
    """The default plan of a preset's layer (dsa_stage_plan_for): its
    indexer shape and RING = its pool; `fields` override any field
    (indexer_heads=16, ring=8, ...)."""
    return StagePlan(**{**_C.preset_indexer_shape(preset), **fields})


def supports(m: int, num_actual_tokens: int, num_decode_tokens: int, max_tokens: int = MAX_TOKENS) -> bool:
    """The seed's supports(): a pure decode step of 1..max_tokens tokens."""
    return _C.stage_supports(max_tokens, m, num_actual_tokens, num_decode_tokens)


@dataclass
class StepArgs:
    """One step's tensors (DsaStepArgs); m = hidden.shape[0].

    hidden [m, D] BF16; positions [m] int64; token_requests [m] int32
    (each token's block-table row, negative = padding); slot_mapping [n]
    int64 (the step's KV slots; negative or t >= n: not written); kv_cache:
    NoPE [blocks, block_size, L] FP8 e4m3, RoPE [blocks, block_size, 656]
    uint8 (DeepSeek-V3.2's entries, sparse_mla_v32.h; an FP8 tensor is taken
    as its bytes); indexer: the IndexerState (its block table is the KV
    cache's too; ring None with the RoPE layers' unpooled indexer); out [m,
    D] BF16. topk_positions: optional [m, W] int32 request-local rows (W =
    stage.indexer_plan().row_width: 2176 at the default shape, 2048 at pool
    1 top-2048; MTP draft steps 1+): the indexer is skipped and these are
    remapped instead. error_count: an optional int32 CUDA counter of
    untrusted device values met."""

    hidden: Any
    positions: Any
    token_requests: Any
    slot_mapping: Any
    kv_cache: Any
    indexer: IndexerState
    out: Any
    topk_positions: Any = None
    error_count: Any = None

    def _args(self):
        return (
            self.hidden,
            self.positions,
            self.token_requests,
            self.slot_mapping,
            fp8_view(self.kv_cache),
            self.indexer.block_table,
            self.indexer.ring,
            self.indexer.k_cache,
            self.out,
            self.topk_positions,
        )


class Stage:
    """A DsaAttentionStage: built once per layer from its configuration and
    weights (used in place, never copied: keep them where they are; the
    stage holds references so they outlive it), its workspace planned and
    allocated at creation (call it outside a graph capture).

    weights: a mapping of WEIGHT_NAMES to tensors, BF16 unless noted,
    nn.Linear's [out, in] layout for the projections (last dim contiguous,
    row strides multiples of 8, 16-byte aligned); R = qk_rope_head_dim (0
    for NoPE): fused_qkv_a_proj [Q + L + R, D], q_a_norm [Q], kv_a_norm
    [L], q_b_proj [H * (P + R), Q], w_uk_t [H, P, L] (L contiguous), w_uv
    [H, L, V] (V contiguous), o_proj [D, H * V], q_scale and k_scale [1]
    f32, index_wq_b [HI * 128, Q], index_wk [128, D], index_weights_proj
    [HI, D], index_compress_gate [128, D], index_k_norm_weight and
    index_k_norm_bias [128] f32, index_ape [S, 128] f32 (HI, S:
    plan.indexer_heads, plan.indexer_pool). A RoPE layer does not read
    ROPE_UNREAD_WEIGHTS (q_scale, k_scale, index_compress_gate, index_ape):
    omit them. A missing or wrong one is named, with every other, in one
    InvalidArgument.

    A RoPE layer (config.rope and config.indexer_rope set: layer_config("dsv32"),
    LayerConfig.from_model_config) takes the unpooled indexer (plan.indexer_pool
    1, ring 1, block_size a multiple of 64: stage_plan_for("dsv32"),
    StagePlan.from_model_config), the 656-byte KV cache, and builds both
    cos/sin tables in its workspace (positions 0..plan.max_context - 1, at
    most config.rope.max_position). indexer_plan() then carries the indexer's
    rotary: prefill the indexer's keys with it and the table of
    config.indexer_rope (rope_cos_sin_table).

    forward(args) runs the fused path, stock_forward(args) the stock engine
    order (the fallback and the baseline); both neither allocate nor
    synchronize and capture into a CUDA graph once each path ran uncaptured
    at the same m. One stream at a time."""

    def __init__(self, config: LayerConfig, weights: Mapping[str, Any], plan: Optional[StagePlan] = None):
        plan = plan if plan is not None else StagePlan()
        unknown = sorted(set(weights) - set(WEIGHT_NAMES))
        if unknown:
            raise ValueError(f"argument 'weights': unknown names {unknown}; expected names from {list(WEIGHT_NAMES)}")
        self.config = config
        self.plan = plan
        # The extension's Stage keeps the arrays it imports for its lifetime.
        if not isinstance(config, LayerConfig):
            raise TypeError(f"argument 'config': expected a dsa_decode.LayerConfig, got {type(config).__name__}")
        self._stage = _C.Stage(config._fields(), {name: plain(t) for name, t in weights.items()}, plan._fields())

    @classmethod
    def from_checkpoint(
        cls,
        path,
        layer: int,
        config: Any = "glm5next",
        plan: Optional[StagePlan] = None,
        *,
        tp: int = 1,
        rank: int = 0,
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        device: Any = "cuda",
    ) -> "Stage":
        """The stage of a Hugging Face checkpoint's layer on this rank:
        load_layer_weights(path, layer, config, plan, tp=, rank=, q_scale=,
        k_scale=, device=) (dsa_decode.checkpoint: the names, dtypes, FP8
        block scales and TP split of `dsa-decode --weights`), its tensors
        moved to `device` (PyTorch), then Stage(config, weights, plan) with
        the loaded config (config.json's rms_norm_eps) and plan (given, or
        the checkpoint's indexer shape). The load's account (files, bytes,
        seconds, eps_source) stays in stage.checkpoint, without the arrays."""
        from .checkpoint import load_layer_weights

        loaded = load_layer_weights(
            path, layer, config, plan, tp=tp, rank=rank, q_scale=q_scale, k_scale=k_scale, device=device
        )
        stage = cls(loaded.config, loaded.weights, loaded.plan)
        stage.checkpoint = replace(loaded, weights={})
        return stage

    @property
    def max_tokens(self) -> int:
        return self._stage.max_tokens

    @property
    def value_up_tokens(self) -> set:
        """The token counts whose value-up runs as head_gemv (cuBLAS's bmm
        otherwise): every m under batch_invariant."""
        return set(self._stage.value_up_tokens)

    def indexer_plan(self) -> IndexerPlan:
        """The indexer plan the stage runs (dsa_stage_indexer_plan(config,
        plan)): the caller's indexer state, workspace and prefill take it; a
        RoPE layer's carries its rope_dims and rope_style."""
        return self.plan.indexer_plan(self.config)

    def supports(self, m: int, num_actual_tokens: int, num_decode_tokens: int) -> bool:
        """A pure decode step of 1..max_tokens tokens: forward may run it."""
        return self._stage.supports(m, num_actual_tokens, num_decode_tokens)

    def forward(self, args: StepArgs, *, stream=None) -> None:
        """The fused path: writes args.out and the step's KV-cache entries (and,
        without topk_positions, the indexer's ring and pools)."""
        self._stage.run(False, *args._args(), args.error_count, stream_of(stream, args.hidden))

    def stock_forward(self, args: StepArgs, *, stream=None) -> None:
        """The same step in the stock engine's order with unfused kernels."""
        self._stage.run(True, *args._args(), args.error_count, stream_of(stream, args.hidden))

    def run_steps(self, args: StepArgs, first: int, count: int, *, stock: bool = False, stream=None) -> None:
        """Launches `count` of the path's steps from `first` (the order of
        step_names), for per-kernel timing; forward is run_steps(args, 0,
        len(step_names(args))). A range that holds some of the indexer's
        steps runs them on the indexer's stream and joins it at the range's
        end, as the C++ run_steps does."""
        if first < 0 or count < 0:
            raise ValueError(f"argument 'first, count': expected non-negative values, got {first}, {count}")
        self._stage.run_steps(stock, first, count, *args._args(), args.error_count, stream_of(stream, args.hidden))

    def step_names(self, args: StepArgs, *, stock: bool = False) -> list:
        """The names of the path's launches for these arguments, in order."""
        return list(self._stage.step_names(stock, *args._args()))

    def intermediates(self, m: int) -> dict:
        """Views of the stage's buffers as the last step left them (DLPack
        arrays: torch.from_dlpack(v) reads them without a copy; FP8 as
        uint8; R = qk_rope_head_dim): qkv [m, Q + L + R], q_c [m, Q], kv_c
        [m, L], q [m, H, P + R] BF16; q_fp8 [m, H, L] e4m3 (NoPE); q_absorbed
        [m, H, L + R] BF16 and k_pe [m, R] BF16, rotated (RoPE:
        rope_absorb's); index_q [m, HI, 128], index_k [m, 128] BF16,
        head_weights [m, HI] f32, gate [m, 128] BF16 (pooled); index_logits [m,
        ceil(max_context / S)] f32; indexer_workspace [bytes] uint8 (the
        indexer's workspace: q codes, folded weights, logits at
        indexer_plan().workspace_layout()'s offsets); topk_positions and
        slots [m, W] int32 (HI, S, W: the plan's indexer_heads,
        indexer_pool, indexer_plan().row_width);
        latent [m, H, L] BF16, lse [m, H] f32, heads [m, H, V] BF16. A view
        the layer's kind does not use is None. Read them before the next
        step."""
        return dict(self._stage.intermediates(m))


__all__ = [
    "INDEXER_CONFIG_FIELDS",
    "LayerConfig",
    "MAX_TOKENS",
    "ROPE_UNREAD_WEIGHTS",
    "V32_BLOCK_SIZE",
    "Stage",
    "StagePlan",
    "StepArgs",
    "WEIGHT_NAMES",
    "layer_config",
    "stage_plan_for",
    "supports",
]
