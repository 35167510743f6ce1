"""dsa_decode's kernels and its stage as PyTorch custom operators, namespace "dsa_decode".

    import dsa_decode.torch_ops  # registers torch.ops.dsa_decode.*

Importing this module needs PyTorch 2.4 or later (torch.library.custom_op);
importing dsa_decode alone never imports PyTorch.

Form: every op writes caller-owned outputs in place and returns None (schema
"-> ()"), the arguments it writes named in mutates_args. That is the
library's own contract (nothing allocated on the run path, so a CUDA graph
replays the same buffers) and the form vLLM's custom ops take. torch.compile
traces the ops through their fake (meta) implementations, which check
nothing, write nothing and return None: the C++ checks run when the op runs.
Under torch.compile the writes are functionalized (auto_functionalized) and
Inductor turns them back into in-place calls.

Streams: each op launches on torch.cuda.current_stream() of its first
tensor's device, as a PyTorch op would. Errors: the dsa_decode exceptions
(InvalidArgument is a ValueError, Unsupported a NotImplementedError) with
the C++ check's message.

Shapes (dsa_decode.ops has each contract; include/dsa_decode/*.h in full):
m tokens, H heads, Q q_lora_rank, L kv_lora_rank (512), P qk_nope_head_dim,
V v_head_dim, K top-k entries per row, D hidden size. An argument marked !
is written.

  qkv_rmsnorm(qkv, q_weight, kv_weight, eps, q_out!, kv_out!)
  linear_gemv(x, weight, out!)
  head_gemv(x, weight, out!, scale, sums, release_dependents_early=False)
  head_gemv_absorb(x, weight, out!, scale, cache_kv, cache!, slot_mapping, k_scale, sums,
                   error_count!, release_dependents_early=False)
  sparse_mla(q, q_scale, kv_cache, k_scale, indices, softmax_scale, latent!, lse!, split_counters!,
             split_partials!, plan, error_count!)
  rope_absorb(q_nope, q_pe, k_pe, positions, cos_sin, weight, out!, k_pe_out!, style, error_count!)
  sparse_mla_v32_cache_write(kv_c, k_pe, slot_mapping, kv_cache!, error_count!)
  sparse_mla_v32(q, kv_cache, indices, softmax_scale, latent!, lse!, error_count!)
  stage_forward(handle, hidden, positions, token_requests, slot_mapping, kv_cache!, block_table, ring!,
                index_k_cache!, out!, topk_positions, error_count!, stock=False)

String choices (sums, plan, style) have no defaults: PyTorch 2.4's schema
inference takes defaults of int, float, bool and None only. Pass the
defaults of dsa_decode.ops (the first name of HEAD_GEMV_SUMS and
ATTENTION_PLANS: "tensor-cores" and "auto", the fastest paths within the
numerics contract) unless you need an opt-in ("seed-order" sums, the
"batch-invariant" plan). The optional
tensors (error_count, split_partials, topk_positions) have none either: pass
None. PyTorch bumps the version of every written argument by its position,
so a written argument left to its default is out of range (IndexError,
seen on PyTorch 2.11).

The stage: a Stage object cannot be an operator argument, so stage_forward
takes an int handle from register_stage(stage). The registry holds the stage
(and so its weights and workspace) until unregister_stage(handle); keep it
registered as long as a CUDA graph or a compiled function that calls it may
run.
"""

import itertools
import threading
from typing import Optional

import torch

from .ops import IndexerState, KvCacheWrite
from .ops import head_gemv as _head_gemv
from .ops import linear_gemv as _linear_gemv
from .ops import qkv_rmsnorm as _qkv_rmsnorm
from .ops import rope_absorb as _rope_absorb
from .ops import sparse_mla as _sparse_mla
from .ops import sparse_mla_v32 as _sparse_mla_v32
from .ops import sparse_mla_v32_cache_write as _sparse_mla_v32_cache_write
from .stage import Stage, StepArgs

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
    raise ImportError(
        "dsa_decode.torch_ops needs torch.library.custom_op (PyTorch 2.4 or later); "
        f"this is PyTorch {torch.__version__}"
    )

NAMESPACE = "dsa_decode"
OPS = (
    "qkv_rmsnorm",
    "linear_gemv",
    "head_gemv",
    "head_gemv_absorb",
    "sparse_mla",
    "rope_absorb",
    "sparse_mla_v32_cache_write",
    "sparse_mla_v32",
    "stage_forward",
)

Tensor = torch.Tensor

# --- the stage registry ----------------------------------------------------

_registry_lock = threading.Lock()
_stages_by_handle = {}
_handles_by_stage_id = {}
_next_handle = itertools.count(1)


def register_stage(stage: Stage) -> int:
    """An int handle for stage_forward. The registry keeps the stage alive
    until unregister_stage; registering a stage again gives its handle again."""
    if not isinstance(stage, Stage):
        raise TypeError(f"argument 'stage': expected a dsa_decode.Stage, got {type(stage).__name__}")
    with _registry_lock:
        handle = _handles_by_stage_id.get(id(stage))
        if handle is None:
            handle = next(_next_handle)
            _stages_by_handle[handle] = stage
            _handles_by_stage_id[id(stage)] = handle
        return handle


def unregister_stage(handle: int) -> None:
    """Forgets the handle; the stage is freed once nothing else holds it.
    A compiled function that calls the handle fails after this, and a CUDA
    graph that captured the stage's launches must not be replayed after the
    stage is freed (it uses the stage's workspace)."""
    with _registry_lock:
        stage = _stages_by_handle.pop(handle, None)
        if stage is None:
            raise ValueError(f"argument 'handle': no stage is registered as {handle}")
        del _handles_by_stage_id[id(stage)]


def registered_stage(handle: int) -> Stage:
    """The stage registered as `handle`."""
    stage = _stages_by_handle.get(handle)
    if stage is None:
        raise ValueError(
            f"argument 'handle': expected a handle from dsa_decode.torch_ops.register_stage, got {handle} "
            f"(registered: {sorted(_stages_by_handle)})"
        )
    return stage


# --- the ops ---------------------------------------------------------------
# Each fake implementation takes its op's arguments and returns None: the
# ops only write tensors the caller passed in, so a trace learns no new
# shapes from them. They run no checks either (the C++ checks run with the
# op), so a wrong shape shows when the compiled code first runs.


@torch.library.custom_op(f"{NAMESPACE}::qkv_rmsnorm", mutates_args=("q_out", "kv_out"), device_types="cuda")
def qkv_rmsnorm(qkv: Tensor, q_weight: Tensor, kv_weight: Tensor, eps: float, q_out: Tensor, kv_out: Tensor) -> None:
    """Both RMSNorms of the a-projection in one launch (dsa_decode.qkv_rmsnorm).

    qkv [m, Q + L] BF16 (dim 1 contiguous, row pitch a multiple of 8),
    q_weight [Q] and kv_weight [L] BF16, eps finite and > 0; writes q_out
    [m, Q] and kv_out [m, L] BF16, contiguous."""
    _qkv_rmsnorm(qkv, q_weight, kv_weight, eps, q_out, kv_out)


@qkv_rmsnorm.register_fake
def _qkv_rmsnorm_fake(qkv, q_weight, kv_weight, eps, q_out, kv_out):
    return None


@torch.library.custom_op(f"{NAMESPACE}::linear_gemv", mutates_args=("out",), device_types="cuda")
def linear_gemv(x: Tensor, weight: Tensor, out: Tensor) -> None:
    """nn.Linear for 1..8 tokens in one launch (dsa_decode.linear_gemv):
    out [m, N] = x [m, K] @ weight [N, K]^T, all BF16, K a multiple of 8
    (dsa_decode.linear_gemv_supports(m, K) for the shared-memory bound)."""
    _linear_gemv(x, weight, out)


@linear_gemv.register_fake
def _linear_gemv_fake(x, weight, out):
    return None


@torch.library.custom_op(f"{NAMESPACE}::head_gemv", mutates_args=("out",), device_types="cuda")
def head_gemv(
    x: Tensor,
    weight: Tensor,
    out: Tensor,
    scale: Optional[Tensor],
    sums: str,
    release_dependents_early: bool = False,
) -> None:
    """out[t, h, :] = x[t, h, :] @ weight[h] (dsa_decode.head_gemv), 1..16 tokens, no cache write.

    The value-up: x = latent [m, H, L] BF16, weight = W_UV [H, L, V] BF16
    (V contiguous), out [m, H, V] BF16, scale None. Or an FP8 absorb
    without the cache write: out [m, H, J] float8_e4m3fn (or its uint8
    view) quantized by scale [1] f32. sums: "tensor-cores" (the fastest,
    within the contract's bound) or "seed-order" (bitwise the CPU reference)."""
    _head_gemv(
        x,
        weight,
        out,
        scale=scale,
        sums=sums,
        release_dependents_early=release_dependents_early,
    )


@head_gemv.register_fake
def _head_gemv_fake(x, weight, out, scale, sums, release_dependents_early=False):
    return None


@torch.library.custom_op(
    f"{NAMESPACE}::head_gemv_absorb", mutates_args=("out", "cache", "error_count"), device_types="cuda"
)
def head_gemv_absorb(
    x: Tensor,
    weight: Tensor,
    out: Tensor,
    scale: Tensor,
    cache_kv: Tensor,
    cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor,
    sums: str,
    error_count: Optional[Tensor],
    release_dependents_early: bool = False,
) -> None:
    """The MLA absorb with FP8 out and the KV-cache write fused in, one launch
    (dsa_decode.head_gemv with a KvCacheWrite).

    x = q [m, H, P] BF16, weight = W_UK_T [H, P, L] BF16 (L contiguous);
    out [m, H, L] float8_e4m3fn (or uint8) = FP8(x @ weight / scale), scale
    [1] f32. On the side: cache_kv [m, L] BF16 (kv_c) divided by k_scale [1]
    f32 into cache [blocks, block_size, L] float8_e4m3fn (or uint8) at
    slot_mapping [n] int64 (negative, or t >= n: skipped; past the cache:
    skipped and counted in error_count [1] int32 when given). sums:
    "tensor-cores" (the fastest, within the contract's bound) or
    "seed-order" (bitwise the CPU reference)."""
    write = KvCacheWrite(kv=cache_kv, cache=cache, slot_mapping=slot_mapping, k_scale=k_scale, error_count=error_count)
    _head_gemv(
        x,
        weight,
        out,
        scale=scale,
        cache=write,
        sums=sums,
        release_dependents_early=release_dependents_early,
    )


@head_gemv_absorb.register_fake
def _head_gemv_absorb_fake(
    x,
    weight,
    out,
    scale,
    cache_kv,
    cache,
    slot_mapping,
    k_scale,
    sums,
    error_count,
    release_dependents_early=False,
):
    return None


@torch.library.custom_op(
    f"{NAMESPACE}::sparse_mla",
    # split_counters: counted up and back to zero by every launch, so written.
    mutates_args=("latent", "lse", "split_counters", "split_partials", "error_count"),
    device_types="cuda",
)
def sparse_mla(
    q: Tensor,
    q_scale: Tensor,
    kv_cache: Tensor,
    k_scale: Tensor,
    indices: Tensor,
    softmax_scale: float,
    latent: Tensor,
    lse: Tensor,
    split_counters: Tensor,
    split_partials: Optional[Tensor],
    plan: str,
    error_count: Optional[Tensor],
) -> None:
    """Sparse MLA decode attention over the selected KV-cache entries (dsa_decode.sparse_mla).

    q [m, H, 512] float8_e4m3fn (or uint8) times q_scale [1] f32; kv_cache
    [blocks, block_size, 512] float8_e4m3fn (or uint8) times k_scale [1] f32;
    indices [m, K] int32 global slots (negative: none; past the cache:
    skipped, counted in error_count [1] int32 when given). Writes latent
    [m, H, 512] BF16 and lse [m, H] f32. split_counters
    [dsa_decode.sparse_mla_split_counter_count(m, H, K)] int32, zero before
    the first launch and left zero by each; split_partials
    [dsa_decode.sparse_mla_split_partials_count(m, H, K)] f32, or None when
    that count is 0. plan: "auto" (the fastest for this m; a token's bits
    may depend on its batch) or "batch-invariant"."""
    _sparse_mla(
        q,
        q_scale,
        kv_cache,
        k_scale,
        indices,
        softmax_scale,
        latent,
        lse,
        split_counters,
        split_partials,
        plan=plan,
        error_count=error_count,
    )


@sparse_mla.register_fake
def _sparse_mla_fake(
    q,
    q_scale,
    kv_cache,
    k_scale,
    indices,
    softmax_scale,
    latent,
    lse,
    split_counters,
    split_partials,
    plan,
    error_count,
):
    return None


@torch.library.custom_op(
    f"{NAMESPACE}::rope_absorb", mutates_args=("out", "k_pe_out", "error_count"), device_types="cuda"
)
def rope_absorb(
    q_nope: Tensor,
    q_pe: Tensor,
    k_pe: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    weight: Tensor,
    out: Tensor,
    k_pe_out: Tensor,
    style: str,
    error_count: Optional[Tensor],
) -> None:
    """The absorbed query with RoPE and the rotated k_pe, one launch (dsa_decode.rope_absorb).

    q_nope [m, H, P] and q_pe [m, H, R] BF16 (views into q [m, H, P + R]
    are fine), k_pe [m, R] BF16, positions [>= m] int64, cos_sin [rows, R]
    f32 or BF16 (dsa_decode.rope_cos_sin_table), weight = W_UK_T [H, P, L]
    BF16; writes out [m, H, L + R] BF16 = [q_nope @ W_UK_T | rotate(q_pe)]
    and k_pe_out [m, R] BF16. style: "interleaved" or "half-split" (the
    model's RopeConfig.style). Positions past the table: zeros, counted in
    error_count [1] int32 when given."""
    _rope_absorb(q_nope, q_pe, k_pe, positions, cos_sin, weight, out, k_pe_out, style=style, error_count=error_count)


@rope_absorb.register_fake
def _rope_absorb_fake(q_nope, q_pe, k_pe, positions, cos_sin, weight, out, k_pe_out, style, error_count):
    return None


@torch.library.custom_op(
    f"{NAMESPACE}::sparse_mla_v32_cache_write", mutates_args=("kv_cache", "error_count"), device_types="cuda"
)
def sparse_mla_v32_cache_write(
    kv_c: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor, error_count: Optional[Tensor]
) -> None:
    """DeepSeek-V3.2's FP8 cache write (dsa_decode.sparse_mla_v32_cache_write):
    kv_c [m, 512] and k_pe [m, 64] BF16 into kv_cache [blocks, block_size,
    656] uint8 (or float8_e4m3fn) at slot_mapping [n] int64, vLLM's
    concat_and_cache_ds_mla bytes (negative, or t >= n: skipped; past the
    cache: skipped and counted in error_count [1] int32 when given)."""
    _sparse_mla_v32_cache_write(kv_c, k_pe, slot_mapping, kv_cache, error_count=error_count)


@sparse_mla_v32_cache_write.register_fake
def _sparse_mla_v32_cache_write_fake(kv_c, k_pe, slot_mapping, kv_cache, error_count):
    return None


@torch.library.custom_op(
    f"{NAMESPACE}::sparse_mla_v32", mutates_args=("latent", "lse", "error_count"), device_types="cuda"
)
def sparse_mla_v32(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    softmax_scale: float,
    latent: Tensor,
    lse: Tensor,
    error_count: Optional[Tensor],
) -> None:
    """Sparse MLA decode attention over DeepSeek-V3.2's 656-byte FP8 cache (dsa_decode.sparse_mla_v32).

    q [m, H, 576] BF16, kv_cache [blocks, block_size, 656] uint8 (or
    float8_e4m3fn), indices [m, K] int32 global slots (negative: none; past
    the cache: skipped, counted in error_count [1] int32 when given),
    softmax_scale > 0 (dsa_decode.rope_softmax_scale). Writes latent [m, H,
    512] BF16 and lse [m, H] f32. No split buffers."""
    _sparse_mla_v32(q, kv_cache, indices, softmax_scale, latent, lse, error_count=error_count)


@sparse_mla_v32.register_fake
def _sparse_mla_v32_fake(q, kv_cache, indices, softmax_scale, latent, lse, error_count):
    return None


@torch.library.custom_op(
    f"{NAMESPACE}::stage_forward",
    # ring and index_k_cache: the indexer's prepare writes them (not when
    # topk_positions is given; declaring them anyway is only conservative).
    mutates_args=("kv_cache", "ring", "index_k_cache", "out", "error_count"),
    device_types="cuda",
)
def stage_forward(
    handle: int,
    hidden: Tensor,
    positions: Tensor,
    token_requests: Tensor,
    slot_mapping: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    ring: Optional[Tensor],
    index_k_cache: Tensor,
    out: Tensor,
    topk_positions: Optional[Tensor],
    error_count: Optional[Tensor],
    stock: bool = False,
) -> None:
    """One decode step of the registered stage (Stage.forward, or
    Stage.stock_forward when stock), hidden states in, o_proj's output out.

    handle: from register_stage. hidden [m, D] BF16, m <= the stage's
    max_tokens; positions [m] int64; token_requests [m] int32 (negative:
    padding); slot_mapping [n] int64; kv_cache [blocks, block_size, L]
    float8_e4m3fn (or uint8; a RoPE layer's [blocks, block_size, 656]
    uint8), written at slot_mapping; the indexer state
    (dsa_decode.IndexerState): block_table [requests, width] int32, ring
    [requests, 2, RING, 128] BF16 (None at a RoPE layer: its unpooled
    indexer keeps no ring) and index_k_cache [blocks, block_size / pool *
    132] uint8, both written; out [m, D] BF16. topk_positions: optional
    [m, W] int32 request-local rows (W = the stage plan's indexer_plan().row_width,
    2176 at the default shape; MTP draft steps 1+: the indexer is
    skipped). error_count: optional [1] int32 counter of untrusted device
    values."""
    args = StepArgs(
        hidden=hidden,
        positions=positions,
        token_requests=token_requests,
        slot_mapping=slot_mapping,
        kv_cache=kv_cache,
        indexer=IndexerState(block_table=block_table, ring=ring, k_cache=index_k_cache),
        out=out,
        topk_positions=topk_positions,
        error_count=error_count,
    )
    stage = registered_stage(handle)
    if stock:
        stage.stock_forward(args)
    else:
        stage.forward(args)


@stage_forward.register_fake
def _stage_forward_fake(
    handle,
    hidden,
    positions,
    token_requests,
    slot_mapping,
    kv_cache,
    block_table,
    ring,
    index_k_cache,
    out,
    topk_positions,
    error_count,
    stock=False,
):
    return None


def run_stage(handle: int, args: StepArgs, *, stock: bool = False) -> None:
    """torch.ops.dsa_decode.stage_forward with a StepArgs' tensors."""
    torch.ops.dsa_decode.stage_forward(
        handle,
        args.hidden,
        args.positions,
        args.token_requests,
        args.slot_mapping,
        args.kv_cache,
        args.indexer.block_table,
        args.indexer.ring,
        args.indexer.k_cache,
        args.out,
        args.topk_positions,
        args.error_count,
        stock,
    )


__all__ = [
    "NAMESPACE",
    "OPS",
    "head_gemv",
    "head_gemv_absorb",
    "linear_gemv",
    "qkv_rmsnorm",
    "register_stage",
    "registered_stage",
    "rope_absorb",
    "run_stage",
    "sparse_mla",
    "sparse_mla_v32",
    "sparse_mla_v32_cache_write",
    "stage_forward",
    "unregister_stage",
]
