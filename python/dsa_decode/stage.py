"""The DSA attention stage (stage.h): one decode step of a DSA layer's
attention half, hidden states in and o_proj's output out."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Optional

from . import _C
from ._C import InvalidArgument
from ._tensors import fp8_view, plain, stream_of
from .ops import IndexerPlan, IndexerState, indexer_ring_for

_ABSENT = object()

MAX_TOKENS = 16

# The weights a stage takes (DsaLayerWeights), BF16 unless noted; nn.Linear's
# [out, in] layout for the projections.
WEIGHT_NAMES = (
    "fused_qkv_a_proj",  # [Q + L, D]
    "q_a_norm",  # [Q]
    "kv_a_norm",  # [L]
    "q_b_proj",  # [H * P, Q]
    "w_uk_t",  # [H, P, L], L contiguous (vLLM's W_UK_T)
    "w_uv",  # [H, L, V], V contiguous (vLLM's W_UV)
    "o_proj",  # [D, H * V]
    "q_scale",  # [1] f32 (the attention's _q_scale)
    "k_scale",  # [1] f32 (_k_scale)
    "index_wq_b",  # [HI * 128, Q] (HI = StagePlan.indexer_heads)
    "index_wk",  # [128, D]
    "index_weights_proj",  # [HI, D]
    "index_compress_gate",  # [128, D]
    "index_k_norm_weight",  # [128] f32
    "index_k_norm_bias",  # [128] f32
    "index_ape",  # [S, 128] f32 (S = StagePlan.indexer_pool)
)

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
    construction)."""

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

    def __post_init__(self):
        _C.check_eps(self.rms_norm_eps, "rms_norm_eps")


def layer_config(preset: str = "glm5next", tp: int = 1, rms_norm_eps: float = 1e-6) -> LayerConfig:
    """The configuration vLLM builds for a preset's layer on one of tp ranks
    (presets: glm5next, glm5, dsv32; only glm5next passes the stage's checks)."""
    return LayerConfig(**_C.layer_config(preset, tp, rms_norm_eps))


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

    def indexer_plan(self) -> IndexerPlan:
        """The plan the caller's indexer state, workspace and prefill use
        (its row_width, page_bytes, ... are the state's and rows' shapes)."""
        return IndexerPlan(
            self.max_tokens,
            self.max_context,
            self.ring,
            self.block_size,
            self.indexer_logits,
            self.indexer_heads,
            self.indexer_pool,
            self.indexer_topk,
        )

    @classmethod
    def from_model_config(cls, config: Any, *, draft_tokens: int = 0, **fields) -> "StagePlan":
        """A plan with the indexer shape of a model config: a Hugging Face
        config.json's dict or a transformers config object (its
        index_n_heads, index_kpool, index_topk; index_head_dim must be 128),
        RING for 1 + draft_tokens tokens of a request per step
        (indexer_ring_for), and `fields` for the rest (an explicit
        indexer_heads / indexer_pool / indexer_topk / ring overrides the
        config). Raises InvalidArgument naming every field that is missing,
        not an int, or unsupported, in one message."""
        def get(name):
            if isinstance(config, Mapping):
                return config.get(name, _ABSENT)
            return getattr(config, name, _ABSENT)

        values, problems, missing = {}, [], []
        for field, name in list(INDEXER_CONFIG_FIELDS.items()) + [("head_dim", "index_head_dim")]:
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
            if field in values and values[field] not in allowed:
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
    int64 (the step's KV slots; negative or t >= n: not written); kv_cache
    [blocks, block_size, L] FP8 e4m3; indexer: the IndexerState (its block
    table is the KV cache's too); out [m, D] BF16. topk_positions: optional
    [m, W] int32 request-local rows (W = plan.indexer_plan().row_width, 2176 at
    the default shape; MTP draft steps 1+): the indexer is
    skipped and these are remapped instead. error_count: an optional int32
    CUDA counter of untrusted device values met."""

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
    row strides multiples of 8, 16-byte aligned): fused_qkv_a_proj [Q + L,
    D], q_a_norm [Q], kv_a_norm [L], q_b_proj [H * P, Q], w_uk_t [H, P, L]
    (L contiguous), w_uv [H, L, V] (V contiguous), o_proj [D, H * V],
    q_scale and k_scale [1] f32, index_wq_b [HI * 128, Q], index_wk [128, D],
    index_weights_proj [HI, D], index_compress_gate [128, D],
    index_k_norm_weight and index_k_norm_bias [128] f32, index_ape [S, 128]
    f32 (HI, S: plan.indexer_heads, plan.indexer_pool). A missing or wrong one is named, with every other, in one
    InvalidArgument.

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
        self._stage = _C.Stage(asdict(config), {name: plain(t) for name, t in weights.items()}, plan._fields())

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
        return self.plan.indexer_plan()

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
        uint8): qkv [m, Q + L], q_c [m, Q], kv_c [m, L], q [m, H, P] BF16;
        q_fp8 [m, H, L] e4m3; index_q [m, HI, 128], index_k [m, 128] BF16,
        head_weights [m, HI] f32, gate [m, 128] BF16; index_logits [m,
        ceil(max_context / S)] f32; topk_positions and slots [m, W] int32
        (HI, S, W: the plan's indexer_heads, indexer_pool, indexer_plan().row_width);
        latent [m, H, L] BF16, lse [m, H] f32, heads [m, H, V] BF16. Read
        them before the next step."""
        return dict(self._stage.intermediates(m))


__all__ = [
    "INDEXER_CONFIG_FIELDS",
    "LayerConfig",
    "MAX_TOKENS",
    "Stage",
    "StagePlan",
    "StepArgs",
    "WEIGHT_NAMES",
    "layer_config",
    "stage_plan_for",
    "supports",
]
