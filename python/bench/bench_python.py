#!/usr/bin/env python3
"""dsa_decode from Python on one Hopper GPU: the stage's decode step and its
kernels through the Python binding, and what a call costs on the host.

    python3 python/bench/bench_python.py --preset glm5next --tp 1 --tokens 4 --context 32768 --steps 20 \
        --json bench/results/python.json

With no choice options it runs the stage's defaults, the fastest paths
within the numerics contract; --batch-invariant turns on the stage's one
batch-invariance switch, and the per-kernel opt-ins (--head-gemv-sums
seed-order, --indexer-logits exact, --attention-plan batch-invariant) stay
for experts.

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
  - dsa-decode's two tables of the stage's steps (tools/gpu_path.cpp
    time_all, tools/report.cpp print_timings): each step of each path alone
    (Stage.run_steps(args, i, 1), on what the last whole run left in the
    stage's buffers), with GB/s and % of the memory floor (dsa-decode's
    bytes over the device's measured copy rate); then fused vs stock: the
    steps one path replaces in the other, the chain norm .. value_up and the
    whole stage;
  - the host time of one eager call: the plain binding, the torch.library
    op (dsa_decode.torch_ops) and an empty PyTorch op, on tiny shapes; and
    of one eager whole-stage step (ten tensors) through the extension, the
    binding and the torch.library op.

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
# The indexer's select (include/dsa_decode/indexer.h): the top 512 pools of 4
# positions, in rows of kIndexerRowWidth slots (2048 pooled + up to 3 tail + -1 padding).
INDEXER_TOP_POOLS = 512
INDEXER_POOLED_COLUMNS = INDEXER_TOP_POOLS * INDEXER_POOL
TOP_K_WIDTH = 2176
# The copy rate the memory floor divides by, measured as dsa-bench measures it
# (bench/harness.cu: kCopyProbeBytes copied kCopySamples times after kCopyWarmups).
COPY_PROBE_BYTES = 1 << 30
COPY_WARMUPS = 2
COPY_SAMPLES = 9
# Eager calls before an overhead measurement (first-launch setup, caches).
OVERHEAD_WARMUP_CALLS = 200
OVERHEAD_REPEATS = 5
# Whole stage steps per timed loop: their launches (about 20 each) stay within
# the device's queue of pending launches, so the host never waits for the GPU.
STAGE_OVERHEAD_CALLS = 10
# One step alone per call (Stage.run_steps(args, i, 1)): a few launches each.
STEP_OVERHEAD_CALLS = 20


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
    head_gemv_sums: str = "tensor-cores",
    attention_plan: str = "auto",
    indexer_logits: str = "fp32-accumulation",
    device: str = "cuda",
    batch_invariant: bool = False,
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
        batch_invariant=batch_invariant,
        head_gemv_sums=head_gemv_sums,
        indexer_logits=indexer_logits,
        attention_plan=attention_plan,
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


def launches_per_graph(copies: int) -> int:
    """LAUNCHES_PER_GRAPH rounded up to whole rotations of the weight copies:
    no copy's weights are read again sooner than `copies` launches later,
    across replays too (dsa-decode's time_all)."""
    return copies * ((LAUNCHES_PER_GRAPH + copies - 1) // copies)


def measure_copy_gbps(probe_bytes: int = COPY_PROBE_BYTES) -> float:
    """The device's copy rate, bytes read + written per second / 1e9, as
    bench/harness.cu measure_copy_GBps takes it: a device-to-device copy of
    probe_bytes (a cudaMemcpyAsync), COPY_WARMUPS untimed, then the median of
    COPY_SAMPLES copies each timed by CUDA events. dsa-decode's memory floor
    divides a step's bytes by it."""
    source = torch.full((probe_bytes,), 0x5A, dtype=torch.uint8, device="cuda")
    destination = torch.empty_like(source)
    for _ in range(COPY_WARMUPS):
        destination.copy_(source)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(COPY_SAMPLES + 1)]
    events[0].record()
    for event in events[1:]:
        destination.copy_(source)
        event.record()
    torch.cuda.synchronize()
    copy_ms = statistics.median(start.elapsed_time(end) for start, end in zip(events, events[1:]))
    del source, destination
    torch.cuda.empty_cache()  # 2 GiB the timings after it need not see held by the allocator
    return 2.0 * probe_bytes / (copy_ms * 1e-3) / 1e9


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
    per_graph = launches_per_graph(copies)
    inter = stage_intermediates(layer)
    device = inter["qkv"].device
    args = layer.args
    sums = layer.plan.head_gemv_sums
    attention_plan = "batch-invariant" if layer.plan.batch_invariant else layer.plan.attention_plan
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
            plan=attention_plan,
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
            note=f"plan {attention_plan}",
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
    per_graph = launches_per_graph(copies)
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


# --- the stage's steps, as dsa-decode times them -----------------------------

PATHS = ("fused", "stock")
# Both paths begin and end with these (as linear_gemv or cuBLASLt): the chain is every step between them.
FIRST_PROJECTION, LAST_PROJECTION = "qkv_a_proj", "o_proj"
# The stock path's three launches the fused absorb replaces, in a row (dsa-decode times them as one range).
STOCK_ABSORB_STEPS = ("cache write (concat_and_cache_mla)", "absorb (cuBLAS bmm)", "static FP8 quant")
# Each fused row against the stock row it replaces, by dsa-decode's row names
# (tools/gpu_path.cpp time_all); the table lists them in the fused path's order.
FUSED_VS_STOCK = {
    "absorb": "stock_absorb",
    "q_b_proj_gemv": "stock_q_b_proj",
    "indexer_select": "stock_indexer_select",
    "attention": "stock_attention",
    "value_up": "stock_value_up_bmm",
    "value_up_bmm": "stock_value_up_bmm",
    "o_proj_gemv": "stock_o_proj",
    "chain": "stock_chain",
    "whole_stage": "stock_whole_stage",
}


def step_bytes(layer: SyntheticLayer) -> Dict[str, float]:
    """What each step must move at the least (the memory floor's bytes), from
    the step's shapes: tools/gpu_path.cpp step_bytes(const StepShape&), term
    for term (keys: its StepBytes fields). Change them together."""
    c = layer.config
    m, D, H, Q = float(layer.tokens), c.hidden_size, c.num_heads, c.q_lora_rank
    L, P, V = c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
    bf16, fp8 = 2.0, 1.0
    w_uk, q = bf16 * H * P * L, bf16 * m * H * P
    b = {}
    b["cache_write"] = bf16 * m * L + fp8 * m * L  # kv_c read, the new entries written
    # The projections, linear_gemv or cuBLASLt alike: weights, input read, output written.
    b["qkv_a_proj"] = bf16 * (Q + L) * D + bf16 * m * D + bf16 * m * (Q + L)
    b["norm"] = bf16 * (2 * m * (Q + L) + (Q + L))
    b["q_b_proj"] = bf16 * H * P * Q + bf16 * m * Q + q
    b["absorb"] = w_uk + q + fp8 * m * H * L + b["cache_write"]
    # q, the index rows, every token's own cache rows (no sharing assumed), latent and lse.
    b["attention"] = (
        fp8 * m * H * L + 4.0 * m * TOP_K_WIDTH + fp8 * m * INDEXER_POOLED_COLUMNS * L + bf16 * m * H * L + 4.0 * m * H
    )
    b["counters"] = 4.0 * dsa_decode.sparse_mla_split_counter_count(layer.tokens, H, TOP_K_WIDTH)
    # The indexer: each pool up to the last token's read once (gpu_path.cpp says why).
    index_row = bf16 * m * INDEXER_DIM  # index_k or gate [m, 128], or their ring rows
    index_q = bf16 * m * INDEXER_HEADS * INDEXER_DIM
    b["project"] = (
        bf16 * (INDEXER_HEADS * INDEXER_DIM * Q + (2.0 * INDEXER_DIM + INDEXER_HEADS) * D)
        + bf16 * m * (Q + D)
        + index_q
        + 2 * index_row
        + 4.0 * m * INDEXER_HEADS
    )
    q_fp8_and_weights = fp8 * m * INDEXER_HEADS * INDEXER_DIM + 4.0 * m * INDEXER_HEADS
    last_context = layer.context + layer.tokens
    pools_completed = float(last_context // INDEXER_POOL - layer.context // INDEXER_POOL)
    pools_scored = float(last_context // INDEXER_POOL) if last_context > INDEXER_POOLED_COLUMNS else 0.0
    b["prepare"] = (
        index_q
        + 2 * index_row
        + 4.0 * m * INDEXER_HEADS
        + 4.0 * (2 + INDEXER_POOL) * INDEXER_DIM
        + 12.0 * m
        + q_fp8_and_weights
        + 2 * index_row
        + pools_completed * (3 * 2 * bf16 * INDEXER_DIM + INDEXER_POOL_BYTES)
    )
    top_k_rows = 4.0 * m * TOP_K_WIDTH
    b["select"] = q_fp8_and_weights + 12.0 * m + pools_scored * INDEXER_POOL_BYTES + top_k_rows
    b["stock_select"] = b["select"] + top_k_rows  # the request-local positions too
    b["value_up"] = bf16 * H * L * V + bf16 * m * H * L + bf16 * m * H * V
    b["o_proj"] = bf16 * D * H * V + bf16 * m * H * V + bf16 * m * D
    b["absorb_bmm"] = w_uk + q + bf16 * m * H * L
    b["fp8_quant"] = bf16 * m * H * L + fp8 * m * H * L
    return b


@dataclass
class StepRow:
    """One step of a path as dsa-decode's report shows it (gpu_path.cpp StepRow)."""

    name: str  # dsa-decode's JSON row name, e.g. "absorb", "stock_q_b_proj"
    label: str  # its table text
    path: str  # "shared" (both paths run it on the same inputs: timed once), "fused" or "stock"
    bytes: Optional[float]  # the floor's bytes; None: a step dsa-decode does not know


# Steps whose row does not depend on the path or the plan: the stage step's name -> (row name, label, bytes key).
SHARED_STEPS = {
    "norm": ("norm", "norm (q and kv RMSNorm, one launch)", "norm"),
    "indexer projections (GEMV)": ("indexer_project_gemv", "indexer projections (GEMV, one launch)", "project"),
    "indexer projections (cuBLASLt)": ("indexer_project", "indexer projections (cuBLASLt, 4 GEMMs)", "project"),
    "indexer prepare": ("indexer_prepare", "indexer prepare (k norm, q quant, pools)", "prepare"),
}
STOCK_STEPS = {
    "indexer select (top-k positions kept)": (
        "stock_indexer_select",
        "indexer select (the fused path's kernel, top-k positions kept)",
        "stock_select",
    ),
    "cache write (concat_and_cache_mla)": ("stock_cache_write", "concat_and_cache_mla", "cache_write"),
    "absorb (cuBLAS bmm)": ("stock_absorb_bmm", "absorb bmm (cuBLAS)", "absorb_bmm"),
    "static FP8 quant": ("stock_fp8_quant", "static FP8 quant", "fp8_quant"),
    "split counter memset": ("stock_counter_memset", "split counters memset", "counters"),
    "attention (sparse_mla)": ("stock_attention", "sparse attention (sparse_mla, stock inputs)", "attention"),
    "value_up (cuBLAS bmm)": ("stock_value_up_bmm", "value_up bmm (cuBLAS)", "value_up"),
}


def fused_steps(plan: dsa_decode.StagePlan) -> Dict[str, tuple]:
    """The fused path's own steps, labelled by the plan's choices as dsa-decode labels them."""
    tensor_cores = plan.head_gemv_sums == "tensor-cores"
    exact = plan.indexer_logits == "exact"
    return {
        "absorb + cache write (head_gemv)": (
            "absorb",
            f"absorb + FP8 quant + cache write (head_gemv{' TC' if tensor_cores else ''})",
            "absorb",
        ),
        "indexer select": (
            "indexer_select",
            f"indexer select ({'logits' if exact else 'FP32-acc. logits'}, top-512, slots)",
            "select",
        ),
        "attention (sparse_mla)": ("attention", "sparse attention (sparse_mla)", "attention"),
        "value_up (head_gemv)": ("value_up", f"value_up (head_gemv{' TC' if tensor_cores else ''})", "value_up"),
        "value_up (cuBLAS bmm)": ("value_up_bmm", "value_up (cuBLAS bmm, m not in value_up_tokens)", "value_up"),
    }


def describe_step(layer: SyntheticLayer, b: Dict[str, float], path: str, step: str, other: List[str]) -> StepRow:
    """The row of the stage's step `step` in `path` (`other`: the other path's
    step names), as tools/gpu_path.cpp describe_step names it. dsa-decode
    refuses a step it does not know; here it gets a row of its own name and
    no bytes (GB/s left blank), so the timing still shows."""
    # The projections: one row where both paths run the same kernel, else one per path.
    for projection in (FIRST_PROJECTION, "q_b_proj", LAST_PROJECTION):
        for gemv in (True, False):
            if step != f"{projection} ({'GEMV' if gemv else 'cuBLASLt'})":
                continue
            name = projection + ("_gemv" if gemv else "")
            label = projection + (" (GEMV, one launch)" if gemv else " (cuBLASLt GEMM)")
            if step in other:
                return StepRow(name, label, "shared", b[projection])
            return StepRow(name if path == "fused" else "stock_" + name, label, path, b[projection])
    if step in SHARED_STEPS:
        name, label, key = SHARED_STEPS[step]
        return StepRow(name, label, "shared", b[key])
    own = fused_steps(layer.plan) if path == "fused" else STOCK_STEPS
    if step in own:
        name, label, key = own[step]
        return StepRow(name, label, path, b[key])
    return StepRow(f"{path}_{step}", step, "shared" if step in other else path, None)


@dataclass
class StepTiming:
    """One timed range of a path's steps: a step alone, the stock absorb's
    three, a chain or the whole stage."""

    name: str  # the JSON row's name, e.g. "step fused norm", "chain stock norm .. value_up"
    row: str  # dsa-decode's row name (FUSED_VS_STOCK's keys and values)
    label: str
    path: str  # "shared", "fused" or "stock"
    steps: List[str]  # the stage's step names it runs
    us: float
    bytes: Optional[float]
    alone: bool  # one step alone: a row of the "step, alone" table and of the sums
    baseline: Optional["StepTiming"] = None  # the stock timing a fused one replaces


@dataclass
class StepTables:
    """dsa-decode's two tables from Python: each path's step names and the timings, in dsa-decode's order."""

    names: Dict[str, List[str]]  # per path
    timings: List[StepTiming]
    copy_gbps: float

    def floor_us(self, bytes_: float) -> float:
        return bytes_ / (self.copy_gbps * 1e3)

    def summed_us(self, path: str) -> float:
        """A path's steps alone, summed: the shared ones count for both paths."""
        other = "stock" if path == "fused" else "fused"
        return sum(t.us for t in self.timings if t.alone and t.path != other)


# Per path ("fused", "stock"): the stage's step names, and their rows.
PathNames = Dict[str, List[str]]
PathRows = Dict[str, List[StepRow]]


def path_step_names(layer: SyntheticLayer) -> PathNames:
    """Each path's step names, checked to run qkv_a_proj first and o_proj last
    (either kernel), as the chain's range (every step between them) assumes."""
    names = {path: layer.stages[0].step_names(layer.args, stock=path == "stock") for path in PATHS}
    for path, steps in names.items():
        ends = (FIRST_PROJECTION + " (", LAST_PROJECTION + " (")
        if len(steps) < 3 or not steps[0].startswith(ends[0]) or not steps[-1].startswith(ends[1]):
            raise RuntimeError(
                f"the stage's {path} path should run {FIRST_PROJECTION} first and {LAST_PROJECTION} last; it runs "
                f"{steps[:1]} .. {steps[-1:]} (bench_python.py's step tables assume it)"
            )
    return names


def warm_up_stages(layer: SyntheticLayer) -> None:
    """Each stage runs both paths once uncaptured, as dsa-decode's warm_up: a
    step timed alone then reads what these runs left in its stage's buffers
    (the stock path's where the paths share one)."""
    for stage in layer.stages:
        stage.forward(layer.args)
        stage.stock_forward(layer.args)
    torch.cuda.synchronize()


def time_step_range(layer: SyntheticLayer, path: str, first: int, count: int, replays: int) -> float:
    """Steps [first, first + count) of a path: Stage.run_steps captured once
    per launch, walking the stages in turn (cold weights)."""
    stages, args = layer.stages, layer.args
    copies = len(stages)
    stock = path == "stock"
    return time_graph(
        lambda i: stages[i % copies].run_steps(args, first, count, stock=stock), replays, launches_per_graph(copies)
    )


def range_bytes(rows: List[StepRow]) -> Optional[float]:
    """The floor's bytes of a run of steps: their sum, None if one is unknown."""
    return None if any(r.bytes is None for r in rows) else sum(r.bytes for r in rows)


def time_steps_alone(layer: SyntheticLayer, names: PathNames, rows: PathRows, replays: int) -> List[StepTiming]:
    """Each step of each path alone; a step both paths share, once (the fused path's)."""
    timings = []
    for path in PATHS:
        for i, (step, row) in enumerate(zip(names[path], rows[path])):
            if path == "stock" and row.path == "shared":
                continue
            us = time_step_range(layer, path, i, 1, replays)
            timings.append(
                StepTiming(f"step {path} {step}", row.name, row.label, row.path, [step], us, row.bytes, True)
            )
    return timings


def time_stock_absorb(layer: SyntheticLayer, names: PathNames, rows: PathRows, replays: int) -> List[StepTiming]:
    """The stock path's cache write, absorb bmm and FP8 quant as one range:
    what the fused absorb replaces (none where the stock path runs them
    otherwise; dsa-decode refuses that)."""
    stock = names["stock"]
    firsts = [i for i in range(len(stock) - 2) if tuple(stock[i : i + 3]) == STOCK_ABSORB_STEPS]
    if not firsts:
        return []
    first = firsts[0]
    us = time_step_range(layer, "stock", first, 3, replays)
    steps = list(STOCK_ABSORB_STEPS)
    label = "cache write + absorb bmm + FP8 quant"
    bytes_ = range_bytes(rows["stock"][first : first + 3])
    return [StepTiming(f"steps stock {label}", "stock_absorb", label, "stock", steps, us, bytes_, False)]


def time_chains(layer: SyntheticLayer, names: PathNames, rows: PathRows, replays: int) -> List[StepTiming]:
    """Each path's attention half, norm .. value_up (every step between
    qkv_a_proj and o_proj), as one run_steps range."""
    timings = []
    for path in ("stock", "fused"):
        count = len(names[path]) - 2
        us = time_step_range(layer, path, 1, count, replays)
        row = "chain" if path == "fused" else "stock_chain"
        label = ("" if path == "fused" else "stock ") + "chain norm .. value_up"
        bytes_ = range_bytes(rows[path][1 : 1 + count])
        timings.append(
            StepTiming(
                f"chain {path} norm .. value_up", row, label, path, names[path][1 : 1 + count], us, bytes_, False
            )
        )
    return timings


def whole_stage_timings(stage_us: Dict[str, float], names: PathNames, rows: PathRows) -> List[StepTiming]:
    """The whole stages, qkv_a_proj .. o_proj: time_stage's Stage.forward and
    stock_forward graphs (dsa-decode times them the same way, forward rather
    than run_steps): the whole_stage row's timings again, with their floor."""
    timings = []
    for path in ("stock", "fused"):
        row = "whole_stage" if path == "fused" else "stock_whole_stage"
        label = ("" if path == "fused" else "stock ") + "stage qkv_a_proj .. o_proj"
        name = f"stage {path} qkv_a_proj .. o_proj"
        bytes_ = range_bytes(rows[path])
        timings.append(StepTiming(name, row, label, path, list(names[path]), stage_us[path], bytes_, False))
    return timings


def time_stage_steps(layer: SyntheticLayer, stage_us: Dict[str, float], replays: int, copy_gbps: float) -> StepTables:
    """dsa-decode's step timings (tools/gpu_path.cpp time_all) through
    Stage.run_steps: each step alone, the stock absorb's three steps, both
    chains and both whole stages, each fused row linked to its stock row."""
    names = path_step_names(layer)
    b = step_bytes(layer)
    rows = {
        path: [describe_step(layer, b, path, step, names["stock" if path == "fused" else "fused"]) for step in steps]
        for path, steps in names.items()
    }
    warm_up_stages(layer)
    timings = time_steps_alone(layer, names, rows, replays)
    timings += time_stock_absorb(layer, names, rows, replays)
    timings += time_chains(layer, names, rows, replays)
    timings += whole_stage_timings(stage_us, names, rows)
    by_row = {t.row: t for t in timings}
    for fused, stock in FUSED_VS_STOCK.items():
        if fused in by_row and stock in by_row:
            by_row[fused].baseline = by_row[stock]
    return StepTables(names, timings, copy_gbps)


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


def measure_stage_call_overhead(layer: SyntheticLayer) -> Dict[str, Dict[str, float]]:
    """Host time of one eager whole-stage step (Stage.forward's ten tensors):
    the extension's run with its arguments prepared and the stream given
    (the C++ stage's checks and ~20 launches), the binding (which builds
    those arguments from StepArgs and looks up the current stream) and the
    torch.library op stage_forward; and under "steps", each path's steps
    alone through the extension (run_steps(args, i, 1): the C++ checks of
    the step arguments, then the step's launches)."""
    stage, args = layer.stages[0], layer.args
    stream = torch.cuda.current_stream().cuda_stream
    prepared = (False, *args._args(), args.error_count, stream)
    handle = dsa_decode.torch_ops.register_stage(stage)
    try:
        per_step = {}
        for stock in (False, True):
            names = stage.step_names(args, stock=stock)
            per_step["stock" if stock else "fused"] = [
                (
                    name,
                    host_us_per_call(
                        lambda i=i, s=stock: stage._stage.run_steps(s, i, 1, *prepared[1:]), STEP_OVERHEAD_CALLS
                    ),
                )
                for i, name in enumerate(names)
            ]
        return {
            "steps": per_step,
            "stage_extension": host_us_per_call(lambda: stage._stage.run(*prepared), STAGE_OVERHEAD_CALLS),
            "stage_binding": host_us_per_call(lambda: stage.forward(args), STAGE_OVERHEAD_CALLS),
            "stage_torch_op": host_us_per_call(
                lambda: dsa_decode.torch_ops.run_stage(handle, args), STAGE_OVERHEAD_CALLS
            ),
        }
    finally:
        dsa_decode.torch_ops.unregister_stage(handle)


# --- report ------------------------------------------------------------------

OVERHEAD_LABELS = {
    "aten_add_": "torch.ops.aten.add_ (empty PyTorch op baseline)",
    "extension": "dsa_decode._C.linear_gemv (extension, stream given)",
    "binding": "dsa_decode.linear_gemv (the binding)",
    "torch_op": "torch.ops.dsa_decode.linear_gemv (torch.library)",
}
STAGE_OVERHEAD_LABELS = {
    "stage_extension": "the extension's Stage.run (arguments prepared)",
    "stage_binding": "dsa_decode.Stage.forward (the binding)",
    "stage_torch_op": "torch.ops.dsa_decode.stage_forward (torch.library)",
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


def step_json_rows(tables: StepTables, params: dict) -> List[dict]:
    """The step tables' rows in dsa-decode's JSON style (tools/report.cpp
    json_row): floor_us, bw_fraction and GBps where the bytes are known,
    and each fused row's stock baseline; then the summed steps alone."""
    rows = []
    for t in tables.timings:
        row = {"name": t.name, "label": t.label, "params": params, "path": t.path, "us": number(t.us)}
        row.update(steps=t.steps, dsa_decode_row=t.row)
        if t.baseline is not None:
            stock = t.baseline
            row.update(baseline=stock.label, baseline_name=stock.name, baseline_us=number(stock.us))
            row["speedup"] = number(stock.us / t.us)
        if t.bytes is not None:
            floor = tables.floor_us(t.bytes)
            row.update(floor_us=number(floor), bw_fraction=number(floor / t.us), GBps=number(t.bytes / t.us / 1e3))
        if t.alone:
            row["note"] = "Stage.run_steps(args, i, 1) alone, on what the last whole run left in the stage's buffers"
        rows.append(row)
    fused, stock = tables.summed_us("fused"), tables.summed_us("stock")
    rows.append(
        {
            "name": "steps alone summed",
            "label": "kernels alone, summed",
            "params": params,
            "path": "fused",
            "us": number(fused),
            "baseline": "stock path's steps alone, summed",
            "baseline_us": number(stock),
            "speedup": number(stock / fused),
            "note": "the step rows' us summed per path (shared steps in both); a chain runs them back to back",
        }
    )
    return rows


def build_report(
    layer: SyntheticLayer,
    options: argparse.Namespace,
    checks: List[str],
    stage_us: Dict[str, float],
    kernels: List[KernelRow],
    overhead: Dict[str, Dict[str, float]],
    stage_overhead: Dict[str, Dict[str, float]],
    steps: StepTables,
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
    rows += step_json_rows(steps, params)
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
    for key, label in STAGE_OVERHEAD_LABELS.items():
        row = {
            "name": f"call_overhead_{key}",
            "label": label,
            "params": dict(params, calls=STAGE_OVERHEAD_CALLS),
            "us": number(stage_overhead[key]["host_us"]),
            "synced_us": number(stage_overhead[key]["synced_us"]),
            "note": "host microseconds per eager whole-stage step (the C++ checks and launches included); "
            "synced_us: with the final synchronize (the GPU's time when it is the longer)",
        }
        if key != "stage_extension":
            row.update(
                baseline=STAGE_OVERHEAD_LABELS["stage_extension"],
                baseline_us=number(stage_overhead["stage_extension"]["host_us"]),
                speedup=number(stage_overhead["stage_extension"]["host_us"] / stage_overhead[key]["host_us"]),
            )
        rows.append(row)
    for path, timings in stage_overhead["steps"].items():
        for i, (name, t) in enumerate(timings):
            rows.append(
                {
                    "name": f"host_step_{path}_{i}",
                    "label": name,
                    "path": path,
                    "params": dict(params, calls=STEP_OVERHEAD_CALLS),
                    "us": number(t["host_us"]),
                    "synced_us": number(t["synced_us"]),
                    "note": "host microseconds per eager Stage.run_steps(args, i, 1) through the extension",
                }
            )
    return {
        "bench": "python",
        "gpu": torch.cuda.get_device_name(),
        "commit": commit_of_checkout(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "dsa_decode": dsa_decode.__version__,
        "copy_GBps": number(steps.copy_gbps),
        "preset": layer.preset,
        "tp": layer.tp,
        "params": params,
        "steps": options.steps,
        "launches_per_graph": LAUNCHES_PER_GRAPH,
        "weight_copies": len(layer.stages),
        "batch_invariant": layer.plan.batch_invariant,
        "head_gemv_sums": layer.plan.head_gemv_sums,
        "attention_plan": layer.plan.attention_plan,
        "indexer_logits": layer.plan.indexer_logits,
        "value_up": value_up,
        "step_names": steps.names,
        "checks": checks,
        "rows": rows,
    }


def floor_cells(tables: StepTables, t: StepTiming) -> tuple:
    """GB/s and % of floor as dsa-decode prints them ("%9.0f", "%7.0f%%"), blank where the bytes are unknown."""
    if t.bytes is None:
        return " " * 9, " " * 8
    return f"{t.bytes / t.us / 1e3:9.0f}", f"{100 * tables.floor_us(t.bytes) / t.us:7.0f}%"


def print_step_tables(layer: SyntheticLayer, report: dict, tables: StepTables) -> None:
    """dsa-decode's two tables (tools/report.cpp print_timings), the same
    columns and labels: each step alone, then fused vs stock."""
    print(
        f"\nthe stage's steps (Stage.run_steps, as dsa-decode times them): CUDA-graph replay, median of "
        f"{report['steps']} replays of {launches_per_graph(len(layer.stages))} launches; weights rotated through "
        f"{len(layer.stages)} copies (cold L2); floor = bytes / measured copy rate {tables.copy_gbps:.0f} GB/s; "
        f"a step alone reads what the last whole run left in its stage's buffers; the stage row: Stage.forward vs "
        f"stock_forward (the whole_stage timing)"
    )
    print(f"{'step, alone':50} {'path':6} {'us':>9} {'GB/s':>9} {'% floor':>8}")
    for t in tables.timings:
        if t.alone:
            gbps, floor = floor_cells(tables, t)
            print(f"{t.label:50} {t.path:6} {t.us:9.2f} {gbps} {floor}")

    print(f"\n{'fused vs stock':50} {'fused us':>9} {'% floor':>8} {'stock us':>9} {'% floor':>8} {'speedup':>8}")
    for t in tables.timings:
        if t.baseline is not None:
            stock = t.baseline
            print(
                f"{t.label:50} {t.us:9.2f} {floor_cells(tables, t)[1]} {stock.us:9.2f} "
                f"{floor_cells(tables, stock)[1]} {stock.us / t.us:7.2f}x"
            )
    print(
        f"kernels alone, summed: fused path {tables.summed_us('fused'):.2f} us, stock path "
        f"{tables.summed_us('stock'):.2f} us (a chain runs them back to back, with PDL on the fused kernels)"
    )


def print_report(layer: SyntheticLayer, report: dict, kernels: List[KernelRow], tables: StepTables) -> None:
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
        f"{sorted(layer.stages[0].value_up_tokens)}); batch invariant {report['batch_invariant']}; head_gemv sums "
        f"{report['head_gemv_sums']}; attention plan {report['attention_plan']}; indexer logits "
        f"{report['indexer_logits']}"
    )
    for path, names in tables.names.items():
        print(f"{path} path, {len(names)} steps: {', '.join(names)}")
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

    # The whole stage is the fused vs stock table's last row, "stage qkv_a_proj .. o_proj".
    print_step_tables(layer, report, tables)

    overhead = {row["name"][len("call_overhead_") :]: row for row in report["rows"] if row["name"].startswith("call_")}
    print(
        f"\nper-call host overhead: eager, {overhead['binding']['params']['calls']} calls x {OVERHEAD_REPEATS} "
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
    print(
        f"\nper-step host time of the whole stage: eager, {STAGE_OVERHEAD_CALLS} steps x {OVERHEAD_REPEATS} (median), "
        f"m = {layer.tokens}"
    )
    print(f"{'call':55} {'us/step':>9} {'with sync':>10}")
    for key, label in STAGE_OVERHEAD_LABELS.items():
        print(f"{label:55} {overhead[key]['us']:9.2f} {overhead[key]['synced_us']:10.2f}")
    print(
        f"the binding over the extension: {overhead['stage_binding']['us'] - overhead['stage_extension']['us']:+.2f} "
        f"us per step; torch.library over the binding: "
        f"{overhead['stage_torch_op']['us'] - overhead['stage_binding']['us']:+.2f} us"
    )
    print(f"\nhost time of each step alone (the extension's run_steps(args, i, 1)), eager, {STEP_OVERHEAD_CALLS} calls")
    for path in ("fused", "stock"):
        rows = [row for row in report["rows"] if row["name"].startswith(f"host_step_{path}_")]
        print(f"{path + ' path step':55} {'us/call':>9} {'with sync':>10}")
        for row in rows:
            print(f"{row['label']:55} {row['us']:9.2f} {row['synced_us']:10.2f}")
        print(f"{'summed':55} {sum(row['us'] for row in rows):9.2f}")


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
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a token's bits independent of its batch: every kernel's invariant choice (StagePlan.batch_invariant)",
    )
    # The per-kernel choices, for experts: each default is the fastest path within the numerics contract.
    parser.add_argument("--head-gemv-sums", default=dsa_decode.HEAD_GEMV_SUMS[0], choices=dsa_decode.HEAD_GEMV_SUMS)
    parser.add_argument("--attention-plan", default=dsa_decode.ATTENTION_PLANS[0], choices=dsa_decode.ATTENTION_PLANS)
    parser.add_argument("--indexer-logits", default=dsa_decode.INDEXER_LOGITS[0], choices=dsa_decode.INDEXER_LOGITS)
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
        options.attention_plan,
        options.indexer_logits,
        batch_invariant=options.batch_invariant,
    )
    checks = check_stage(layer)
    copy_gbps = measure_copy_gbps()
    stage_us = time_stage(layer, options.steps)
    steps = time_stage_steps(layer, stage_us, options.steps, copy_gbps)
    kernels = time_kernels(layer, options.steps)
    overhead = measure_call_overhead(options.overhead_calls)
    stage_overhead = measure_stage_call_overhead(layer)
    report = build_report(layer, options, checks, stage_us, kernels, overhead, stage_overhead, steps)
    print_report(layer, report, kernels, steps)
    if options.json:
        Path(options.json).parent.mkdir(parents=True, exist_ok=True)
        with open(options.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        print(f"wrote {options.json}")
    return 0 if all(not line.startswith("FAIL") for line in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
