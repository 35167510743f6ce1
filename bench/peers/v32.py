"""Rows `sparse_mla dsv32 vs FlashMLA V32` (issue 39): our sparse_mla_v32 against FlashMLA's
sparse FP8 decode in its V3.2 format (d_qk 576, d_v 512, 656-byte entries), same cache bytes,
same BF16 query, same indices.

Inputs: the cache [blocks, 64, 656] (vLLM's block size for this format) is written once with our
sparse_mla_v32_cache_write, which writes vLLM's concat_and_cache_ds_mla bytes (per 128 values an
FP32 scale amax / 448, the e4m3 codes, then 64 BF16 RoPE values); without dsa_decode
(--peers-only) the same bytes come from `write_cache_model`, a torch model of that write.
FlashMLA reads those bytes as its "FP8 with scale" cache, viewed [blocks, 64, 1, 656]. kv_c and
k_pe ~ N(0, 1), q ~ N(0, 0.5^2) BF16 [m, H, 576]; softmax scale dsv32's 192^-0.5 * mscale^2.
K = 2048 distinct slots per token, rotation r reading region r of the cache (cold L2 as the other
rows). FlashMLA's SM90 kernel runs 64 or 128 heads: H = 16 (dsv32 at TP8) is padded to 64 (the
query's heads repeated, the first 16 compared), the padded call timed, as vLLM pads it.

Checks before timing: both sides against float64 attention on the dequantized cache (code x its
FP32 scale | RoPE): latent within 5e-3 relative Frobenius, lse within 1e-3 absolute (DESIGN.md
section 2); ours against FlashMLA reported. A failed check drops that side's time. FlashMLA's
SM90 dequantization rounds each FP32 scale to BF16: should it miss the bounds on the FP32 scales,
it is judged against float64 on its own BF16-rounded scales, and the row's note says so.

Everything device-specific comes in through `Env` (the device, the timer, the FlashMLA interface,
our ops), so that the harness logic runs on the CPU with stand-ins (bench/peers/test_v32.py)."""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from accuracy import check_baseline, latent_error, lse_error

NAME = "sparse_mla dsv32 vs FlashMLA V32"
K_TOPK = 2048
LATENT, ROPE, HEAD_DIM, GROUP, ENTRY = 512, 64, 576, 128, 656
BLOCK = 64
MIN_CACHE_SLOTS = 65536
LATENT_TOL, LSE_TOL = 5e-3, 1e-3
Q_STD = 0.5
# dsv32: qk_head_dim 192, YaRN factor 40, mscale_all_dim 1 (rope.h rope_softmax_scale).
SOFTMAX_SCALE = 192 ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2
FLASHMLA_MIN_HEADS = 64  # FlashMLA's SM90 sparse decode: h_q 64 or 128 (csrc/api/sparse_decode.h)


@dataclass
class Env:
    device: str
    time: Callable[[Callable[[int], Any], int, int], float]  # (enqueue, rotations, replays) -> us
    rotations_for: Callable[[float], int]  # bytes per launch -> copies for a cold L2
    ops: Any = None  # dsa_decode.ops, or None (peers alone)
    flashmla: Any = None  # FlashMLA's Python interface module, or None
    flashmla_error: str = ""
    commit: str = "?"
    replays: int = 50


def peer_heads(heads: int) -> int:
    """The head count FlashMLA's SM90 kernel runs for `heads` (64 or 128)."""
    if heads > 128:
        raise ValueError(f"FlashMLA's sparse decode runs at most 128 heads, asked for {heads}")
    return FLASHMLA_MIN_HEADS if heads <= FLASHMLA_MIN_HEADS else 128


def write_cache_model(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """vLLM's concat_and_cache_ds_mla entries [n, 656] uint8 for finite BF16 kv_c [n, 512] and k_pe
    [n, 64] (IEEE float32: scale = max(amax / 448, FLT_MIN), code = e4m3 RNE of x / scale).
    Bitwise on the CPU only: torch on CUDA divides by a scalar as a product with its reciprocal."""
    x = kv_c.float().view(-1, LATENT // GROUP, GROUP)
    scale = torch.clamp(x.abs().amax(dim=2) / torch.tensor(448.0), min=torch.finfo(torch.float32).tiny)
    codes = (x / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty((x.shape[0], ENTRY), dtype=torch.uint8, device=kv_c.device)
    out[:, :LATENT] = codes.view(-1, LATENT)
    out[:, LATENT : LATENT + 16] = scale.contiguous().view(torch.uint8).view(-1, 16)
    out[:, LATENT + 16 :] = k_pe.contiguous().view(torch.uint8).view(-1, 2 * ROPE)
    return out


def dequantize(entries: torch.Tensor, bf16_scales: bool = False) -> torch.Tensor:
    """[..., 656] uint8 -> [..., 576] float64: code x its group's FP32 scale (bf16_scales: the
    scale rounded to BF16 first, as FlashMLA's SM90 dequantization does), then the RoPE values."""
    shape = entries.shape[:-1]
    flat = entries.reshape(-1, ENTRY)
    codes = flat[:, :LATENT].contiguous().view(torch.float8_e4m3fn).double().view(-1, LATENT // GROUP, GROUP)
    scales = flat[:, LATENT : LATENT + 16].contiguous().view(torch.float32)
    scales = (scales.to(torch.bfloat16) if bf16_scales else scales).double()
    rope = flat[:, LATENT + 16 :].contiguous().view(torch.bfloat16).double()
    keys = torch.cat([(codes * scales[..., None]).view(-1, LATENT), rope], dim=1)
    return keys.view(*shape, HEAD_DIM)


def inputs(env: Env, heads: int, m: int, seed: int, top_k: int = K_TOPK, min_slots: int = MIN_CACHE_SLOTS):
    gen = torch.Generator(device=env.device).manual_seed(seed)
    rows = m * top_k
    rotations = env.rotations_for(rows * ENTRY)
    slots = max(min_slots, rows * rotations)
    blocks = (slots + BLOCK - 1) // BLOCK
    capacity = blocks * BLOCK
    cache = torch.zeros((blocks, BLOCK, ENTRY), dtype=torch.uint8, device=env.device)
    flat = cache.view(capacity, ENTRY)
    writer = "ours (sparse_mla_v32_cache_write)" if env.ops is not None else "the torch model of vLLM's write"
    chunk = 32768
    for start in range(0, capacity, chunk):
        n = min(chunk, capacity - start)
        kv_c = torch.randn((n, LATENT), device=env.device, generator=gen).to(torch.bfloat16)
        k_pe = torch.randn((n, ROPE), device=env.device, generator=gen).to(torch.bfloat16)
        if env.ops is not None:
            slot_mapping = torch.arange(start, start + n, dtype=torch.int64, device=env.device)
            env.ops.sparse_mla_v32_cache_write(kv_c, k_pe, slot_mapping, cache)
            if start == 0:  # our write against the model of vLLM's, on the first chunk (bitwise)
                sample = min(n, 1024)
                want = write_cache_model(kv_c[:sample].cpu(), k_pe[:sample].cpu())
                if not torch.equal(flat[:sample].cpu(), want):
                    raise RuntimeError("our cache write differs from the model of vLLM's bytes")
        else:
            flat[start : start + n] = write_cache_model(kv_c, k_pe)
    q = (torch.randn((m, heads, HEAD_DIM), device=env.device, generator=gen) * Q_STD).to(torch.bfloat16)
    idx = torch.empty((rotations, m, top_k), dtype=torch.int32, device=env.device)
    for r in range(rotations):
        perm = torch.randperm(rows, device=env.device, generator=gen).to(torch.int32) + r * rows
        idx[r] = perm.view(m, top_k)
    return dict(H=heads, m=m, K=top_k, rotations=rotations, blocks=blocks, cache=cache, q=q, idx=idx, writer=writer)


def reference(inp, rotation: int = 0, bf16_scales: bool = False):
    """float64 latent [m, H, 512] and lse [m, H] over the dequantized entries of rotation `rotation`."""
    flat = inp["cache"].view(-1, ENTRY)
    keys = dequantize(flat[inp["idx"][rotation].long()], bf16_scales)  # [m, K, 576]
    s = torch.einsum("mhd,mkd->mhk", inp["q"].double(), keys) * SOFTMAX_SCALE
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("mhk,mkd->mhd", torch.exp(s - lse[..., None]), keys[..., :LATENT]), lse


def flops(m: int, heads: int, top_k: int) -> float:
    return 2.0 * m * heads * top_k * (HEAD_DIM + LATENT)


def measure_ours(env: Env, inp, ref_latent, ref_lse) -> dict:
    m, H, R = inp["m"], inp["H"], inp["rotations"]
    latent = torch.full((m, H, LATENT), float("nan"), dtype=torch.bfloat16, device=env.device)
    lse = torch.empty((m, H), dtype=torch.float32, device=env.device)

    def ours(i):
        env.ops.sparse_mla_v32(inp["q"], inp["cache"], inp["idx"][i % R], SOFTMAX_SCALE, latent, lse)

    ours(0)
    if env.device != "cpu":
        torch.cuda.synchronize()
    res = {"latent": latent.clone(), "lse": lse.clone()}
    e_lat, e_lse = latent_error(res["latent"], ref_latent), lse_error(res["lse"], ref_lse)
    res["check_ours"] = {"latent_rel": e_lat, "lse_abs": e_lse}
    if not (e_lat <= LATENT_TOL and e_lse <= LSE_TOL):
        res["error"] = f"ours fails the contract: latent {e_lat:.2e}, lse {e_lse:.2e}"
    else:
        res["us"] = env.time(ours, R, env.replays)
        res["tflops"] = flops(m, H, inp["K"]) / (res["us"] * 1e-6) / 1e12
    return res


def flashmla_side(env: Env, inp, ref_latent, ref_lse, row: dict, ours: Optional[dict]) -> None:
    m, H, R, top_k = inp["m"], inp["H"], inp["rotations"], inp["K"]
    ph = peer_heads(H)
    q = inp["q"] if ph == H else inp["q"].repeat(1, ph // H, 1)  # heads h, h + H, ...: copies of head h % H
    q4 = q.reshape(m, 1, ph, HEAD_DIM).contiguous()
    kv4 = inp["cache"].view(inp["blocks"], BLOCK, 1, ENTRY)
    idx4 = inp["idx"].view(R, m, 1, top_k)
    sched, _ = env.flashmla.get_mla_metadata()

    def peer(i):
        return env.flashmla.flash_mla_with_kvcache(
            q4, kv4, None, None, LATENT, sched, None, SOFTMAX_SCALE, False, True, idx4[i % R]
        )

    out, plse = peer(0)  # also builds FlashMLA's tile schedule, reused by every later call
    if env.device != "cpu":
        torch.cuda.synchronize()
    p_latent = out.reshape(m, ph, LATENT)[:, :H]
    p_lse = plse.reshape(m, ph)[:, :H]
    e_lat, e_lse = check_baseline(row, p_latent, p_lse, ref_latent, ref_lse, ours)
    passed = e_lat <= LATENT_TOL and e_lse <= LSE_TOL
    if not passed:
        # FlashMLA's documented dequantization rounds each scale to BF16 (up to 2^-9 relative per
        # 128 values) where the float64 reference keeps vLLM's FP32 scales: judge it also by the
        # float64 result of its own dequantization, and say which reference it met.
        b_latent, b_lse = reference(inp, bf16_scales=True)
        e_lat2, e_lse2 = latent_error(p_latent, b_latent), lse_error(p_lse, b_lse)
        row["check_baseline_bf16_scales"] = {"latent_rel": e_lat2, "lse_abs": e_lse2}
        passed = e_lat2 <= LATENT_TOL and e_lse2 <= LSE_TOL
        if passed:
            row.setdefault("notes_baseline", []).append(
                f"FlashMLA outside the bounds of float64 on the FP32 scales (latent {e_lat:.2e}, lse {e_lse:.2e}) "
                f"but within them of float64 on its own BF16-rounded scales (latent {e_lat2:.2e}, lse {e_lse2:.2e}): timed")
    if not passed:
        row["baseline_error"] = f"FlashMLA fails the contract: latent {e_lat:.2e}, lse {e_lse:.2e}"
    else:
        row["baseline_us"] = env.time(peer, R, env.replays)
        row["baseline_tflops"] = flops(m, ph, top_k) / (row["baseline_us"] * 1e-6) / 1e12


def baseline_name(heads: int, commit: str) -> str:
    ph = peer_heads(heads)
    padded = f" at H={ph} ({heads} heads padded to {ph})" if ph != heads else ""
    return f"FlashMLA V32 (d_qk 576, 656-byte FP8 entries){padded} @{commit[:12]}"


def run(env: Env, heads_grid, tokens_grid, rows_out, log=print, top_k: int = K_TOPK, min_slots: int = MIN_CACHE_SLOTS):
    """One row per (H, m): ours and FlashMLA's V32 decode on the same bytes, each checked first."""
    for H in heads_grid:
        for m in tokens_grid:
            row = {"name": NAME, "params": {"H": H, "m": m, "K": top_k}, "baseline": baseline_name(H, env.commit)}
            notes = []
            ours = None
            try:
                inp = inputs(env, H, m, seed=3000 + 7 * H + m, top_k=top_k, min_slots=min_slots)
                notes.append(f"{inp['rotations']} regions of {m * top_k} entries in a cache of {inp['blocks']} "
                             f"blocks x {BLOCK}; written by {inp['writer']}")
                if peer_heads(H) != H:
                    notes.append(f"FlashMLA runs {peer_heads(H)} heads (its smallest): the padded call is timed, "
                                 f"the first {H} heads compared")
                ref_latent, ref_lse = reference(inp)
                if env.ops is not None:
                    ours = measure_ours(env, inp, ref_latent, ref_lse)
                    for key in ("check_ours", "us", "tflops", "error"):
                        if key in ours:
                            row[key] = ours[key]
                else:
                    notes.append("ours not run (dsa_decode not importable or --peers-only)")
                if env.flashmla is None:
                    row["baseline_error"] = env.flashmla_error or "FlashMLA not loaded"
                else:
                    try:
                        flashmla_side(env, inp, ref_latent, ref_lse, row, ours)
                    except Exception as e:
                        traceback.print_exc()
                        row["baseline_error"] = f"{type(e).__name__}: {e}"
                del inp
            except Exception as e:
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"
            if "us" in row and "baseline_us" in row:
                row["speedup"] = row["baseline_us"] / row["us"]
            row["note"] = "; ".join(notes + row.pop("notes_baseline", []))
            rows_out.append(row)
            log(row)
            if env.device != "cpu":
                torch.cuda.empty_cache()
