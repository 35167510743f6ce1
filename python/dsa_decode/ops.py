"""The library's kernels, one function each.

Every tensor is any DLPack array on a CUDA device (PyTorch, CuPy, JAX), used
in place: nothing is copied, nothing allocated, nothing synchronized, so
every call can be captured in a CUDA graph (torch.cuda.graph) once the same
call ran outside a capture (the first launch of a kernel on a device sets its
shared-memory limits). Outputs are caller-owned. Shapes below use the
headers' names (include/dsa_decode/*.h has each contract in full: the
bounds, the roundings, the untrusted device values):

  m tokens, H heads, Q q_lora_rank, L kv_lora_rank (512), P qk_nope_head_dim,
  V v_head_dim, K top-k entries per row.

FP8 e4m3 arguments take torch.float8_e4m3fn tensors or their uint8 views.
``stream``: None launches on PyTorch's current stream of the first tensor
argument's device (the legacy default stream when that is not a CUDA torch
tensor); an int is a cudaStream_t. A bad argument raises dsa_decode.InvalidArgument (a
ValueError) with the C++ check's message, which names the argument, what was
expected and what was given.

Choices (numerics contract v2): every default is the kernel's fastest path
within the contract's bounds (head_gemv's sums "tensor-cores", the indexer's
logits "fp32-accumulation", the attention's plan "auto"); the same inputs
give the same bits on every run. The opt-ins: "seed-order" sums and "exact"
logits (bitwise the CPU references, for debugging and golden tests) and the
"batch-invariant" attention plan (a token's bits independent of the batch
around it; StagePlan(batch_invariant=True) selects every kernel's invariant
choice at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from . import _C
from ._tensors import fp8_view, plain, stream_of

# The string choices, from the C++ tables (include/dsa_decode/choices.h); the
# first of each is the default.
HEAD_GEMV_SUMS = _C.HEAD_GEMV_SUMS  # head_gemv's sums and StagePlan.head_gemv_sums
ATTENTION_PLANS = _C.ATTENTION_PLANS  # sparse_mla's plan and StagePlan.attention_plan
INDEXER_LOGITS = _C.INDEXER_LOGITS  # IndexerPlan.logits and StagePlan.indexer_logits
INDEXER_ROPE_STYLES = _C.INDEXER_ROPE_STYLES  # IndexerPlan.rope_style: ROPE_STYLES' names, its default first


def qkv_rmsnorm(qkv, q_weight, kv_weight, eps: float, q_out, kv_out, *, stream=None) -> None:
    """Both RMSNorms of the a-projection in one launch (norm.h).

    qkv [m, Q + L] BF16 (dim 1 contiguous, row pitch a multiple of 8),
    q_weight [Q] and kv_weight [L] BF16, eps finite and > 0; writes q_out
    [m, Q] and kv_out [m, L] BF16 (contiguous, apart from qkv). Within 1
    BF16 ulp of reference.qkv_rmsnorm (rsqrt.approx), the same bits on every
    run."""
    _C.qkv_rmsnorm(qkv, plain(q_weight), plain(kv_weight), float(eps), q_out, kv_out, stream_of(stream, qkv))


@dataclass
class KvCacheWrite:
    """The KV-cache write head_gemv's absorb launch does on the side
    (concat_and_cache_mla): kv [m, L] BF16 into cache [blocks, block_size,
    L] FP8 e4m3 at slot_mapping [n] int64 (negative, or t >= n: skipped),
    divided by k_scale [1] f32. error_count: an optional int32 CUDA counter
    of slots past the cache's capacity (skipped)."""

    kv: Any
    cache: Any
    slot_mapping: Any
    k_scale: Any
    error_count: Any = None


def head_gemv(
    x,
    weight,
    out,
    *,
    scale=None,
    cache: Optional[KvCacheWrite] = None,
    sums: str = "tensor-cores",
    release_dependents_early: bool = False,
    stream=None,
) -> None:
    """out[t, h, :] = x[t, h, :] @ weight[h] for the MLA absorb and value-up
    (head_gemv.h), 1..16 tokens.

    x [m, H, I] BF16 (dims 1-2 packed, token stride a multiple of 8, 16-byte
    aligned), weight [H, I, J] BF16 (J contiguous, head and row strides
    multiples of 8, 16-byte aligned); out [m, H, J] contiguous, BF16, or FP8
    e4m3 quantized by scale [1] f32 (the stock static quant; scale is
    required for FP8 out and refused otherwise); out shares no memory with
    the inputs. m 1..16. cache: the fused
    KV-cache write (KvCacheWrite). sums: "tensor-cores" (the default, the
    fastest: BF16 MMA, FP32 accumulators, each sum within 2^-14 of the sum
    of |products|, then the exact roundings; I a multiple of 64 up to 1024
    and J of 16, else Unsupported) or "seed-order" (opt-in: the seed's FP32
    order, bitwise reference.head_gemv).
    release_dependents_early: let the next PDL kernel start before this one
    waits (for a next kernel with a long weight prologue)."""
    cache = cache if cache is not None else KvCacheWrite(None, None, None, None)
    _C.head_gemv(
        x,
        plain(weight),
        fp8_view(out),
        scale,
        cache.kv,
        fp8_view(cache.cache),
        cache.slot_mapping,
        cache.k_scale,
        cache.error_count,
        sums,
        release_dependents_early,
        stream_of(stream, x),
    )


def linear_gemv(x, weight, out, *, stream=None) -> None:
    """nn.Linear for 1..8 tokens in one launch (linear.h): out [m, N] =
    x [m, K] @ weight [N, K]^T, all BF16, K a multiple of 8. Bitwise
    reference.linear_gemv (a fixed order), the same bits for a token alone or
    in any batch."""
    _C.linear_gemv(x, plain(weight), out, stream_of(stream, x))


def linear_gemv_supports(m: int, k: int) -> bool:
    """Whether linear_gemv takes m tokens of k columns (its shared-memory rule)."""
    return _C.linear_gemv_supports(m, k)


def sparse_mla_split_counter_count(m: int, heads: int, top_k: int) -> int:
    """int32 counters sparse_mla needs for m tokens (zero them once; every
    launch leaves them zero). Non-decreasing in m: size them for the largest."""
    return _C.sparse_mla_split_counter_count(m, heads, top_k)


def sparse_mla_split_partials_count(m: int, heads: int, top_k: int) -> int:
    """f32 values of sparse_mla's split partials for m tokens (no initial value needed)."""
    return _C.sparse_mla_split_partials_count(m, heads, top_k)


def sparse_mla(
    q,
    q_scale,
    kv_cache,
    k_scale,
    indices,
    softmax_scale: float,
    latent,
    lse,
    split_counters,
    split_partials=None,
    *,
    plan: str = "auto",
    error_count=None,
    stream=None,
) -> None:
    """Sparse MLA decode attention over the selected KV-cache entries (sparse_mla.h).

    q [m, H, 512] FP8 e4m3 (times q_scale [1] f32; dim 2 contiguous, head
    and token strides multiples of 16), kv_cache [blocks, block_size, 512]
    FP8 e4m3 (times k_scale [1] f32; dim 2 contiguous, entry and block
    strides multiples of 16), indices [m, K] int32 global slots (dim 1
    contiguous; negative: none; past the cache: skipped and counted in
    error_count). Writes latent [m, H, 512] BF16 (dims 1-2 contiguous, token
    stride a multiple of 8) and lse [m, H] f32 (contiguous); neither shares
    memory with an input. 16-byte aligned data throughout.
    split_counters [sparse_mla_split_counter_count(m, H, K)] int32, zero
    before the first launch and left zero by each; split_partials
    [sparse_mla_split_partials_count(m, H, K)] f32 (None when that is 0).
    Latent within 5e-3 relative Frobenius and lse within 1e-3 of float64.
    plan: "auto" (the default: per launch the fastest plan for m, H and K on
    this GPU; a token's bits may change with the size of its batch) or
    "batch-invariant" (split points from H and K only: a token's bits
    depend on its own inputs alone)."""
    _C.sparse_mla(
        fp8_view(q),
        q_scale,
        fp8_view(kv_cache),
        k_scale,
        indices,
        float(softmax_scale),
        latent,
        lse,
        split_counters,
        split_partials,
        plan,
        error_count,
        stream_of(stream, q),
    )


@dataclass(frozen=True)
class IndexerPlan:
    """The DSA indexer's fixed shapes (indexer.h IndexerPlan): the
    largest step (max_tokens, 1..16) and context (max_context), the tail
    ring (pool, or 2 * pool with draft tokens: indexer_ring_for; 1 with pool
    1), the KV block size (a multiple of 128; of 64 with pool 1), the logits'
    sums: "fp32-accumulation" (the default, the fastest: FP16 tensor cores,
    FP32 accumulation, within indexer.h's bound) or "exact" (opt-in: FP64,
    logits and rows bitwise the CPU reference's), and the shape, from the
    model config as vLLM reads it: heads (index_n_heads: 16, 32 or 64), pool
    (index_kpool: 4, 8 or 16; or 1, no pooling: DeepSeek-V3.2's indexer, a
    key per token) and topk (index_topk: a multiple of pool, at most 512
    pools; 1..2048 tokens with pool 1); with pool 1, rope_dims (R: 0, 16, 32,
    64 or 128; V3.2's qk_rope_head_dim 64) and rope_style (one of
    INDEXER_ROPE_STYLES, ROPE_STYLES' names: "half-split", the default and
    vLLM's for V3.2, or "interleaved"): RoPE of the first R dims of every q
    head and of k by the cos_sin table prepare and prefill then take. The
    defaults are glm5next's first shape, 32 / 4 / 2048, no RoPE;
    IndexerPlan.dsv32() is DeepSeek-V3.2's. The selection is deterministic
    either way (ties to the lower index). Checked at construction:
    InvalidArgument names a bad field (plan.heads, ..., rope_style)."""

    max_tokens: int = 16
    max_context: int = 131072
    ring: int = 4
    block_size: int = 256
    logits: str = "fp32-accumulation"
    heads: int = 32
    pool: int = 4
    topk: int = 2048
    rope_dims: int = 0
    rope_style: str = "half-split"

    def __post_init__(self):
        _C.check_indexer_plan(self._fields())

    @classmethod
    def dsv32(cls, max_tokens: int = 16, max_context: int = 131072, block_size: int = 64, **fields) -> "IndexerPlan":
        """DeepSeek-V3.2's indexer (docs/indexer.md "DeepSeek-V3.2: pool 1"):
        64 heads, no pooling, top-2048 tokens, no ring, RoPE of the first 64
        dims half-split (vLLM's); block_size 64 (vLLM's for V3.2, DeepGEMM's
        pages). Any field may be overridden."""
        shape = dict(heads=64, pool=1, topk=2048, ring=1, rope_dims=64, rope_style="half-split")
        shape.update(fields)
        return cls(max_tokens=max_tokens, max_context=max_context, block_size=block_size, **shape)

    def _fields(self):
        # The extension's IndexerPlanFields, in its order.
        return (self.max_tokens, self.max_context, self.ring, self.block_size, self.logits, self.heads, self.pool,
                self.topk, self.rope_dims, self.rope_style)

    def workspace_bytes(self) -> int:
        """Bytes of the uint8 workspace prepare writes and select reads."""
        return _C.indexer_workspace_bytes(self._fields())

    def _shape(self) -> dict:
        return _C.indexer_shape(self._fields())

    @property
    def row_width(self) -> int:
        """Columns W of a top-k row (topk_positions, slots): topk + pool - 1
        rounded up to 128 (2176 at the default shape)."""
        return self._shape()["row_width"]

    @property
    def top_pools(self) -> int:
        """Pools the select keeps: topk / pool."""
        return self._shape()["top_pools"]

    @property
    def pools_per_page(self) -> int:
        """Pools of one K-cache page: block_size / pool."""
        return self._shape()["pools_per_page"]

    @property
    def page_bytes(self) -> int:
        """Bytes of one K-cache page (k_cache's dim 1): pools_per_page * 132."""
        return self._shape()["page_bytes"]

    @property
    def tokens_per_request(self) -> int:
        """Tokens of one request a step may hold: ring - (pool - 1); 16 (any step) with pool 1."""
        return self._shape()["tokens_per_request"]

    def workspace_layout(self) -> dict:
        """Byte offsets into the workspace (indexer_workspace_layout): q_fp8
        [max_tokens, heads, 128] e4m3 codes, head_weights [max_tokens, heads]
        f32 (the folded weights prepare writes), logits [max_tokens,
        logits_stride] f32 (select writes them; logits_stride =
        ceil(max_context / pool)), and bytes in all."""
        shape = self._shape()
        return {
            "q_fp8": shape["q_fp8_offset"],
            "head_weights": shape["head_weights_offset"],
            "logits": shape["logits_offset"],
            "logits_stride": shape["logits_stride"],
            "bytes": self.workspace_bytes(),
        }


def indexer_ring_for(pool: int, tokens_per_request: int) -> int:
    """The smallest RING for a pool size and tokens of one request per step
    (1 + draft tokens): pool, or 2 * pool; 0 when even 2 * pool is too small."""
    return _C.indexer_ring_for(pool, tokens_per_request)


@dataclass
class IndexerState:
    """The paged indexer state every step shares: block_table [requests,
    width] int32, ring [requests, 2, RING, 128] BF16 (k and gate of the tail
    tokens; None with pool 1, which keeps no ring), k_cache [blocks,
    plan.page_bytes] uint8 (block_size / pool pooled FP8 keys, then their
    FP32 scales, page by page; with pool 1 a key per token at entry
    pos % block_size: vLLM's and DeepGEMM's V3.2 layout)."""

    block_table: Any
    ring: Any
    k_cache: Any

    def _args(self):
        return (self.block_table, self.ring, self.k_cache)


def indexer_project(
    plan: IndexerPlan,
    q_c,
    x,
    wq_b,
    wk,
    weights_proj,
    compress_gate,
    index_q,
    index_k,
    head_weights,
    gate,
    *,
    stream=None,
) -> None:
    """The indexer's four projections as one GEMV launch (indexer_project_gemv):
    index_q [m, H, 128] = q_c [m, Q] @ wq_b^T, index_k [m, 128] = x [m, D] @
    wk^T, head_weights [m, H] f32 = x @ weights_proj^T, gate [m, 128] = x @
    compress_gate^T (H = plan.heads), with wq_b [H * 128, Q], wk [128, D], weights_proj [H,
    D] and compress_gate [128, D] in nn.Linear's [out, in] layout; BF16 but
    head_weights; rows with dim 1 contiguous, row strides multiples of 16
    bytes, 16-byte aligned; Q and D multiples of 8. With pool 1
    (DeepSeek-V3.2's indexer) there is no gate: compress_gate and gate None.
    A fixed order, bitwise its CPU reference."""
    _C.indexer_project(
        plan._fields(),
        q_c,
        x,
        plain(wq_b),
        plain(wk),
        plain(weights_proj),
        plain(compress_gate),
        index_q,
        index_k,
        head_weights,
        gate,
        stream_of(stream, q_c),
    )


def indexer_prepare(
    plan: IndexerPlan,
    index_q,
    index_k,
    head_weights,
    gate,
    k_norm_weight,
    k_norm_bias,
    ape,
    positions,
    token_requests,
    state: IndexerState,
    workspace,
    *,
    cos_sin=None,
    error_count=None,
    stream=None,
) -> None:
    """Steps 1-4 of a decode step (indexer_prepare): LayerNorm of k, the
    Hadamard and FP8 quant of q with the folded head weights (into
    workspace), the pools the step completes (into state.k_cache) and the
    ring. index_q [m, H, 128], index_k [m, 128] and gate [m, 128] BF16,
    head_weights [m, H] f32 (indexer_project's outputs); positions [m]
    int64, token_requests [m] int32 (negative: padding); k_norm_weight,
    k_norm_bias [128] f32, ape [plan.pool, 128] f32; workspace: uint8
    [plan.workspace_bytes()], 256-byte aligned, which indexer_select reads.
    Pool 1 (DeepSeek-V3.2): gate, ape and state.ring are not read (None is
    fine); every token's key is written at its position; with plan.rope_dims
    R > 0, cos_sin [rows >= plan.max_context, R] float32 or BF16
    (rope_cos_sin_table of rope_preset_config("dsv32", "indexer"), uploaded)
    rotates the first R dims of q's heads and of k (required: a missing or
    bad table raises InvalidArgument naming 'cos_sin'; not read when R is 0)."""
    _C.indexer_prepare(
        plan._fields(),
        index_q,
        index_k,
        head_weights,
        gate,
        plain(k_norm_weight),
        plain(k_norm_bias),
        None if ape is None else plain(ape),
        positions,
        token_requests,
        *state._args(),
        workspace,
        error_count,
        cos_sin,
        stream_of(stream, index_q),
    )


def indexer_select(
    plan: IndexerPlan,
    positions,
    token_requests,
    state: IndexerState,
    workspace,
    slots,
    *,
    topk_positions=None,
    error_count=None,
    stream=None,
) -> None:
    """Steps 5-8 (indexer_select): logits over the complete pools, the top
    plan.top_pools pools (ties to the lower index), expanded to tokens with the tail,
    remapped to global KV slots: slots [m, W] int32 (W = plan.row_width, 2176
    at the default shape; and the request-local positions into topk_positions
    [m, W] int32 when given)."""
    _C.indexer_select(
        plan._fields(),
        positions,
        token_requests,
        *state._args(),
        workspace,
        slots,
        topk_positions,
        error_count,
        stream_of(stream, positions),
    )


def indexer_remap(
    plan: IndexerPlan,
    positions,
    token_requests,
    state: IndexerState,
    topk_positions,
    slots,
    *,
    error_count=None,
    stream=None,
) -> None:
    """Step 8 alone, for rows the caller brings (MTP draft steps 1+):
    topk_positions [m, W] int32 request-local -> slots [m, W] int32 (W = plan.row_width)
    global (-1 stays -1; positions from the future and bad pages become -1
    and are counted)."""
    _C.indexer_remap(
        plan._fields(),
        positions,
        token_requests,
        *state._args(),
        topk_positions,
        slots,
        error_count,
        stream_of(stream, positions),
    )


def indexer_prefill(
    plan: IndexerPlan,
    index_k,
    gate,
    k_norm_weight,
    k_norm_bias,
    ape,
    request: int,
    state: IndexerState,
    *,
    cos_sin=None,
    error_count=None,
    stream=None,
) -> None:
    """Step 9: positions 0..n-1 of one request (index_k, gate [n, 128] BF16)
    into its pools and ring, so that decode continues at position n; the
    same bytes as prepare token by token. Pool 1: gate, ape and state.ring
    are not read (None is fine), a key per position; cos_sin as
    indexer_prepare's (rows for positions 0..n-1 at least plan.max_context)."""
    _C.indexer_prefill(
        plan._fields(),
        index_k,
        gate,
        plain(k_norm_weight),
        plain(k_norm_bias),
        None if ape is None else plain(ape),
        int(request),
        *state._args(),
        error_count,
        cos_sin,
        stream_of(stream, index_k),
    )


# --- RoPE (rope.h) and the V3.2 attention (sparse_mla_v32.h) -----------------

ROPE_STYLES = _C.ROPE_STYLES  # "interleaved" (GPT-J pairs x[2i], x[2i+1]) | "half-split" (NeoX: x[i], x[i+R/2])
ROPE_TARGETS = _C.ROPE_TARGETS  # "attention" (the MLA's q_pe and k_pe) | "indexer" (the rope part of its q and k)
# The 656-byte entry of DeepSeek-V3.2's FP8 cache and the kernel's limits
# (sparse_mla_v32.h): latent 512, rope 64, head_dim 576, group_size 128,
# entry_bytes 656, scale_offset 512, rope_offset 528, max_heads, max_top_k, max_tokens.
SPARSE_MLA_V32_LAYOUT = dict(_C.SPARSE_MLA_V32_LAYOUT)


@dataclass(frozen=True)
class RopeConfig:
    """A rotary configuration (rope.h RopeConfig): DeepSeek's YaRN when factor
    > 1 (frequencies theta^(-2i/R) blended with their / factor by the ramp
    between the correction dims of beta_fast and beta_slow; magnitude terms
    mscale and mscale_all_dim), plain RoPE when factor == 1. rope_dim R: 16,
    32, 64, 128 or 256; max_position: the table rows the engine holds; style:
    one of ROPE_STYLES. rope_preset_config gives the served ones. Checked at
    construction: InvalidArgument names a bad field (rope_dim, theta, ...)."""

    rope_dim: int = 64
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    max_position: int = 4096
    style: str = "interleaved"

    def __post_init__(self):
        _C.check_rope_config(self._fields())

    def _fields(self):
        # The extension's RopeConfigFields, in its order.
        return (
            int(self.rope_dim),
            float(self.theta),
            float(self.factor),
            int(self.original_max_position),
            float(self.beta_fast),
            float(self.beta_slow),
            float(self.mscale),
            float(self.mscale_all_dim),
            int(self.max_position),
            str(self.style),
        )

    def frequency(self, pair: int) -> float:
        """f_i in float64 (the YaRN blend included), 0 <= pair < rope_dim / 2."""
        return _C.rope_frequency(self._fields(), int(pair))

    @property
    def table_scale(self) -> float:
        """The factor in cos and sin: yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)."""
        return _C.rope_table_scale(self._fields())


def _rope_config(config) -> RopeConfig:
    if not isinstance(config, RopeConfig):
        raise TypeError(f"argument 'config': expected a dsa_decode.RopeConfig, got {type(config).__name__}")
    return config


def rope_preset_config(preset: str, target: str = "attention") -> RopeConfig:
    """The served rotary of a preset with rotary dims ("dsv32": YaRN, factor 40
    over 4096 positions, 163840 rows, interleaved for the attention and
    half-split for the indexer; "glm5": plain RoPE, theta 1e6, interleaved),
    for target "attention" or "indexer" (docs/rope.md has the sources). Other
    presets raise InvalidArgument naming 'preset'."""
    return RopeConfig(*_C.rope_preset_config(str(preset), str(target)))


def rope_softmax_scale(config: RopeConfig, qk_head_dim: int) -> float:
    """The attention's softmax scale: qk_head_dim^-0.5 * yarn_mscale(factor,
    mscale_all_dim)^2, qk_head_dim the model's qk_nope_head_dim +
    qk_rope_head_dim (not the absorbed 576): dsv32 192 -> 0.1352338, glm5
    256 -> 1/16. sparse_mla_v32's softmax_scale."""
    return _C.rope_softmax_scale(_rope_config(config)._fields(), int(qk_head_dim))


def rope_cos_sin_table(config: RopeConfig, first_position: int = 0, rows: Optional[int] = None):
    """The host table [rows, R] float32 (NumPy) in vLLM's cos_sin_cache layout,
    row p = cos(p f_0..f_{R/2-1}) * s | sin(...) * s (s = config.table_scale),
    for positions first_position.. (rows: default max_position -
    first_position); each entry the float64 value rounded to float32. Upload
    it once (torch.from_numpy(table).cuda()) as rope_absorb's cos_sin."""
    return _C.rope_cos_sin_table(_rope_config(config)._fields(), int(first_position), rows)


def rope_absorb(
    q_nope,
    q_pe,
    k_pe,
    positions,
    cos_sin,
    weight,
    out,
    k_pe_out,
    *,
    style: str = "interleaved",
    error_count=None,
    stream=None,
) -> None:
    """The absorbed query with RoPE, and the rotated k_pe, 1..16 tokens, one
    launch (rope.h):

      out[t, h, :L]    = q_nope[t, h] @ weight[h]            (head_gemv's tensor-core sums, BF16)
      out[t, h, L:L+R] = rotate(q_pe[t, h], cos_sin[positions[t]])
      k_pe_out[t]      = rotate(k_pe[t], cos_sin[positions[t]])

    q_nope [m, H, P] and q_pe [m, H, R] BF16 (dim 2 contiguous, head and
    token strides multiples of 8: views into q [m, H, P + R] are fine),
    k_pe [m, R] BF16 (a view into kv_a's [m, L + R] is fine), positions
    [>= m] int64, cos_sin [rows, R] float32 or BF16 (rope_cos_sin_table),
    weight = W_UK_T [H, P, L] BF16 (L contiguous); writes out [m, H, L + R]
    BF16 (contiguous) and k_pe_out [m, R] BF16; 16-byte aligned data; P a
    multiple of 64 up to 1024, L of 16, R in 16..256. style: one of
    ROPE_STYLES (the preset's config.style). Positions negative or >= rows:
    zeros in that token's rotated columns, those >= rows counted in
    error_count (an optional int32 CUDA counter). Rotation in FP32 then
    BF16 RNE, within 2^-22 (|a| + |b|) max(|c|, |s|) of float64 with the
    table's own values; deterministic and batch invariant."""
    _C.rope_absorb(
        q_nope,
        q_pe,
        k_pe,
        positions,
        cos_sin,
        plain(weight),
        out,
        k_pe_out,
        style,
        error_count,
        stream_of(stream, q_nope),
    )


def sparse_mla_v32_cache_write(kv_c, k_pe, slot_mapping, kv_cache, *, error_count=None, stream=None) -> None:
    """DeepSeek-V3.2's FP8 cache write (vLLM's concat_and_cache_ds_mla, bit for
    bit): kv_c [m, 512] and k_pe [m, 64] BF16 (dim 1 contiguous, token stride
    a multiple of 8) into kv_cache [blocks, block_size, 656] uint8 (or
    float8_e4m3fn) at slot_mapping [n] int64: per 128 values amax / 448 as an
    FP32 scale, the e4m3 codes of x / scale, then the 64 BF16 RoPE values
    verbatim. Entry and block strides multiples of 16; 16-byte aligned.
    Tokens t >= n and negative slots are skipped; slots past the cache are
    skipped and counted in error_count (an optional int32 CUDA counter)."""
    _C.sparse_mla_v32_cache_write(kv_c, k_pe, slot_mapping, fp8_view(kv_cache), error_count, stream_of(stream, kv_c))


def sparse_mla_v32(q, kv_cache, indices, softmax_scale: float, latent, lse, *, error_count=None, stream=None) -> None:
    """Sparse MLA decode attention over DeepSeek-V3.2's 656-byte FP8 cache
    (sparse_mla_v32.h; FlashMLA's "FP8 with scale" format, vLLM's fp8_ds_mla).

    q [m, H, 576] BF16 (the absorbed 512 and the 64 rotated RoPE dims: rope_absorb's
    out; dim 2 contiguous, head and token strides multiples of 8), kv_cache
    [blocks, block_size, 656] uint8 or float8_e4m3fn (sparse_mla_v32_cache_write's),
    indices [m, K] int32 global slots (dim 1 contiguous; negative: none;
    past the cache: skipped and counted in error_count), softmax_scale finite
    and > 0 (rope_softmax_scale). Writes latent [m, H, 512] BF16 (dims 1-2
    contiguous, token stride a multiple of 8) and lse [m, H] float32
    (natural log; a row with no valid entry: latent 0, lse -inf); neither
    shares memory with an input. m 1..65535, H 1..128, K 1..16384, 16-byte
    aligned data. Latent within 5e-3 relative Frobenius and lse within 1e-3
    of float64 on the dequantized cache; deterministic. No split buffers
    (the splits combine in distributed shared memory)."""
    _C.sparse_mla_v32(
        q, fp8_view(kv_cache), indices, float(softmax_scale), latent, lse, error_count, stream_of(stream, q)
    )
