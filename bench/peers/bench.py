"""Ours against the real peers, in one process on the same inputs (issue 37).

  sparse_mla vs FlashMLA MODEL1           dsa_decode.ops.sparse_mla (default plan) against
                                          FlashMLA's sparse FP8 decode, d_qk = d_v = 512
  sparse_mla vs FlashInfer fa3            dsa_decode.ops.sparse_mla (default plan) against FlashInfer's
                                          SM90 sparse MLA as vLLM 0.33 serves glm5next on Hopper
                                          (FLASHINFER_MLA_SPARSE_SM90: BatchMLAPagedAttentionWrapper,
                                          backend fa3, page_size 1, head_dim_kpe 0, BF16 query, FP8 KV)
  sparse_mla dsv32 vs FlashMLA V32        dsa_decode.ops.sparse_mla_v32 against FlashMLA's sparse FP8
                                          decode in its V3.2 format (d_qk 576, 656-byte entries), the
                                          same cache bytes, BF16 query and indices (bench/peers/v32.py)
  indexer select vs DeepGEMM logits +     dsa_decode.ops.indexer_select (default plan) against
    vLLM cooperative_topk                 DeepGEMM's fp8_fp4_paged_mqa_logits then vLLM's
                                          cooperative_topk (the decode top-k vLLM 0.34 picks
                                          on SM90 for up to 64 rows of top-512)
  indexer dsv32 vs DeepGEMM + vLLM top-k  our V3.2 indexer select (pool 1, 64 heads, top-2048 with the
                                          remap to slots) against DeepGEMM's fp8_paged_mqa_logits then
                                          vLLM's cooperative_topk (k 2048), the same K cache pages
                                          (written by our prefill/prepare), q and weights
                                          (bench/peers/indexer_v32.py)

Inputs, both sides the same values:
  attention  q: e4m3 codes x q_scale (2^-5); KV: e4m3 codes x k_scale (2^-5), blocks of 256
             slots; K = 2048 distinct slots per token. FlashMLA's MODEL1 cache holds the same
             values exactly (448 e4m3 codes with e8m0 scales = k_scale, 64 BF16 values), its q
             is the BF16 of our FP8 q (exact). H = 8: FlashMLA runs 64 heads (its smallest;
             vLLM pads TP8's 8 heads to 64), the first 8 compared. Our FP8 q is the e4m3 quant
             (q_scale) of a BF16 q ~ N(0, 1); FlashInfer takes that BF16 q, as vLLM gives it, and
             the cache as it is ([blocks, 256, 512] e4m3 viewed [slots, 1, 512], ckv_scale =
             k_scale), at the model's own head count (vLLM pads none for this backend).
  indexer    m requests at context L (positions L - 1), L / 4 pooled keys each in our paged
             FP8 layout, which is DeepGEMM's (pages of 64 keys: 64 x 128 e4m3 codes, then 64
             f32 scales); the same block table; q_fp8 and folded head weights written into our
             select's workspace and given to DeepGEMM as q [m, 1, 32, 128] and weights [m, 32].

Timing as dsa-bench's harness (bench/harness.h): launch i reads rotation i % R of the inputs
(R copies of the KV rows or pages, at least twice the L2 together), max(20, R) launches
captured into one CUDA graph, 50 replays after warm-up, each replay's time over its launches a
sample, the median reported. Metadata that engines compute once per step and share across
layers (FlashMLA's tile schedule, DeepGEMM's paged schedule, FlashInfer's plan()) is computed
before timing. Ours is timed once per (H, m) and reported in each peer's row.

Checks before a row counts: each side against a float64 reference of the same inputs
(FlashInfer: of its BF16 query; ours against the BF16 query's reference too, reported as the
query quant's departure, never failed;
attention: latent within 5e-3 relative Frobenius, lse within 1e-3 absolute; indexer: the
peer's top-512 pool set equals ours up to near-ties of the reference logits) and ours against
the peer. A failed check or a peer that did not build is reported in the row; the rest run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import indexer_v32  # noqa: E402
from accuracy import check_baseline, latent_error, lse_error  # noqa: E402
import peers  # noqa: E402
import v32  # noqa: E402

K_TOPK = 2048
LATENT = 512
BLOCK = 256
SOFTMAX_SCALE = 256 ** -0.5  # glm5next
QK_SCALE = 2.0 ** -5  # q_scale = k_scale: a power of two, so FlashMLA's BF16 q and e8m0 scales hold our values exactly
MIN_CACHE_SLOTS = 65536
LATENT_TOL, LSE_TOL = 5e-3, 1e-3
POOL, POOL_BYTES, TOP_POOLS, ROW_WIDTH = 4, 132, 512, 2176
PAGE_POOLS = BLOCK // POOL  # 64: DeepGEMM's block_kv on SM90


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- timing


def time_graph(enqueue, rotations: int, replays: int = 50) -> float:
    """Median microseconds of one launch, as bench/harness.cu's time_graph."""
    per_graph = max(20, rotations)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(per_graph):
            enqueue(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(per_graph):
            enqueue(i)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) * 1e3 / per_graph for s, e in events]
    del graph
    return statistics.median(samples)


def rotations_for(bytes_per_launch: float) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, math.ceil(2 * l2 / bytes_per_launch))


def e4m3_codes(shape, std: float, gen) -> torch.Tensor:
    """Random e4m3 codes of N(0, std) values (saturated at +-448: never NaN, never all zeros)."""
    x = torch.randn(shape, device="cuda", generator=gen) * std
    return x.clamp_(-448, 448).to(torch.float8_e4m3fn)


# ---------------------------------------------------------------- attention


def attention_inputs(H: int, m: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = m * K_TOPK
    rotations = rotations_for(rows * LATENT)
    slots = max(MIN_CACHE_SLOTS, rows * rotations)
    blocks = (slots + BLOCK - 1) // BLOCK
    # Values ~ N(0, 1): codes ~ N(0, 1 / 2^-5); score spread about 10 at this softmax scale.
    kv = e4m3_codes((blocks, BLOCK, LATENT), 1 / QK_SCALE, gen)
    # The query as the engine has it (BF16 ~ N(0, 1): what FlashInfer's fa3 path takes) and our
    # FP8 query of it (e4m3 codes of q / q_scale, saturating RNE: the absorb's static quant).
    q_bf16 = torch.randn((m, H, LATENT), device="cuda", generator=gen).to(torch.bfloat16)
    q = (q_bf16.float() / QK_SCALE).clamp_(-448, 448).to(torch.float8_e4m3fn)
    # Rotation r reads region r (slots r * rows .. (r + 1) * rows), permuted: distinct rows per token.
    idx = torch.empty((rotations, m, K_TOPK), dtype=torch.int32, device="cuda")
    for r in range(rotations):
        perm = torch.randperm(rows, device="cuda", generator=gen).to(torch.int32) + r * rows
        idx[r] = perm.view(m, K_TOPK)
    return dict(H=H, m=m, rotations=rotations, blocks=blocks, kv=kv, q=q, q_bf16=q_bf16, idx=idx)


def model1_cache(kv_codes: torch.Tensor) -> torch.Tensor:
    """The same KV values in FlashMLA's MODEL1 FP8 layout (tests/quant.py of FlashMLA): per block,
    256 x [448 e4m3 codes, 64 BF16 values], then 256 x [7 e8m0 scales, 1 pad], the block padded
    to a multiple of 576 bytes; viewed [blocks, 256, 1, 584]."""
    blocks = kv_codes.shape[0]
    nope, rope, tiles = 448, 64, 7
    per_token = nope + 2 * rope + tiles + 1  # 584
    block_bytes = (BLOCK * per_token + 575) // 576 * 576
    buf = torch.zeros((blocks, block_bytes), dtype=torch.uint8, device="cuda")
    data = buf[:, : BLOCK * (nope + 2 * rope)].view(blocks, BLOCK, nope + 2 * rope)
    data[:, :, :nope] = kv_codes[:, :, :nope].view(torch.uint8)
    data[:, :, nope:].view(torch.bfloat16).copy_((kv_codes[:, :, nope:].float() * QK_SCALE).to(torch.bfloat16))
    scales = buf[:, BLOCK * (nope + 2 * rope) : BLOCK * per_token].view(blocks, BLOCK, 8)
    scales[:, :, :tiles] = 127 + int(math.log2(QK_SCALE))  # e8m0 of k_scale
    return buf.as_strided((blocks, BLOCK, 1, per_token), (block_bytes, per_token, per_token, 1))


def attention_reference(inp, rotation: int = 0, bf16_query: bool = False):
    """float64 latent [m, H, 512] and lse [m, H] of rotation `rotation`: with our FP8 query's
    values, or with the BF16 query it was quantized from (what FlashInfer's fa3 path takes)."""
    q = inp["q_bf16"].double() if bf16_query else inp["q"].double() * QK_SCALE
    kv = inp["kv"].view(torch.uint8).view(-1, LATENT)  # gathered as bytes (no float8 indexing kernels)
    idx = inp["idx"][rotation].long()
    k = kv[idx].view(torch.float8_e4m3fn).double() * QK_SCALE  # [m, K, 512]
    s = torch.einsum("mhd,mkd->mhk", q, k) * SOFTMAX_SCALE
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("mhk,mkd->mhd", p, k), lse


def measure_ours(args, dsa, inp, ref_latent, ref_lse):
    """Our sparse_mla (default plan) on these inputs: its check against the float64 reference of its
    own inputs, its time when it passes, and its output (for the comparisons with the peers)."""
    m, H = inp["m"], inp["H"]
    ops = dsa.ops
    res = {}
    q_scale = torch.tensor([QK_SCALE], dtype=torch.float32, device="cuda")
    latent = torch.empty((m, H, LATENT), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((m, H), dtype=torch.float32, device="cuda")
    counters = torch.zeros(max(1, ops.sparse_mla_split_counter_count(m, H, K_TOPK)), dtype=torch.int32, device="cuda")
    n_partials = ops.sparse_mla_split_partials_count(m, H, K_TOPK)
    partials = torch.empty(n_partials, dtype=torch.float32, device="cuda") if n_partials else None

    def ours(i):  # the default plan: no splits argument
        ops.sparse_mla(
            inp["q"], q_scale, inp["kv"], q_scale, inp["idx"][i % inp["rotations"]],
            SOFTMAX_SCALE, latent, lse, counters, partials,
        )

    latent.fill_(float("nan"))
    ours(0)
    torch.cuda.synchronize()
    res["latent"], res["lse"] = latent.clone(), lse.clone()
    e_lat, e_lse = latent_error(res["latent"], ref_latent), lse_error(res["lse"], ref_lse)
    res["check_ours"] = {"latent_rel": e_lat, "lse_abs": e_lse}
    if not (e_lat <= LATENT_TOL and e_lse <= LSE_TOL):
        res["error"] = f"ours fails the contract: latent {e_lat:.2e}, lse {e_lse:.2e}"
    else:
        res["us"] = time_graph(ours, inp["rotations"], args.replays)
        res["tflops"] = 2.0 * m * H * K_TOPK * (LATENT + LATENT) / (res["us"] * 1e-6) / 1e12
    return res


def copy_ours(row, ours):
    for key in ("check_ours", "us", "tflops", "error"):
        if ours and key in ours:
            row[key] = ours[key]


def flashmla_row(args, flashmla, flashmla_error, commits, inp, ref_latent, ref_lse, ours):
    m, H = inp["m"], inp["H"]
    peer_h = max(64, H)
    baseline = f"FlashMLA MODEL1 @{commits['flashmla'][:12]}"
    if peer_h != H:
        baseline = f"FlashMLA MODEL1 at H={peer_h} ({H} heads padded to {peer_h}) @{commits['flashmla'][:12]}"
    row = {"name": "sparse_mla vs FlashMLA MODEL1", "params": {"H": H, "m": m, "K": K_TOPK}, "baseline": baseline}
    copy_ours(row, ours)
    if flashmla is None:
        row["baseline_error"] = flashmla_error or "FlashMLA not loaded"
        return row
    kv1 = model1_cache(inp["kv"])
    q_bf16 = (inp["q"].float() * QK_SCALE).to(torch.bfloat16)  # our FP8 query's values, exactly
    if peer_h != H:
        q_bf16 = q_bf16.repeat(1, peer_h // H, 1)
    q_bf16 = q_bf16.view(m, 1, peer_h, LATENT).contiguous()
    idx4 = inp["idx"].view(inp["rotations"], m, 1, K_TOPK)
    sched, _ = flashmla.get_mla_metadata()

    def peer(i):
        return flashmla.flash_mla_with_kvcache(
            q_bf16, kv1, None, None, LATENT, sched, None, SOFTMAX_SCALE, False, True,
            idx4[i % inp["rotations"]],
        )

    out, plse = peer(0)  # also builds FlashMLA's tile schedule, reused by every later call
    torch.cuda.synchronize()
    p_latent = out.view(m, peer_h, LATENT)[:, :H]
    p_lse = plse.reshape(m, peer_h)[:, :H]
    e_lat, e_lse = check_baseline(row, p_latent, p_lse, ref_latent, ref_lse, ours)
    if not (e_lat <= LATENT_TOL and e_lse <= LSE_TOL):
        row["baseline_error"] = f"FlashMLA fails the contract: latent {e_lat:.2e}, lse {e_lse:.2e}"
    else:
        row["baseline_us"] = time_graph(peer, inp["rotations"], args.replays)
        row["baseline_tflops"] = 2.0 * m * peer_h * K_TOPK * 1024 / (row["baseline_us"] * 1e-6) / 1e12
    return row


FLASHINFER_WORKSPACE_BYTES = 128 * 2**20  # vLLM's _WORKSPACE_BYTES for this backend


def flashinfer_row(args, fi, fi_error, inp, ref_latent, ref_lse, ours):
    """FlashInfer's SM90 sparse MLA as vLLM 0.33's FLASHINFER_MLA_SPARSE_SM90 calls it for glm5next
    (v1/attention/backends/mla/flashinfer_mla_sparse_sm90.py): one batch row per decode token,
    page_size 1 with the token's top-k slots as its pages, BF16 query, the FP8 e4m3 cache
    [blocks, 256, 512] viewed [slots, 1, 512] with a per-tensor k_scale, head_dim_kpe 0, causal
    off; planned once outside the graph (vLLM plans in its metadata builder), run() captured."""
    m, H, R = inp["m"], inp["H"], inp["rotations"]
    row = {"name": "sparse_mla vs FlashInfer fa3", "params": {"H": H, "m": m, "K": K_TOPK}}
    row["baseline"] = "FlashInfer fa3 BatchMLAPagedAttentionWrapper (BF16 q, FP8 KV)" + (
        f" {fi.version} @{fi.commit[:12]}" if fi is not None else "")
    copy_ours(row, ours)
    notes = ["FlashInfer: BF16 query (ours: its FP8 quant); vLLM runs it at the model's own head count (no padding)"]
    if fi is None:
        row["baseline_error"] = fi_error or "FlashInfer not loaded"
        row["note"] = "; ".join(notes)
        return row
    if not fi.prebuilt:
        notes.append("FlashInfer's module was JIT-compiled on this machine (the prebuilt one did not load)")
    dev = inp["kv"].device
    rows = m * K_TOPK
    workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    kv_indices = torch.zeros(rows, dtype=torch.int32, device=dev)
    wrapper = fi.Wrapper(
        workspace,
        use_cuda_graph=True,
        qo_indptr=torch.zeros(m + 1, dtype=torch.int32, device=dev),
        kv_indptr=torch.zeros(m + 1, dtype=torch.int32, device=dev),
        kv_indices=kv_indices,
        kv_len_arr=torch.zeros(m, dtype=torch.int32, device=dev),
        backend="fa3",
    )
    # vLLM's _SM90State._plan: CPU CSR offsets and lengths, positional arguments.
    qo_cpu = torch.arange(m + 1, dtype=torch.int32)
    kv_cpu = torch.arange(m + 1, dtype=torch.int32) * K_TOPK
    lens_cpu = torch.full((m,), K_TOPK, dtype=torch.int32)
    wrapper.plan(
        qo_cpu, kv_cpu, inp["idx"][0].reshape(-1), lens_cpu, H, LATENT, 0, 1, False, SOFTMAX_SCALE,
        q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn,
    )
    backend = wrapper._planned_backend
    reserved = backend._kv_indices_buf
    idx_flat = inp["idx"].view(R, rows)
    flat = inp["kv"].view(-1, 1, LATENT)  # vLLM: cache.view(float8_e4m3fn).reshape(-1, 1, head_size)
    ckv, kpe = flat[..., :LATENT], flat[..., LATENT:]
    q_nope = inp["q_bf16"]
    q_pe = q_nope.new_empty((m, H, 0))
    out = torch.empty_like(q_nope)

    def peer(i, **kw):
        # Launch i reads rotation i's slots, as ours does: the plan depends on the lengths only,
        # and vLLM writes each step's slots into the reserved buffer that run() passes
        # (_pack_topk_indices inside its graph); here run() is handed rotation i's copy instead.
        backend._kv_indices_buf = idx_flat[i % R]
        return wrapper.run(q_nope, q_pe, ckv, kpe, out=out, ckv_scale=QK_SCALE, kpe_scale=1.0, **kw)

    try:
        p_lse = None
        try:
            _, p_lse = peer(0, return_lse=True, return_lse_base_on_e=True)
        except Exception as e:  # this plan may not allow an LSE: check the latent alone
            notes.append(f"FlashInfer lse not checked ({type(e).__name__}: {e})")
            peer(0)
        torch.cuda.synchronize()
        p_latent = out.clone()
        ref64_latent, ref64_lse = attention_reference(inp, bf16_query=True)
        e_lat = latent_error(p_latent, ref64_latent)
        e_lse = 0.0
        if p_lse is not None:
            # Asked for natural-log lse (return_lse_base_on_e); should a plan without an lse mode
            # give FlashInfer's base-2 lse instead, that convention is recognized and said.
            e_lse = lse_error(p_lse, ref64_lse)
            e_lse2 = lse_error(p_lse.double() * math.log(2.0), ref64_lse)
            if e_lse2 < e_lse:
                notes.append("FlashInfer's lse came in base 2 (converted)")
                p_lse, e_lse = p_lse.double() * math.log(2.0), e_lse2
        row["check_baseline"] = {"latent_rel": e_lat, "lse_abs": e_lse if p_lse is not None else None,
                                 "reference": "float64 of the BF16 query"}
        if ours and "latent" in ours:
            # The query quant: ours against the float64 result of the BF16 query it was quantized from
            # (reported, not failed: the contract bounds ours against its own FP8 inputs).
            row["check_ours_vs_bf16_query_reference"] = {
                "latent_rel": latent_error(ours["latent"], ref64_latent),
                "lse_abs": lse_error(ours["lse"], ref64_lse),
            }
            row["check_ours_vs_baseline"] = {
                "latent_rel": latent_error(ours["latent"], p_latent.double()),
                "lse_abs": lse_error(ours["lse"], p_lse) if p_lse is not None else None,
            }
        if not (e_lat <= LATENT_TOL and e_lse <= LSE_TOL):
            row["baseline_error"] = f"FlashInfer fails the contract: latent {e_lat:.2e}, lse {e_lse:.2e}"
        else:
            row["baseline_us"] = time_graph(peer, R, args.replays)  # output only, as vLLM calls it
            row["baseline_tflops"] = 2.0 * m * H * K_TOPK * 1024 / (row["baseline_us"] * 1e-6) / 1e12
    finally:
        backend._kv_indices_buf = reserved
    row["note"] = "; ".join(notes)
    return row


def run_attention(args, dsa, flashmla, flashmla_error, fi, fi_error, commits, skip, rows_out):
    grid_h = [int(h) for h in args.heads.split(",")]
    grid_m = [int(m) for m in args.tokens.split(",")]
    fi_heads = {int(h) for h in args.flashinfer_heads.split(",") if h}
    for H in grid_h:
        for m in grid_m:
            peers_here = [p for p in ("flashmla", "flashinfer") if p not in skip and (p != "flashinfer" or H in fi_heads)]
            if not peers_here:
                continue
            ours, shared_notes, inp, ref_latent, ref_lse = None, [], None, None, None
            try:
                inp = attention_inputs(H, m, seed=1000 + 7 * H + m)
                shared_notes.append(f"{inp['rotations']} KV regions of {m * K_TOPK} rows")
                ref_latent, ref_lse = attention_reference(inp)
                if dsa is not None:
                    ours = measure_ours(args, dsa, inp, ref_latent, ref_lse)
            except Exception as e:  # one shape's failure must not stop the others
                traceback.print_exc()
                ours = {"error": f"{type(e).__name__}: {e}"}
            for p in peers_here:
                params = {"H": H, "m": m, "K": K_TOPK}
                try:
                    if inp is None or ref_latent is None:
                        raise RuntimeError(ours["error"])
                    if p == "flashmla":
                        row = flashmla_row(args, flashmla, flashmla_error, commits, inp, ref_latent, ref_lse, ours)
                    else:
                        row = flashinfer_row(args, fi, fi_error, inp, ref_latent, ref_lse, ours)
                except Exception as e:
                    traceback.print_exc()
                    name = "sparse_mla vs FlashMLA MODEL1" if p == "flashmla" else "sparse_mla vs FlashInfer fa3"
                    row = {"name": name, "params": params, "baseline": p}
                    copy_ours(row, ours)
                    row["baseline_error"] = f"{type(e).__name__}: {e}"
                if "us" in row and "baseline_us" in row:
                    row["speedup"] = row["baseline_us"] / row["us"]
                row["note"] = "; ".join(shared_notes + ([row["note"]] if row.get("note") else []))
                rows_out.append(row)
                log(one_line(row))
            del inp
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- indexer


def workspace_offsets(max_tokens: int, max_context: int):
    """Offsets of q_fp8, folded head weights and logits in select's workspace (as
    indexer_workspace_layout in src/indexer/indexer_args.cpp: each 256-byte aligned)."""
    def up(x):
        return (x + 255) // 256 * 256

    q = 0
    w = up(max_tokens * 32 * 128)
    lg = up(w + max_tokens * 32 * 4)
    pools = (max_context + POOL - 1) // POOL
    return q, w, lg, pools, up(lg + max_tokens * pools * 4)


def indexer_inputs(m: int, context: int, max_context: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pools = context // POOL
    pages = (context + BLOCK - 1) // BLOCK
    per_rotation = m * pools * POOL_BYTES
    rotations = rotations_for(per_rotation)
    blocks = rotations * m * pages
    width = (max_context + BLOCK - 1) // BLOCK
    k_cache = torch.empty((blocks, PAGE_POOLS * POOL_BYTES), dtype=torch.uint8, device="cuda")
    codes = e4m3_codes((blocks, PAGE_POOLS * 128), 64.0, gen)
    k_cache[:, : PAGE_POOLS * 128] = codes.view(torch.uint8)
    kscale = (torch.rand((blocks, PAGE_POOLS), device="cuda", generator=gen) + 0.5) * 2.0 ** -9
    k_cache[:, PAGE_POOLS * 128 :].view(torch.float32).copy_(kscale)
    # Block tables: rotation r, request t -> its own pages (a random permutation of all blocks).
    perm = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32).view(rotations, m, pages)
    tables = torch.zeros((rotations, m, width), dtype=torch.int32, device="cuda")
    tables[:, :, :pages] = perm
    q = e4m3_codes((m, 32, 128), 64.0, gen)
    w = torch.randn((m, 32), device="cuda", generator=gen) * 2.0 ** -4
    return dict(m=m, context=context, pools=pools, rotations=rotations, k_cache=k_cache, tables=tables, q=q, w=w)


def indexer_reference(inp, rotation: int = 0):
    """float64 logits [m, pools] of rotation `rotation` and their rounding bound (indexer.h step 6)."""
    m, n = inp["m"], inp["pools"]
    kc = inp["k_cache"]
    codes = kc[:, : PAGE_POOLS * 128].view(-1, PAGE_POOLS, 128)  # bytes; e4m3 after the gather
    scales = kc[:, PAGE_POOLS * 128 :].contiguous().view(torch.float32).view(-1, PAGE_POOLS)
    p = torch.arange(n, device="cuda")
    q = inp["q"].double()
    ref = torch.empty((m, n), dtype=torch.float64, device="cuda")
    bound = torch.empty_like(ref)
    for t in range(m):
        blk = inp["tables"][rotation, t, p // PAGE_POOLS].long()
        k = codes[blk, p % PAGE_POOLS].view(torch.float8_e4m3fn).double()  # [n, 128]
        ks = scales[blk, p % PAGE_POOLS].double()
        dots = q[t] @ k.T  # [32, n]
        absdots = q[t].abs() @ k.abs().T
        w = inp["w"][t].double()
        ref[t] = ks * (w[:, None] * dots.clamp_min(0)).sum(0)
        bound[t] = ks * (w.abs()[:, None] * (2.0 ** -10 * absdots + 70 * 2.0 ** -24 * dots.abs())).sum(0)
    return ref, bound


def compare_sets(ref, bound, mine: torch.Tensor, theirs: torch.Tensor):
    """Differences between two top-512 pool sets per row, and whether each is a near-tie of the
    reference logits (within the two logits' bounds of the 512th largest)."""
    worst, differing, bad = 0.0, 0, 0
    for t in range(ref.shape[0]):
        a, b = set(mine[t].tolist()), set(theirs[t].tolist())
        if len(a) != TOP_POOLS or len(b) != TOP_POOLS:
            raise RuntimeError(f"row {t}: {len(a)} and {len(b)} distinct pools, not {TOP_POOLS}")
        diff = sorted(a ^ b)
        differing += len(diff)
        if diff:
            top = torch.topk(ref[t], TOP_POOLS)
            thr, thr_p = float(top.values[-1]), int(top.indices[-1])
            for p in diff:
                gap = abs(float(ref[t, p]) - thr)
                tol = 2 * (float(bound[t, p]) + float(bound[t, thr_p]))
                worst = max(worst, gap / tol if tol > 0 else math.inf)
                bad += gap > tol
    return differing, bad, worst


def run_indexer(args, dsa, dg, dg_error, vt, vt_error, commits, rows_out):
    contexts = [int(c) for c in args.contexts.split(",")]
    grid_m = [int(m) for m in args.index_tokens.split(",")]
    max_context = max(131072, max(contexts))
    max_pools = max_context // POOL
    baseline = (
        f"DeepGEMM paged MQA logits @{commits['deepgemm'][:12]} + vLLM {commits['vllm']} cooperative_topk"
    )
    for context in contexts:
        for m in grid_m:
            row = {"name": "indexer select vs DeepGEMM logits + vLLM top-k", "params": {"m": m, "context": context},
                   "baseline": baseline}
            notes = []
            try:
                inp = indexer_inputs(m, context, max_context, seed=77 + m + context)
                n = inp["pools"]
                notes.append(f"{inp['rotations']} copies of {m} x {n} pooled keys")
                ref, bound = indexer_reference(inp)
                ref_set = torch.topk(ref, TOP_POOLS, dim=1).indices.cpu()
                ctx_lens = torch.full((m, 1), n, dtype=torch.int32, device="cuda")
                positions = torch.full((m,), context - 1, dtype=torch.int64, device="cuda")
                requests = torch.arange(m, dtype=torch.int32, device="cuda")
                ours_set = None
                if dsa is not None:
                    ops = dsa.ops
                    plan = ops.IndexerPlan(max_tokens=16, max_context=max_context)
                    notes.append(f"ours: IndexerPlan logits={getattr(plan, 'logits', '?')}")
                    qo, wo, lo, stride, total = workspace_offsets(plan.max_tokens, plan.max_context)
                    if plan.workspace_bytes() != total:
                        raise RuntimeError(
                            f"select's workspace is {plan.workspace_bytes()} bytes, bench/peers assumed {total}: "
                            "update workspace_offsets to indexer_workspace_layout"
                        )
                    ws = torch.zeros(total + 256, dtype=torch.uint8, device="cuda")
                    base = (-ws.data_ptr()) % 256
                    ws = ws[base : base + total]
                    ws[qo : qo + m * 4096].copy_(inp["q"].view(torch.uint8).view(-1))
                    ws[wo : wo + m * 128].view(torch.float32).copy_(inp["w"].view(-1))
                    ring = torch.randn((m, 2, plan.ring, 128), device="cuda").to(torch.bfloat16)
                    states = [ops.IndexerState(inp["tables"][r], ring, inp["k_cache"]) for r in range(inp["rotations"])]
                    slots = torch.empty((m, ROW_WIDTH), dtype=torch.int32, device="cuda")
                    tpos = torch.full((m, ROW_WIDTH), -7, dtype=torch.int32, device="cuda")
                    ops.indexer_select(plan, positions, requests, states[0], ws, slots, topk_positions=tpos)
                    torch.cuda.synchronize()
                    ours_logits = ws[lo : lo + m * stride * 4].view(torch.float32).view(m, stride)[:, :n].double()
                    ours_set = (tpos[:, : TOP_POOLS * POOL : POOL] // POOL).cpu()
                    if not bool((tpos[:, TOP_POOLS * POOL :] == -1).all()):
                        raise RuntimeError("ours: tail columns not -1 at a context multiple of 4")
                    d, bad, worst = compare_sets(ref, bound, ours_set, ref_set)
                    row["check_ours"] = {
                        "logits_rel": float(((ours_logits - ref).abs() / bound.clamp_min(1e-30)).max()),
                        "set_diff_vs_reference": d, "non_tie_diffs": bad,
                    }

                    def ours(i):
                        ops.indexer_select(plan, positions, requests, states[i % inp["rotations"]], ws, slots)

                    if bad:
                        row["error"] = f"ours: {bad} selected pools differ from the reference's beyond near-ties"
                    else:
                        row["us"] = time_graph(ours, inp["rotations"], args.replays)
                if dg is None or vt is None:
                    row["baseline_error"] = dg_error or vt_error or "peer not loaded"
                else:
                    kv = inp["k_cache"].as_strided(
                        (inp["k_cache"].shape[0], PAGE_POOLS, 1, POOL_BYTES), (PAGE_POOLS * POOL_BYTES, POOL_BYTES, POOL_BYTES, 1)
                    )
                    q4 = inp["q"].view(m, 1, 32, 128)
                    sched = dg.get_paged_mqa_logits_metadata(ctx_lens, PAGE_POOLS, dg.get_num_sms())
                    topk_out = torch.empty((m, TOP_POOLS), dtype=torch.int32, device="cuda")
                    topk_ws = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # vLLM's RADIX_TOPK_WORKSPACE_SIZE

                    def peer(i):
                        logits = dg.fp8_fp4_paged_mqa_logits(
                            (q4, None), kv, inp["w"], ctx_lens, inp["tables"][i % inp["rotations"]], sched,
                            max_pools, False, torch.float32,
                        )
                        vt.cooperative_topk(logits, ctx_lens, topk_out, topk_ws, TOP_POOLS, context)
                        return logits

                    logits = peer(0)
                    torch.cuda.synchronize()
                    peer_logits = logits[:, :n].double()
                    peer_set = topk_out.cpu()
                    d, bad, worst = compare_sets(ref, bound, peer_set, ref_set)
                    row["check_baseline"] = {
                        "logits_rel": float(((peer_logits - ref).abs() / bound.clamp_min(1e-30)).max()),
                        "set_diff_vs_reference": d, "non_tie_diffs": bad,
                    }
                    if ours_set is not None:
                        d2, bad2, _ = compare_sets(ref, bound, ours_set, peer_set)
                        row["check_ours_vs_baseline"] = {"set_diff": d2, "non_tie_diffs": bad2}
                        bad = max(bad, bad2)
                    if bad:
                        row["baseline_error"] = f"top-k sets differ beyond near-ties ({bad} pools)"
                    else:
                        row["baseline_us"] = time_graph(peer, inp["rotations"], args.replays)
                if "us" in row and "baseline_us" in row:
                    row["speedup"] = row["baseline_us"] / row["us"]
                notes.append("peer: logits + top-k of pools only; ours also expands to tokens and remaps to slots")
                del inp
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            row["note"] = "; ".join(notes)
            rows_out.append(row)
            log(one_line(row))
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- report


def fmt_us(x):
    return "-" if x is None else f"{x:.2f}"


def one_line(row) -> str:
    p = ", ".join(f"{k}={v}" for k, v in row["params"].items())
    s = f"[peers] {row['name']} ({p}): ours {fmt_us(row.get('us'))} us, peer {fmt_us(row.get('baseline_us'))} us"
    if "speedup" in row:
        s += f", x{row['speedup']:.2f}"
    for key in ("error", "baseline_error"):
        if key in row:
            s += f" [{key}: {row[key]}]"
    return s


def table(report: dict) -> str:
    """A README-style markdown table of a peers.json report."""
    lines = [
        f"Measured on {report.get('gpu', '?')}, commit {report.get('commit', '?')}, {report.get('date', '?')} "
        "(cold L2, CUDA-graph replay, medians; bench/peers).",
        "",
        "| comparison | shape | ours (us) | peer (us) | speedup | peer |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        shape = ", ".join(f"{k} {v}" for k, v in r["params"].items())
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else (
            "peer failed" if "baseline_error" in r else "-")
        lines.append(
            f"| {r['name']} | {shape} | {fmt_us(r.get('us'))} | {fmt_us(r.get('baseline_us'))} | {speed} | {r.get('baseline', '')} |"
        )
    peers_ = report.get("peers", {})
    if peers_:
        lines.append("")
        lines.append("Peers: " + "; ".join(f"{k} {v['source']} @ {v['pin']}" for k, v in peers_.items()) + ".")
    return "\n".join(lines)


def git_commit() -> str:
    if os.environ.get("DSA_COMMIT"):
        return os.environ["DSA_COMMIT"]
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=peers.ROOT, capture_output=True, text=True)
        commit = c.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=peers.ROOT, capture_output=True, text=True)
        return commit + ("-dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def peers_wanted(skip: set, build_only: bool) -> list:
    """The peers the selected sections run (--build-only: all of them). FlashMLA serves two
    sections (attention: MODEL1, v32: V3.2), DeepGEMM and vLLM's top-k two (indexer: pooled,
    indexer_v32: DeepSeek-V3.2): each wanted unless all of its sections are skipped."""
    flashmla = "flashmla" not in skip and not {"attention", "v32"} <= skip
    indexer = not {"indexer", "indexer_v32"} <= skip
    return [p for p, needed in (("flashmla", flashmla), ("deepgemm", indexer), ("vllm_topk", indexer))
            if build_only or needed]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "build-gpu/peers-out"), help="writes OUT/results/peers.json")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of a peers.json and exit")
    ap.add_argument("--peers-only", action="store_true", help="do not import dsa_decode (peers alone, checked against the float64 reference)")
    ap.add_argument("--build-only", action="store_true", help="build the peers and stop")
    ap.add_argument("--skip", default="", help="comma list of what to skip: attention, v32, indexer, indexer_v32 (sections), flashmla, flashinfer (attention peers)")
    ap.add_argument("--heads", default="8,64,128")
    ap.add_argument("--flashinfer-heads", default="8,64", help="the heads of --heads that FlashInfer also runs (glm5next: 64 at TP1, 8 at TP8)")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--v32-heads", default="128,16", help="heads of the dsv32 rows (FlashMLA runs 16 padded to 64)")
    ap.add_argument("--v32-tokens", default="1,2,4,8,16,64,128", help="m of the dsv32 rows")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--index-tokens", default="1,2,4,8,16")
    ap.add_argument("--v32-index-tokens", default="1,4,8", help="m of the indexer dsv32 rows (at each of --contexts)")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()

    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0

    out = Path(args.out)
    (out / "results").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    trees = peers.manifest()
    pin = lambda name: trees.get(name, {}).get("pin", "?")  # noqa: E731
    commits = {"flashmla": pin("flashmla"), "deepgemm": pin("deepgemm"), "vllm": pin("vllm-topk"), "flashinfer": pin("flashinfer")}
    skip = set(filter(None, args.skip.split(",")))
    before = peers.build_listing()
    wanted = peers_wanted(skip, args.build_only)
    errors = peers.build_all(wanted)
    for p, e in errors.items():
        log(f"[peers] {p}: {'ready' if not e else e}")
    log(f"[peers] builds done in {time.time() - t0:.0f} s")
    if args.build_only:
        for path in peers.pack_build(out, before):
            log(f"[peers] packed {path} (unpack into .deps/ to reuse)")
        return 0 if not any(errors.values()) else 1

    def load(name, fn):
        if name in peers.PEERS and name not in wanted:
            return None, "skipped (--skip)"
        if errors.get(name):
            return None, errors[name]
        try:
            return fn(), ""
        except Exception as e:
            traceback.print_exc()
            return None, f"load failed: {type(e).__name__}: {e}"

    flashmla, flashmla_error = load("flashmla", peers.load_flashmla)
    fi, fi_error = None, "skipped"
    if not {"attention", "flashinfer"} & skip:
        fi, fi_error = load("flashinfer", peers.load_flashinfer)
        if fi is not None:
            log(f"[peers] flashinfer: ready ({fi.version} @{fi.commit[:12]}, module "
                f"{'prebuilt by fetch-peers' if fi.prebuilt else 'JIT-compiled here'})")
        else:
            log(f"[peers] flashinfer: {fi_error}")
    dg, dg_error = load("deepgemm", peers.load_deepgemm)
    vt, vt_error = load("vllm_topk", peers.load_vllm_topk)

    dsa = None
    if not args.peers_only:
        try:
            import dsa_decode

            dsa = dsa_decode
            log(f"[peers] ours: dsa_decode from {Path(dsa_decode.__file__).parent}")
        except Exception as e:
            log(f"[peers] dsa_decode not importable ({type(e).__name__}: {e}): peers alone")

    torch.manual_seed(0)
    name = "peers.json" if dsa is not None else "peers_alone.json"
    path = out / "results" / name

    def make_report(rows_):
        return {
            "bench": "peers",
            "gpu": torch.cuda.get_device_name(0),
            "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "ours": "dsa_decode" if dsa is not None else "not run (peers alone)",
            "peers": trees,
            **({"flashinfer": {"version": fi.version, "commit": fi.commit, "module": fi.module,
                               "module_prebuilt": fi.prebuilt, "pack": fi.info}} if fi is not None else {}),
            "rows": rows_,
        }

    class Rows(list):  # written out after every row, so that a run stopped by its time limit keeps what it measured
        def append(self, row):
            super().append(row)
            path.write_text(json.dumps(make_report(list(self)), indent=1) + "\n")

    rows = Rows()
    if "attention" not in skip:
        run_attention(args, dsa, flashmla, flashmla_error, fi, fi_error, commits, skip, rows)
    if "v32" not in skip:
        env = v32.Env(
            device="cuda", time=time_graph, rotations_for=rotations_for,
            ops=dsa.ops if dsa is not None else None,
            flashmla=flashmla if "flashmla" not in skip else None,
            flashmla_error=flashmla_error if "flashmla" not in skip else "skipped (--skip flashmla)",
            commit=commits["flashmla"], replays=args.replays,
        )
        v32.run(env, [int(h) for h in args.v32_heads.split(",") if h], [int(m) for m in args.v32_tokens.split(",") if m],
                rows, log=lambda row: log(one_line(row)))
    if "indexer" not in skip:
        run_indexer(args, dsa, dg, dg_error, vt, vt_error, commits, rows)
    if "indexer_v32" not in skip:
        env = indexer_v32.Env(
            device="cuda", time=time_graph, rotations_for=rotations_for,
            ops=dsa.ops if dsa is not None else None, deepgemm=dg, topk=vt, peer_error=dg_error or vt_error,
            commits={"deepgemm": commits["deepgemm"], "vllm": commits["vllm"]}, replays=args.replays,
            num_sms=dg.get_num_sms() if dg is not None else 0,
        )
        indexer_v32.run(env, [int(c) for c in args.contexts.split(",") if c],
                        [int(m) for m in args.v32_index_tokens.split(",") if m], rows,
                        log=lambda row: log(one_line(row)))

    report = make_report(list(rows))
    packed = peers.pack_build(out, before)
    if packed:
        log(f"[peers] builds changed: packed {', '.join(str(p) for p in packed)} (unpack into .deps/ to reuse)")
    path.write_text(json.dumps(report, indent=1) + "\n")
    log(f"[peers] wrote {path} ({len(rows)} rows) in {time.time() - t0:.0f} s")
    print(table(report))
    failed = [r for r in rows if "error" in r or "baseline_error" in r]
    return 1 if failed or any(errors.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
