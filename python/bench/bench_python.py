#!/usr/bin/env python3
"""dsa_decode from Python on one Hopper GPU: the stage's decode step and its
kernels through the Python binding, and what a call costs on the host.

    python3 python/bench/bench_python.py --preset glm5next --tp 1 --tokens 4 --context 32768 --steps 20 \
        --json bench/results/python_<date>_<commit>.json

Builds a synthetic layer with PyTorch (random BF16 weights at the scales
dsa-decode draws them: std 1/sqrt(fan-in), norm gammas 1 +- 0.05, static FP8
scales 6/448; an FP8 KV cache of the context's latents, uniform in [-2, 2);
the indexer prefilled through dsa_decode.indexer_prefill from random rows of
the context's positions), then prints a table like dsa-decode's:

  - the whole step, Stage.forward against Stage.stock_forward;
  - each kernel alone through the binding (qkv_rmsnorm, head_gemv absorb,
    sparse_mla, head_gemv value-up, linear_gemv o_proj at m = 1), on the
    stage's own intermediates, with PyTorch's cuBLAS call as the baseline
    where one call does the same product;
  - the host time of one eager call: the plain binding, the torch.library
    op (dsa_decode.torch_ops) and an empty PyTorch op, on tiny shapes.

Timings are dsa-decode's: each launch captured `LAUNCHES_PER_GRAPH` times
into one CUDA graph (torch.cuda.CUDAGraph), the graph replayed --steps
times, each replay timed by CUDA events; a row is the median replay over
its launches. Weights rotate through --weight-copies copies (one Stage per
copy), so a launch reads its weights from device memory, not from L2.

Also importable: build_synthetic_layer serves python/tests/test_torch_ops.py.
"""

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

import dsa_decode
import dsa_decode.torch_ops  # noqa: F401  (registers torch.ops.dsa_decode.*)
from dsa_decode import IndexerState, KvCacheWrite, StepArgs

# The layer dsa-decode synthesizes (tools/synthetic_layer.h): 256-token KV
# blocks, the indexer's ring of 8 (up to RING - 3 = 5 tokens of one request
# per step; token t belongs to request t // 5).
BLOCK_SIZE = 256
RING = 8
TOKENS_PER_REQUEST = RING - 3
INDEXER_HEADS = 32
INDEXER_DIM = 128
INDEXER_POOL = 4
INDEXER_POOL_BYTES = INDEXER_DIM + 4
# Static FP8 scales are amax / 448 with an amax of 6 sigma for unit-variance activations.
FP8_E4M3_MAX = 448.0
CALIBRATED_AMAX = 6.0
# Launches per captured graph at the least: the graph launch's own cost is spread over them (as in dsa-bench).
LAUNCHES_PER_GRAPH = 20
# Eager calls before an overhead measurement (first-launch setup, caches).
OVERHEAD_WARMUP_CALLS = 200
OVERHEAD_REPEATS = 5


# --- the synthetic layer -----------------------------------------------------


@dataclass
class SyntheticLayer:
    """One rank's layer and one decode step's inputs, all on the GPU.

    weights: one dict per copy (the same values; WEIGHT_NAMES keys), stages:
    one Stage per copy, args: the step (shared by every stage: they write
    the same KV-cache slots and indexer entries with the same bytes)."""

    preset: str
    tp: int
    tokens: int
    context: int
    config: dsa_decode.LayerConfig
    plan: dsa_decode.StagePlan
    weights: List[Dict[str, torch.Tensor]]
    stages: List[dsa_decode.Stage]
    args: StepArgs
    requests: int
    blocks: int

    def describe(self) -> str:
        c = self.config
        return (
            f"{self.preset} TP{self.tp} (D={c.hidden_size}, H={c.num_heads}, Q={c.q_lora_rank}, "
            f"L={c.kv_lora_rank}, P={c.qk_nope_head_dim}, V={c.v_head_dim}), m={self.tokens}, context {self.context}"
        )


def _normal(generator: torch.Generator, shape, std: float, mean: float = 0.0, dtype=torch.bfloat16) -> torch.Tensor:
    values = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
    return (values * std + mean).to(dtype)


def _bf16_valued_f32(generator: torch.Generator, shape, std: float, mean: float = 0.0) -> torch.Tensor:
    # The indexer's FP32 parameters hold BF16 values, as a BF16 checkpoint converts them.
    return _normal(generator, shape, std, mean).to(torch.float32)


def _unit_uniform_bf16(generator: torch.Generator, shape) -> torch.Tensor:
    # Uniform with unit variance: the prefill's stand-in for index_k and gate rows.
    values = torch.rand(shape, generator=generator, device=generator.device, dtype=torch.float32)
    return ((values * 2 - 1) * math.sqrt(3.0)).to(torch.bfloat16)


def synthetic_weights(config: dsa_decode.LayerConfig, generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """The stage's weights (dsa_decode.WEIGHT_NAMES) with dsa-decode's scales."""
    D, H, Q = config.hidden_size, config.num_heads, config.q_lora_rank
    L, P, V = config.kv_lora_rank, config.qk_nope_head_dim, config.v_head_dim
    device = generator.device

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        # std 1/sqrt(fan-in): each product keeps its input's unit scale.
        return _normal(generator, (out_features, in_features), in_features**-0.5)

    def fp8_scale() -> torch.Tensor:
        return torch.full((1,), CALIBRATED_AMAX / FP8_E4M3_MAX, dtype=torch.float32, device=device)

    return {
        "fused_qkv_a_proj": linear(Q + L, D),
        "q_a_norm": _normal(generator, (Q,), 0.05, 1.0),
        "kv_a_norm": _normal(generator, (L,), 0.05, 1.0),
        "q_b_proj": linear(H * P, Q),
        "w_uk_t": _normal(generator, (H, P, L), P**-0.5),
        "w_uv": _normal(generator, (H, L, V), L**-0.5),
        "o_proj": linear(D, H * V),
        "q_scale": fp8_scale(),
        "k_scale": fp8_scale(),
        "index_wq_b": linear(INDEXER_HEADS * INDEXER_DIM, Q),
        "index_wk": linear(INDEXER_DIM, D),
        "index_weights_proj": linear(INDEXER_HEADS, D),
        "index_compress_gate": linear(INDEXER_DIM, D),
        "index_k_norm_weight": _bf16_valued_f32(generator, (INDEXER_DIM,), 0.05, 1.0),
        "index_k_norm_bias": _bf16_valued_f32(generator, (INDEXER_DIM,), 0.02),
        "index_ape": _bf16_valued_f32(generator, (INDEXER_POOL, INDEXER_DIM), 0.1),
    }


def build_synthetic_layer(
    preset: str = "glm5next",
    tp: int = 1,
    tokens: int = 4,
    context: int = 32768,
    weight_copies: int = 1,
    seed: int = 1,
    head_gemv_sums: str = "seed-order",
    attention_splits: str = "latency",
    indexer_logits: str = "exact",
    device: str = "cuda",
) -> SyntheticLayer:
    """A layer's stages (one per weight copy) and one decode step of `tokens`
    tokens after `context` cached ones: the tokens are positions
    context..context+tokens-1 at the KV slots of the same numbers (every
    block-table row is the identity), token t of indexer request t // 5,
    request r prefilled with positions 0..context+5r-1 (dsa-decode's layout)."""
    if not 1 <= tokens <= dsa_decode.MAX_TOKENS:
        raise ValueError(f"argument 'tokens': expected 1..{dsa_decode.MAX_TOKENS}, got {tokens}")
    if context < 0:
        raise ValueError(f"argument 'context': expected >= 0, got {context}")
    if weight_copies < 1:
        raise ValueError(f"argument 'weight_copies': expected >= 1, got {weight_copies}")
    config = dsa_decode.layer_config(preset, tp)
    plan = dsa_decode.StagePlan(
        max_tokens=tokens,
        max_context=context + tokens,
        ring=RING,
        block_size=BLOCK_SIZE,
        head_gemv_sums=head_gemv_sums,
        indexer_logits=indexer_logits,
        attention_splits=attention_splits,
    )
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)

    weights = synthetic_weights(config, generator)
    # Copies of the same values at other addresses: the stages give the same bits, from cold weights.
    copies = [weights] + [{name: t.clone() for name, t in weights.items()} for _ in range(weight_copies - 1)]
    stages = [dsa_decode.Stage(config, copy, plan) for copy in copies]

    L = config.kv_lora_rank
    requests = (tokens + TOKENS_PER_REQUEST - 1) // TOKENS_PER_REQUEST
    blocks = (context + tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
    k_scale = CALIBRATED_AMAX / FP8_E4M3_MAX
    # Earlier tokens' latents uniform in [-2, 2), as FP8 codes of latent / k_scale (|code| <= 150: never a NaN code).
    latents = torch.rand((blocks, BLOCK_SIZE, L), generator=generator, device=device, dtype=torch.float32)
    kv_cache = ((latents * 4 - 2) / k_scale).to(torch.float8_e4m3fn)
    del latents

    indexer = IndexerState(
        block_table=torch.arange(blocks, dtype=torch.int32, device=device).repeat(requests, 1),
        ring=torch.zeros((requests, 2, RING, INDEXER_DIM), dtype=torch.bfloat16, device=device),
        k_cache=torch.zeros(
            (blocks, BLOCK_SIZE // INDEXER_POOL * INDEXER_POOL_BYTES), dtype=torch.uint8, device=device
        ),
    )
    # One row per position: request r's prefill reads the same rows as request 0's (forks sharing the pages).
    history = context + TOKENS_PER_REQUEST * (requests - 1)
    index_k = _unit_uniform_bf16(generator, (max(history, 1), INDEXER_DIM))
    gate = _unit_uniform_bf16(generator, (max(history, 1), INDEXER_DIM))
    indexer_plan = stages[0].indexer_plan()
    for request in range(requests):
        prefilled = context + TOKENS_PER_REQUEST * request
        if prefilled == 0:
            continue  # nothing before the first token
        dsa_decode.indexer_prefill(
            indexer_plan,
            index_k[:prefilled],
            gate[:prefilled],
            weights["index_k_norm_weight"],
            weights["index_k_norm_bias"],
            weights["index_ape"],
            request,
            indexer,
        )

    token = torch.arange(tokens, device=device)
    args = StepArgs(
        hidden=_normal(generator, (tokens, config.hidden_size), 1.0),
        positions=(context + token).to(torch.int64),
        token_requests=(token // TOKENS_PER_REQUEST).to(torch.int32),
        slot_mapping=(context + token).to(torch.int64),
        kv_cache=kv_cache,
        indexer=indexer,
        out=torch.empty((tokens, config.hidden_size), dtype=torch.bfloat16, device=device),
        error_count=torch.zeros((1,), dtype=torch.int32, device=device),
    )
    torch.cuda.synchronize()
    return SyntheticLayer(preset, tp, tokens, context, config, plan, copies, stages, args, requests, blocks)


# --- timing ------------------------------------------------------------------


def time_graph(enqueue: Callable[[int], None], replays: int, per_graph: int = LAUNCHES_PER_GRAPH) -> float:
    """Median microseconds of one launch: enqueue(i) for i < per_graph captured
    in one CUDA graph, the graph replayed `replays` times, each replay timed by
    CUDA events and divided by per_graph. The launches run once uncaptured
    first (the library's first launch of a kernel sets its limits; cuBLAS
    picks its algorithms), as the library requires before a capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(per_graph):
            enqueue(i)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: the stage forks its indexer onto its own stream inside the capture, as dsa-bench captures it.
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        for i in range(per_graph):
            enqueue(i)
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    samples = [start.elapsed_time(end) * 1000.0 / per_graph for start, end in events]
    graph.reset()
    return statistics.median(samples)


def host_us_per_call(call: Callable[[], None], calls: int) -> Dict[str, float]:
    """Host microseconds per eager call: time.perf_counter around `calls`
    calls (median of OVERHEAD_REPEATS loops), and the same with the final
    synchronize included (equal unless the GPU fell behind the host)."""
    for _ in range(OVERHEAD_WARMUP_CALLS):
        call()
    torch.cuda.synchronize()
    host, synced = [], []
    for _ in range(OVERHEAD_REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append((issued - start) / calls * 1e6)
        synced.append((done - start) / calls * 1e6)
    return {"host_us": statistics.median(host), "synced_us": statistics.median(synced)}


# --- what is measured --------------------------------------------------------


@dataclass
class KernelRow:
    name: str
    label: str
    path: str  # "fused": the fused path's kernel; "shared": both paths run it
    us: float
    bytes: float  # the bytes its tensors hold (read or written): GB/s = bytes / us / 1e3
    baseline: str = ""
    baseline_us: float = 0.0
    note: str = ""


def nbytes(*tensors: torch.Tensor) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors))


def stage_intermediates(layer: SyntheticLayer) -> Dict[str, torch.Tensor]:
    """Copies of the first stage's buffers after a fused step (FP8 ones as float8_e4m3fn)."""
    stage = layer.stages[0]
    stage.forward(layer.args)
    views = stage.intermediates(layer.tokens)
    taken = {}
    for name in ("qkv", "kv_c", "q", "q_fp8", "slots", "latent", "heads"):
        tensor = torch.from_dlpack(views[name]).clone()
        taken[name] = tensor.view(torch.float8_e4m3fn) if name == "q_fp8" else tensor
    torch.cuda.synchronize()
    return taken


def time_kernels(layer: SyntheticLayer, replays: int) -> List[KernelRow]:
    """Each kernel of the fused path alone through the Python binding, on the
    stage's intermediates, weights rotating through the copies."""
    c, m, w = layer.config, layer.tokens, layer.weights
    H, Q, L, V, D = c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.v_head_dim, c.hidden_size
    copies = len(w)
    per_graph = copies * ((LAUNCHES_PER_GRAPH + copies - 1) // copies)
    inter = stage_intermediates(layer)
    device = inter["qkv"].device
    args = layer.args
    sums, splits = layer.plan.head_gemv_sums, layer.plan.attention_splits
    rows = []

    q_c = torch.empty((m, Q), dtype=torch.bfloat16, device=device)
    kv_c = torch.empty((m, L), dtype=torch.bfloat16, device=device)
    us = time_graph(
        lambda i: dsa_decode.qkv_rmsnorm(
            inter["qkv"], w[i % copies]["q_a_norm"], w[i % copies]["kv_a_norm"], c.rms_norm_eps, q_c, kv_c
        ),
        replays,
        per_graph,
    )
    rows.append(
        KernelRow("norm", "norm (qkv_rmsnorm, q and kv RMSNorm)", "shared", us, nbytes(inter["qkv"], q_c, kv_c))
    )

    q_fp8 = torch.empty((m, H, L), dtype=torch.float8_e4m3fn, device=device)
    us = time_graph(
        lambda i: dsa_decode.head_gemv(
            inter["q"],
            w[i % copies]["w_uk_t"],
            q_fp8,
            scale=w[i % copies]["q_scale"],
            cache=KvCacheWrite(inter["kv_c"], args.kv_cache, args.slot_mapping, w[i % copies]["k_scale"]),
            sums=sums,
        ),
        replays,
        per_graph,
    )
    rows.append(
        KernelRow(
            "absorb",
            "absorb + FP8 quant + cache write (head_gemv)",
            "fused",
            us,
            nbytes(inter["q"], w[0]["w_uk_t"], q_fp8, inter["kv_c"]) + m * L,
            note=f"sums {sums}",
        )
    )

    top_k = inter["slots"].shape[1]
    latent = torch.empty((m, H, L), dtype=torch.bfloat16, device=device)
    lse = torch.empty((m, H), dtype=torch.float32, device=device)
    counters = torch.zeros((dsa_decode.sparse_mla_split_counter_count(m, H, top_k),), dtype=torch.int32, device=device)
    partials_count = dsa_decode.sparse_mla_split_partials_count(m, H, top_k)
    partials = torch.empty((partials_count,), dtype=torch.float32, device=device) if partials_count else None
    us = time_graph(
        lambda i: dsa_decode.sparse_mla(
            inter["q_fp8"],
            w[0]["q_scale"],
            args.kv_cache,
            w[0]["k_scale"],
            inter["slots"],
            c.softmax_scale,
            latent,
            lse,
            counters,
            partials,
            splits=splits,
        ),
        replays,
        per_graph,
    )
    # Bytes: the selected entries (at most top_k per token), q and the outputs.
    rows.append(
        KernelRow(
            "attention",
            "sparse attention (sparse_mla)",
            "fused",
            us,
            nbytes(inter["q_fp8"], latent, lse) + m * top_k * L,
            note=f"splits {splits}",
        )
    )

    heads = torch.empty((m, H, V), dtype=torch.bfloat16, device=device)
    heads_by_head = torch.empty((H, m, V), dtype=torch.bfloat16, device=device)
    latent_by_head = inter["latent"].transpose(0, 1)
    value_up_baseline_us = time_graph(
        lambda i: torch.bmm(latent_by_head, w[i % copies]["w_uv"], out=heads_by_head), replays, per_graph
    )
    us = time_graph(
        lambda i: dsa_decode.head_gemv(inter["latent"], w[i % copies]["w_uv"], heads, sums=sums), replays, per_graph
    )
    in_stage = "head_gemv" if m in layer.stages[0].value_up_tokens else "cuBLAS bmm"
    rows.append(
        KernelRow(
            "value_up",
            "value_up (head_gemv)",
            "fused",
            us,
            nbytes(inter["latent"], w[0]["w_uv"], heads),
            "torch.bmm (cuBLAS)",
            value_up_baseline_us,
            f"sums {sums}; the stage's value-up at m={m}: {in_stage}",
        )
    )

    # o_proj at m = 1 (where the stage measured linear_gemv faster), and at m where the kernel takes it.
    for rows_m in sorted({1, m}):
        if not dsa_decode.linear_gemv_supports(rows_m, H * V):
            continue
        x = inter["heads"][:rows_m].reshape(rows_m, H * V)
        out = torch.empty((rows_m, D), dtype=torch.bfloat16, device=device)
        out_baseline = torch.empty((rows_m, D), dtype=torch.bfloat16, device=device)
        baseline_us = time_graph(
            lambda i: torch.matmul(x, w[i % copies]["o_proj"].t(), out=out_baseline), replays, per_graph
        )
        us = time_graph(lambda i: dsa_decode.linear_gemv(x, w[i % copies]["o_proj"], out), replays, per_graph)
        rows.append(
            KernelRow(
                f"o_proj_m{rows_m}",
                f"o_proj m={rows_m} (linear_gemv)",
                "shared",
                us,
                nbytes(x, w[0]["o_proj"], out),
                "torch.matmul (cuBLAS)",
                baseline_us,
            )
        )
    return rows


def time_stage(layer: SyntheticLayer, replays: int) -> Dict[str, float]:
    """The whole step, each path, as graph replays walking the stages in turn."""
    copies = len(layer.stages)
    per_graph = copies * ((LAUNCHES_PER_GRAPH + copies - 1) // copies)
    stages, args = layer.stages, layer.args
    return {
        "fused": time_graph(lambda i: stages[i % copies].forward(args), replays, per_graph),
        "stock": time_graph(lambda i: stages[i % copies].stock_forward(args), replays, per_graph),
    }


def check_stage(layer: SyntheticLayer) -> List[str]:
    """Runs each path once per stage (the uncaptured runs the library needs
    before a capture) and checks what a person reading the timings would
    want to know: finite outputs, no untrusted value met, and the
    torch.library op giving Stage.forward's bits."""
    args = layer.args
    lines = []
    outputs = {}
    for path in ("fused", "stock"):
        for stage in layer.stages:
            (stage.forward if path == "fused" else stage.stock_forward)(args)
        torch.cuda.synchronize()
        outputs[path] = args.out.clone()
        finite = bool(torch.isfinite(args.out.float()).all())
        lines.append(f"{'PASS' if finite else 'FAIL'}  {path} path: out finite")
    errors = int(args.error_count.item())
    lines.append(f"{'PASS' if errors == 0 else 'FAIL'}  error counter after both paths: {errors} untrusted values met")

    # The same step again through torch.ops.dsa_decode.stage_forward: the fused path is deterministic.
    handle = dsa_decode.torch_ops.register_stage(layer.stages[0])
    try:
        dsa_decode.torch_ops.run_stage(handle, args)
    finally:
        dsa_decode.torch_ops.unregister_stage(handle)
    torch.cuda.synchronize()
    same = torch.equal(args.out.view(torch.int16), outputs["fused"].view(torch.int16))
    lines.append(
        f"{'PASS' if same else 'FAIL'}  torch.ops.dsa_decode.stage_forward: the same out bits as Stage.forward"
    )
    difference = (outputs["fused"].float() - outputs["stock"].float()).norm() / outputs["stock"].float().norm()
    lines.append(f"info  out fused vs stock: relative Frobenius difference {difference.item():.2e}")
    return lines


def measure_call_overhead(calls: int) -> Dict[str, Dict[str, float]]:
    """Host time of one eager call on tiny shapes (linear_gemv [1, 64] x [64, 64]^T):
    the empty PyTorch op, the extension with the stream given, the binding
    (which looks up PyTorch's current stream) and the torch.library op."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn((1, 64), device=device).to(torch.bfloat16)
    weight = torch.randn((64, 64), device=device).to(torch.bfloat16)
    out = torch.empty((1, 64), dtype=torch.bfloat16, device=device)
    scalar = torch.zeros((1,), dtype=torch.float32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    extension = dsa_decode._C.linear_gemv
    binding = dsa_decode.linear_gemv
    torch_op = torch.ops.dsa_decode.linear_gemv
    add_ = torch.ops.aten.add_
    return {
        "aten_add_": host_us_per_call(lambda: add_(scalar, 1), calls),
        "extension": host_us_per_call(lambda: extension(x, weight, out, stream), calls),
        "binding": host_us_per_call(lambda: binding(x, weight, out), calls),
        "torch_op": host_us_per_call(lambda: torch_op(x, weight, out), calls),
    }


# --- report ------------------------------------------------------------------

OVERHEAD_LABELS = {
    "aten_add_": "torch.ops.aten.add_ (empty PyTorch op baseline)",
    "extension": "dsa_decode._C.linear_gemv (extension, stream given)",
    "binding": "dsa_decode.linear_gemv (the binding)",
    "torch_op": "torch.ops.dsa_decode.linear_gemv (torch.library)",
}


def commit_of_checkout() -> str:
    if os.environ.get("DSA_COMMIT"):
        return os.environ["DSA_COMMIT"]
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
        return result.stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def number(value: float) -> float:
    """6 significant digits, as dsa-bench writes numbers."""
    return float(f"{value:.6g}")


def build_report(
    layer: SyntheticLayer,
    options: argparse.Namespace,
    checks: List[str],
    stage_us: Dict[str, float],
    kernels: List[KernelRow],
    overhead: Dict[str, Dict[str, float]],
) -> dict:
    c, m = layer.config, layer.tokens
    params = {"H": c.num_heads, "m": m, "context": layer.context}
    value_up = "head_gemv" if m in layer.stages[0].value_up_tokens else "cuBLAS bmm"
    rows = [
        {
            "name": "whole_stage",
            "params": params,
            "us": number(stage_us["fused"]),
            "baseline": "stock_forward",
            "baseline_us": number(stage_us["stock"]),
            "speedup": number(stage_us["stock"] / stage_us["fused"]),
            "note": f"Stage.forward through the Python binding, CUDA-graph replay; value_up ({value_up})",
        }
    ]
    for k in kernels:
        row = {"name": k.name, "label": k.label, "params": params, "path": k.path, "us": number(k.us)}
        row["GBps"] = number(k.bytes / k.us / 1e3)
        if k.baseline:
            row.update(baseline=k.baseline, baseline_us=number(k.baseline_us), speedup=number(k.baseline_us / k.us))
        if k.note:
            row["note"] = k.note
        rows.append(row)
    overhead_params = {"calls": options.overhead_calls, "m": 1, "k": 64, "n": 64}
    for key, label in OVERHEAD_LABELS.items():
        row = {
            "name": f"call_overhead_{key}",
            "label": label,
            "params": overhead_params,
            "us": number(overhead[key]["host_us"]),
            "synced_us": number(overhead[key]["synced_us"]),
            "note": "host microseconds per eager call (time.perf_counter around the loop); synced_us: with the "
            "final synchronize",
        }
        if key == "torch_op":
            row.update(
                baseline=OVERHEAD_LABELS["binding"],
                baseline_us=number(overhead["binding"]["host_us"]),
                speedup=number(overhead["binding"]["host_us"] / overhead["torch_op"]["host_us"]),
            )
        rows.append(row)
    return {
        "bench": "python",
        "gpu": torch.cuda.get_device_name(),
        "commit": commit_of_checkout(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "dsa_decode": dsa_decode.__version__,
        "preset": layer.preset,
        "tp": layer.tp,
        "params": params,
        "steps": options.steps,
        "launches_per_graph": LAUNCHES_PER_GRAPH,
        "weight_copies": len(layer.stages),
        "head_gemv_sums": layer.plan.head_gemv_sums,
        "attention_splits": layer.plan.attention_splits,
        "indexer_logits": layer.plan.indexer_logits,
        "value_up": value_up,
        "checks": checks,
        "rows": rows,
    }


def print_report(layer: SyntheticLayer, report: dict, kernels: List[KernelRow], step_names: List[str]) -> None:
    c = layer.config
    print(
        f"dsa_decode (Python) on {report['gpu']}, torch {report['torch']}, commit {report['commit']}: "
        f"{layer.describe()}"
    )
    print(
        f"synthetic layer, {len(layer.stages)} weight copies; KV cache [{layer.blocks}, {BLOCK_SIZE}, "
        f"{c.kv_lora_rank}] FP8 e4m3, new tokens at slots {layer.context}..{layer.context + layer.tokens - 1}"
    )
    print(
        f"indexer: RING {RING}, {layer.requests} request(s), request r prefilled with the {layer.context} + "
        f"{TOKENS_PER_REQUEST}r positions before its first token; block table [{layer.requests}, {layer.blocks}] "
        f"(identity rows), K cache [{layer.blocks}, {BLOCK_SIZE // INDEXER_POOL * INDEXER_POOL_BYTES}] bytes"
    )
    print(
        f"value_up in the fused path: {report['value_up']} (value_up_tokens "
        f"{sorted(layer.stages[0].value_up_tokens)}); head_gemv sums {report['head_gemv_sums']}; attention splits "
        f"{report['attention_splits']}; indexer logits {report['indexer_logits']}"
    )
    print(f"fused path launches: {', '.join(step_names)}")
    print("\nchecks (each path once per stage, uncaptured):")
    for line in report["checks"]:
        print(line)

    print(
        f"\ntimings: CUDA-graph replay, median of {report['steps']} replays of {LAUNCHES_PER_GRAPH}+ launches; "
        f"weights rotated through {len(layer.stages)} copies (cold L2); GB/s = the bytes of the op's tensors / time"
    )
    print(
        f"{'kernel, alone (Python binding)':50} {'path':6} {'us':>9} {'GB/s':>9}   {'baseline':24} {'us':>9} "
        f"{'speedup':>8}"
    )
    for k in kernels:
        line = f"{k.label:50} {k.path:6} {k.us:9.2f} {k.bytes / k.us / 1e3:9.0f}"
        if k.baseline:
            line += f"   {k.baseline:24} {k.baseline_us:9.2f} {k.baseline_us / k.us:7.2f}x"
        print(line)

    whole = report["rows"][0]
    print(f"\n{'fused vs stock':50} {'fused us':>9} {'stock us':>9} {'speedup':>8}")
    print(
        f"{'whole stage (Stage.forward vs stock_forward)':50} {whole['us']:9.2f} {whole['baseline_us']:9.2f} "
        f"{whole['speedup']:7.2f}x"
    )

    overhead = {row["name"][len("call_overhead_") :]: row for row in report["rows"] if row["name"].startswith("call_")}
    print(
        f"\nper-call host overhead: eager, {report['rows'][-1]['params']['calls']} calls x {OVERHEAD_REPEATS} "
        f"(median), linear_gemv [1, 64] x [64, 64]^T"
    )
    print(f"{'call':55} {'us/call':>9} {'with sync':>10}")
    for key, label in OVERHEAD_LABELS.items():
        print(f"{label:55} {overhead[key]['us']:9.2f} {overhead[key]['synced_us']:10.2f}")
    print(
        f"torch.library over the binding: {overhead['torch_op']['us'] - overhead['binding']['us']:+.2f} us per call; "
        f"the binding over the extension: {overhead['binding']['us'] - overhead['extension']['us']:+.2f} us "
        f"(the current-stream lookup and argument handling in Python)"
    )


def parse_options(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--preset", default="glm5next", help="model preset (glm5next; the stage refuses the others)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: the layer is one rank's")
    parser.add_argument("--tokens", type=int, default=4, help="decode tokens per step, m (1..16)")
    parser.add_argument("--context", type=int, default=32768, help="tokens cached before the step")
    parser.add_argument("--steps", type=int, default=20, help="graph replays per timing (the median is reported)")
    parser.add_argument("--weight-copies", type=int, default=10, help="weight copies rotated through (cold L2)")
    parser.add_argument("--overhead-calls", type=int, default=2000, help="eager calls per overhead measurement")
    parser.add_argument("--head-gemv-sums", default="seed-order", choices=dsa_decode.HEAD_GEMV_SUMS)
    parser.add_argument("--attention-splits", default="latency", choices=dsa_decode.ATTENTION_SPLITS)
    parser.add_argument("--indexer-logits", default="exact", choices=dsa_decode.INDEXER_LOGITS)
    parser.add_argument("--seed", type=int, default=1, help="of the synthetic layer's random values")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON (bench/results' row format)")
    options = parser.parse_args(argv)
    if options.steps < 1 or options.overhead_calls < 1:
        parser.error("--steps and --overhead-calls must be at least 1")
    return options


def main(argv: Optional[List[str]] = None) -> int:
    options = parse_options(argv)
    if not torch.cuda.is_available():
        print("bench_python: needs a CUDA GPU (Hopper: the library's kernels are built for sm_90a)", file=sys.stderr)
        return 1
    layer = build_synthetic_layer(
        options.preset,
        options.tp,
        options.tokens,
        options.context,
        options.weight_copies,
        options.seed,
        options.head_gemv_sums,
        options.attention_splits,
        options.indexer_logits,
    )
    checks = check_stage(layer)
    step_names = layer.stages[0].step_names(layer.args)
    stage_us = time_stage(layer, options.steps)
    kernels = time_kernels(layer, options.steps)
    overhead = measure_call_overhead(options.overhead_calls)
    report = build_report(layer, options, checks, stage_us, kernels, overhead)
    print_report(layer, report, kernels, step_names)
    if options.json:
        Path(options.json).parent.mkdir(parents=True, exist_ok=True)
        with open(options.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        print(f"wrote {options.json}")
    return 0 if all(not line.startswith("FAIL") for line in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
