"""The stage installed on a vLLM MLA wrapper, as the seed's DsaAttentionStage is.

``install(attention)`` takes a DSA layer's attention module as vLLM builds it
and names its parts as the seed does::

    w = attention.mla_attn       # the MultiHeadLatentAttentionWrapper
    mla = w.mla_attn             # its MLAAttention (KV cache, W_UK_T, W_UV, scales)
    impl = mla.impl              # the attention backend's implementation

It runs the seed's checks with vLLM's attribute names, reads the layer's
configuration and weights (used in place, never copied), creates a
dsa_decode.Stage and installs the adapter's forward as ``w.forward``, the stock
forward kept for every step the stage does not run (``uninstall()`` puts it
back). The attribute names live in the tables below: WEIGHT_ATTRIBUTES and
CONFIG_ATTRIBUTES are vLLM's public ones; INDEXER_WEIGHT_ATTRIBUTES,
METADATA_ATTRIBUTES and INDEXER_STATE_ATTRIBUTES are this adapter's contract
with the engine where vLLM has no public name (the glm5next indexer's), and
the place to change them.

vLLM is not a dependency: nothing here imports it except vllm_step_inputs,
which reads its forward context when called, and nothing imports PyTorch (the
output is allocated with ``hidden_states.new_empty``).

The adapter's forward is plain Python calling the extension: run the model
eagerly, or in CUDA graphs captured after each step size ran once uncaptured
(dsa_decode.Stage's rule). Dynamo breaks its graph at this call; a model
compiled whole would call torch.ops.dsa_decode.stage_forward instead
(dsa_decode.torch_ops, with register_stage(adapter.stage)).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .ops import IndexerState
from .stage import LayerConfig, Stage, StagePlan, StepArgs

# The layer's weights, by dsa_decode.WEIGHT_NAMES key: vLLM's attribute paths
# from w (the wrapper) and mla (its MLAAttention). W_UV is passed as vLLM holds
# it, where the seed made a contiguous copy: the stage checks its strides and
# runs value-up on it in place, so the copy (2 MiB a layer at TP8, 16 MiB at
# TP1) is gone.
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

# The glm5next indexer's weights, by WEIGHT_NAMES key: attribute paths from
# w.indexer. vLLM publishes no names for this indexer; these are the
# adapter's contract with the engine's indexer module (change them here, in
# one place, if the engine names them otherwise). A missing one is named in
# install's ValueError.
INDEXER_WEIGHT_ATTRIBUTES: Dict[str, str] = {
    "index_wq_b": "wq_b.weight",  # [32 * 128, Q] BF16
    "index_wk": "wk.weight",  # [128, D] BF16
    "index_weights_proj": "weights_proj.weight",  # [32, D] BF16
    "index_compress_gate": "compress_gate.weight",  # [128, D] BF16
    "index_k_norm_weight": "k_norm.weight",  # [128] f32
    "index_k_norm_bias": "k_norm.bias",  # [128] f32
    "index_ape": "ape",  # [4, 128] f32
}

# The LayerConfig's sizes and scales: vLLM's attribute paths. softmax_scale is
# the MLAAttention's `scale` (the scores' scale the attention backend
# applies, glm5next: 256^-0.5), rms_norm_eps the q a-norm's variance_epsilon
# (vLLM's RMSNorm; the kv a-norm has the same). hidden_size is read from
# fused_qkv_a_proj's weight ([Q + L, D]: its dim 1), the wrapper having no
# attribute of its own for it.
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

# vllm_step_inputs: the step's tensors on the layer's attention metadata md =
# forward_context.attn_metadata[mla.layer_name]. vLLM's sparse MLA metadata
# (FlashInferMLASparseMetadata, FlashMLASparseMetadata) has both: the block
# table [requests, width] int32 and each token's row of it, [tokens] int32.
METADATA_ATTRIBUTES: Dict[str, str] = {
    "block_table": "block_table",
    "token_requests": "req_id_per_token",
}

# vllm_step_inputs: the indexer's paged state on w.indexer. ASSUMPTIONS of
# this adapter (vLLM is not installable where it was written, and the
# glm5next indexer's state has no public name): the ring of tail tokens
# [requests, 2, RING, 128] BF16 as `ring_cache`, and the pooled-key cache
# [blocks, block_size / 4 * 132] uint8 as the `kv_cache` tensor of the
# indexer's cache layer `k_cache` (vLLM's DeepseekV32IndexerCache holds it
# so). A missing one makes vllm_step_inputs answer None: the stock forward
# runs.
INDEXER_STATE_ATTRIBUTES: Dict[str, str] = {
    "ring": "ring_cache",
    "k_cache": "k_cache.kv_cache",
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


# The seed's checks, in its order and with its words, less its
# isinstance(impl, FlashInferMLASparseImpl): the stage runs its own attention
# kernel on the FP8 cache, so the backend vLLM picked does not matter to it.
# Each: (what the stage needs, the condition as vLLM's attributes say it, the
# condition as code over w, mla and impl).
_CHECKS: Tuple[Tuple[str, str, Callable[[Any, Any, Any], bool]], ...] = (
    (
        "a fused q/kv a-norm",
        "w.q_lora_rank is not None and w.fuse_qkv_rmsnorm",
        lambda w, mla, impl: w.q_lora_rank is not None and bool(w.fuse_qkv_rmsnorm),
    ),
    (
        "NoPE",
        "w.rotary_emb is None and w.qk_rope_head_dim == 0",
        lambda w, mla, impl: w.rotary_emb is None and w.qk_rope_head_dim == 0,
    ),
    (
        "its own indexer",
        "w.indexer is not None and not w.skip_topk",
        lambda w, mla, impl: w.indexer is not None and not w.skip_topk,
    ),
    (
        "no gate or DCP query",
        "w.g_proj is None and not w.dcp_q_replicate",
        lambda w, mla, impl: w.g_proj is None and not w.dcp_q_replicate,
    ),
    (
        "an FP8 KV cache",
        "str(mla.kv_cache_dtype) in ('fp8', 'fp8_e4m3')",
        lambda w, mla, impl: str(mla.kv_cache_dtype) in ("fp8", "fp8_e4m3"),
    ),
    (
        "no padding or PCP",
        "mla.q_pad_num_heads is None and not mla.use_pcp",
        lambda w, mla, impl: mla.q_pad_num_heads is None and not mla.use_pcp,
    ),
    (
        "no HiSparse",
        "mla.hisparse_cache is None and impl.dcp_world_size == 1",
        lambda w, mla, impl: mla.hisparse_cache is None and impl.dcp_world_size == 1,
    ),
    (
        "a column-major W_UK",
        "mla.W_UK_T.stride(-1) == 1",
        lambda w, mla, impl: mla.W_UK_T.stride(-1) == 1,
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
    missing = []
    for what, condition, holds in _CHECKS:
        try:
            if not holds(w, mla, impl):
                missing.append(f"{what} ({condition})")
        except AttributeError as error:
            # An engine version without one of the names: say which, as a
            # failed requirement, rather than stop at the first.
            missing.append(f"{what} ({condition}: {error})")
    return missing


def read_layer(attention: Any) -> Tuple[LayerConfig, Dict[str, Any]]:
    """The layer's dsa_decode.LayerConfig and weights (a dict with the
    WEIGHT_NAMES keys: the wrapper's own tensors, not copies) from vLLM's
    attention module, after the seed's checks.

    Raises ValueError("DSA attention stage needs " + every missing
    requirement): each failed check with its condition in vLLM's attribute
    names, and each configuration attribute or weight that is absent (the
    indexer's by their INDEXER_WEIGHT_ATTRIBUTES path). Creates nothing on a
    device; the stage's own creation checks the tensors (shapes, dtypes,
    strides) and names what is wrong."""
    return _read_layer(*_parts(attention))


def _read_layer(w: Any, mla: Any, impl: Any) -> Tuple[LayerConfig, Dict[str, Any]]:
    roots = {"w": w, "mla": mla}
    missing = _missing_requirements(w, mla, impl)

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
        weights[name] = lookup(path)
        if weights[name] is _MISSING:
            missing.append(f"the weight {path} ({name})")
    indexer = getattr(w, "indexer", None)
    if indexer is not None:  # else the indexer check failed: its weights go unlisted
        for name, path in INDEXER_WEIGHT_ATTRIBUTES.items():
            weights[name] = _resolve(indexer, path)
            if weights[name] is _MISSING:
                missing.append(f"the indexer weight w.indexer.{path} ({name})")
    qkv_weight = weights["fused_qkv_a_proj"]
    if qkv_weight is not _MISSING and len(getattr(qkv_weight, "shape", ())) != 2:
        missing.append("a 2-D w.fused_qkv_a_proj.weight [q_lora_rank + kv_lora_rank, hidden]")
    if missing:
        raise ValueError("DSA attention stage needs " + ", ".join(missing))

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
        fuse_qkv_rmsnorm=bool(w.fuse_qkv_rmsnorm),
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
    )
    return config, weights


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
    block_size / 4 * 132] uint8, 2-D: an engine that holds it as [blocks,
    pools, 132] passes its 2-D view). topk_positions: optional [m, 2176] int32
    request-local rows to use instead of running the indexer (MTP draft steps
    1+); error_count: an optional int32 CUDA counter of untrusted device
    values met."""

    num_actual_tokens: int
    num_decode_tokens: int
    token_requests: Any
    slot_mapping: Any
    kv_cache: Any
    indexer: IndexerState
    topk_positions: Any = None
    error_count: Any = None


# (adapter, positions, hidden_states) -> StepInputs, or None for the stock forward.
StepInputsSource = Callable[["DsaStageAdapter", Any, Any], Optional[StepInputs]]


def _engine_tensor(value: Any, context: Any) -> Any:
    """A cache as the forward context holds it: a tensor, or (older vLLM) a
    list of one tensor per virtual engine."""
    if isinstance(value, (list, tuple)):
        return value[getattr(context, "virtual_engine", 0)]
    return value


def vllm_step_inputs(adapter: "DsaStageAdapter", positions: Any, hidden_states: Any) -> Optional[StepInputs]:
    """The step's inputs from vLLM's forward context, the seed's way: md =
    context.attn_metadata[mla.layer_name] (its num_actual_tokens,
    num_decode_tokens), slot_mapping = context.slot_mapping[mla.layer_name]
    (md.slot_mapping where the context has none), kv_cache = mla.kv_cache.

    Beyond the seed (it called vLLM's own indexer and attention, which found
    these themselves): the block table and each token's row of it from md's
    METADATA_ATTRIBUTES (vLLM's sparse MLA metadata names:
    md.block_table, md.req_id_per_token, the latter cut to [m]), and the
    indexer's ring and pooled-key cache from INDEXER_STATE_ATTRIBUTES on
    w.indexer, which are ASSUMED names (see that table). No
    topk_positions (a layer that reuses another's selection, skip_topk, is
    refused at install) and no error counter.

    Answers None, so that the stock forward runs, when vLLM cannot be
    imported, no forward context is set, the layer has no metadata this
    step (profile and dummy runs), or any of these attributes is absent;
    it never raises for those. Reads attributes only: no device work."""
    try:
        from vllm.forward_context import get_forward_context
    except ImportError:
        return None
    w, mla = adapter.wrapper, adapter.attention
    try:
        context = get_forward_context()  # asserts that a context is set
        layer_name = mla.layer_name
        metadata = context.attn_metadata[layer_name]
        slot_mappings = getattr(context, "slot_mapping", None)
        slot_mapping = slot_mappings[layer_name] if slot_mappings is not None else metadata.slot_mapping
        state = {field: _resolve(metadata, path) for field, path in METADATA_ATTRIBUTES.items()}
        state.update({field: _resolve(w.indexer, path) for field, path in INDEXER_STATE_ATTRIBUTES.items()})
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
        return StepInputs(
            num_actual_tokens=metadata.num_actual_tokens,
            num_decode_tokens=metadata.num_decode_tokens,
            token_requests=state["token_requests"][:m],  # vLLM's buffer may be longer; a view
            slot_mapping=slot_mapping,
            kv_cache=_engine_tensor(mla.kv_cache, context),
            indexer=IndexerState(
                block_table=state["block_table"],
                ring=state["ring"],
                k_cache=_engine_tensor(state["k_cache"], context),
            ),
        )
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


class DsaStageAdapter:
    """A dsa_decode.Stage installed as a vLLM MLA wrapper's forward (the
    seed's DsaAttentionStage, running this library's stage). Create it with
    install().

    Attributes: wrapper (w, the MultiHeadLatentAttentionWrapper), attention
    (mla, its MLAAttention), impl, config (the LayerConfig), weights (the
    WEIGHT_NAMES dict: the wrapper's tensors), stage, stock (the wrapper's
    forward before install), step_inputs (the StepInputs source)."""

    def __init__(
        self,
        attention: Any,
        plan: Optional[StagePlan] = None,
        *,
        step_inputs: Optional[StepInputsSource] = None,
        stage_factory: Callable[[LayerConfig, Mapping[str, Any], Optional[StagePlan]], Any] = Stage,
    ):
        w, mla, impl = _parts(attention)
        config, weights = _read_layer(w, mla, impl)
        if isinstance(getattr(w.forward, "__self__", None), DsaStageAdapter):
            raise RuntimeError("a DsaStageAdapter is already installed on this wrapper: uninstall() it first")
        self.wrapper, self.attention, self.impl = w, mla, impl
        self.config, self.weights = config, weights
        self.step_inputs = step_inputs if step_inputs is not None else vllm_step_inputs
        if plan is None:
            plan = StagePlan(batch_invariant=vllm_batch_invariant())
        # Created before the forward is swapped: a stage that cannot be made
        # leaves the wrapper as it was.
        self.stage = stage_factory(config, weights, plan)
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
        BF16 -> [m, D] BF16, o_proj's output.

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
        out = hidden_states.new_empty((m, self.config.hidden_size))
        self.stage.forward(
            StepArgs(
                hidden=hidden_states,
                positions=positions,
                token_requests=inputs.token_requests,
                slot_mapping=inputs.slot_mapping,
                kv_cache=inputs.kv_cache,
                indexer=inputs.indexer,
                out=out,
                topk_positions=inputs.topk_positions,
                error_count=inputs.error_count,
            )
        )
        return out


def install(
    attention: Any,
    plan: Optional[StagePlan] = None,
    *,
    step_inputs: Optional[StepInputsSource] = None,
    stage_factory: Callable[[LayerConfig, Mapping[str, Any], Optional[StagePlan]], Any] = Stage,
) -> DsaStageAdapter:
    """Installs a dsa_decode.Stage as the forward of vLLM's MLA wrapper
    ``attention.mla_attn`` and returns the adapter (adapter.uninstall()
    undoes it).

    attention: the DSA layer's attention module (w = attention.mla_attn,
    mla = w.mla_attn, impl = mla.impl, vLLM's names). Checks as the seed's
    DsaAttentionStage does (a fused q/kv a-norm, NoPE, its own indexer, no
    gate or DCP query, an FP8 KV cache, no padding or PCP, no HiSparse, a
    column-major W_UK), less its FlashInferMLASparseImpl check: the stage
    runs its own attention on the FP8 cache, whatever backend vLLM chose.
    Any failure, and any absent weight or attribute, raises ValueError("DSA
    attention stage needs ...") naming all of them; the wrapper is left as it
    was. The weights are used in place (W_UV too, without the seed's copy),
    so they must stay where they are while the stage lives.

    plan: the dsa_decode.StagePlan (None: the defaults, the fastest paths
    within the numerics contract, max_tokens 16, with batch_invariant on
    when vLLM runs batch invariant: vllm_batch_invariant()); the stage
    allocates its workspace now (call install outside a capture).
    step_inputs: where each step's engine tensors come from (None:
    vllm_step_inputs, vLLM's forward context); it answers None for a step
    that must run stock. stage_factory: what creates the stage from (config,
    weights, plan), dsa_decode.Stage; tests pass one that needs no GPU."""
    return DsaStageAdapter(attention, plan, step_inputs=step_inputs, stage_factory=stage_factory)


__all__ = [
    "CONFIG_ATTRIBUTES",
    "DsaStageAdapter",
    "INDEXER_STATE_ATTRIBUTES",
    "INDEXER_WEIGHT_ATTRIBUTES",
    "METADATA_ATTRIBUTES",
    "StepInputs",
    "StepInputsSource",
    "WEIGHT_ATTRIBUTES",
    "install",
    "read_layer",
    "vllm_batch_invariant",
    "vllm_step_inputs",
]
