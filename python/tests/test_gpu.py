"""GPU tests of the Python package through PyTorch: every op's default path
against float64 within the numerics contract's bounds (DESIGN.md section 2),
the reproducible opt-ins ("seed-order" sums, "exact" logits) bitwise equal
to the library's C++ CPU reference on the same inputs, the stage's
batch-invariant mode (a token alone gives the bits it gives in a batch),
graph capture and replay with torch.cuda.CUDAGraph, stream semantics, and
the stage's two paths. They skip, with a message, without PyTorch or
without a Hopper GPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests drive the package through PyTorch, not installed here")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the package's GPU tests skip", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the kernels are built for sm_90a (H100/H200) only", allow_module_level=True)

import dsa_decode as dd  # noqa: E402

DEVICE = "cuda"
FP8 = torch.float8_e4m3fn


@pytest.fixture
def generator():
    return torch.Generator(device=DEVICE).manual_seed(7)


def bf16(shape, generator, scale=1.0):
    return (torch.randn(shape, generator=generator, device=DEVICE) * scale).to(torch.bfloat16)


def fp8_codes(shape, generator, scale=1.0):
    """Random e4m3 values (saturated, so no NaN codes)."""
    values = torch.randn(shape, generator=generator, device=DEVICE) * scale
    return values.clamp(-448, 448).to(FP8)


def bits(t):
    """BF16 bits (uint16) or FP8 codes (uint8) on the host, for the references."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    if t.dtype == FP8:
        return t.view(torch.uint8).cpu().numpy()
    return t.cpu().numpy()


def ulp_distance(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in BF16 steps between same-sign values' bits."""
    return int(np.max(np.abs(a.astype(np.int32) - b.astype(np.int32)))) if a.size else 0


def ordered(t):
    """BF16 values or FP8 e4m3 codes as integers in value order (sign and
    magnitude to two's complement; +0 and -0 both 0): one step apart = one
    BF16 ulp or one e4m3 step apart."""
    if t.dtype == torch.bfloat16:
        b = t.view(torch.int16).to(torch.int32)
        return torch.where(b >= 0, b, -(b & 0x7FFF))
    c = t.view(torch.uint8).to(torch.int32)
    return torch.where(c >= 0x80, -(c & 0x7F), c)


def head_gemv_float64(x, weight):
    """The exact sums in float64 and the contract's bound on each FP32 sum,
    2^-14 * sum |products| (head_gemv.h)."""
    xd, wd = x.double(), weight.double()
    exact = torch.einsum("thi,hij->thj", xd, wd)
    return exact, 2.0**-14 * torch.einsum("thi,hij->thj", xd.abs(), wd.abs())


def static_fp8(values, scale):
    """The stock static quant of FP32 values: -> BF16 -> x (1 / scale) -> clamp +-448 -> e4m3 (RNE)."""
    rounded = values.float().to(torch.bfloat16).float()
    return (rounded * torch.reciprocal(scale)).clamp(-448, 448).to(FP8)


def assert_head_gemv_within_the_contract(out, x, weight, scale=None):
    """head_gemv's default (tensor-core) sums against float64: each output
    between the roundings of exact - bound and exact + bound (the order of
    the FP32 sums is free within the bound, the conversions exact), and
    within 1 step (a BF16 ulp, or an e4m3 step for the FP8 absorb) of the
    float64 result rounded once."""
    exact, bound = head_gemv_float64(x, weight)
    if scale is None:
        low, high = (exact - bound).float().to(torch.bfloat16), (exact + bound).float().to(torch.bfloat16)
        nearest = exact.float().to(torch.bfloat16)
    else:
        low, high = static_fp8(exact - bound, scale), static_fp8(exact + bound, scale)
        nearest = (exact / scale.double()).clamp(-448, 448).float().to(FP8)
    got = ordered(out)
    assert bool(((ordered(low) <= got) & (got <= ordered(high))).all()), "an output outside its interval"
    steps = int((got - ordered(nearest)).abs().max())
    assert steps <= 1, f"{steps} steps from the float64 result"


# --- kernels against the C++ references ---------------------------------------


@pytest.mark.parametrize("m", [1, 4, 8])
def test_linear_gemv_is_bitwise_the_reference(m, generator):
    x, weight = bf16((m, 1536), generator), bf16((512, 1536), generator, 0.02)
    out = torch.empty((m, 512), dtype=torch.bfloat16, device=DEVICE)
    dd.linear_gemv(x, weight, out)
    torch.cuda.synchronize()
    assert np.array_equal(bits(out), dd.reference.linear_gemv(bits(x), bits(weight)))


def test_qkv_rmsnorm_is_within_one_ulp_of_the_reference_and_repeats(generator):
    m, q_size, kv_size = 4, 1536, 512
    qkv = bf16((m, q_size + kv_size), generator)
    q_weight, kv_weight = bf16((q_size,), generator), bf16((kv_size,), generator)
    q_out = torch.empty((m, q_size), dtype=torch.bfloat16, device=DEVICE)
    kv_out = torch.empty((m, kv_size), dtype=torch.bfloat16, device=DEVICE)
    dd.qkv_rmsnorm(qkv, q_weight, kv_weight, 1e-6, q_out, kv_out)
    first = (q_out.clone(), kv_out.clone())
    dd.qkv_rmsnorm(qkv, q_weight, kv_weight, 1e-6, q_out, kv_out)
    want_q, want_kv = dd.reference.qkv_rmsnorm(bits(qkv), bits(q_weight), bits(kv_weight), 1e-6)
    assert ulp_distance(bits(q_out), want_q) <= 1 and ulp_distance(bits(kv_out), want_kv) <= 1
    assert torch.equal(first[0], q_out) and torch.equal(first[1], kv_out)


def absorb_problem(generator, heads, m=4, rows=256, latent=512):
    x, weight = bf16((m, heads, rows), generator), bf16((heads, rows, latent), generator, 0.05)
    out = torch.empty((m, heads, latent), dtype=FP8, device=DEVICE)
    return x, weight, out, torch.tensor([0.02], device=DEVICE)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("heads", [8, 64])
def test_head_gemv_default_absorb_is_within_the_contract(heads, m, generator):
    x, weight, out, scale = absorb_problem(generator, heads, m)
    dd.head_gemv(x, weight, out, scale=scale)
    first = out.clone()
    dd.head_gemv(x, weight, out, scale=scale)
    torch.cuda.synchronize()
    assert torch.equal(first.view(torch.uint8), out.view(torch.uint8))  # the same bits on every run
    assert_head_gemv_within_the_contract(out, x, weight, scale)


@pytest.mark.parametrize("m", [1, 2, 16])
def test_head_gemv_default_value_up_is_within_the_contract(m, generator):
    heads, value = 8, 256
    latent, weight = bf16((m, heads, 512), generator), bf16((heads, 512, value), generator, 0.05)
    out = torch.empty((m, heads, value), dtype=torch.bfloat16, device=DEVICE)
    dd.head_gemv(latent, weight, out)
    torch.cuda.synchronize()
    assert_head_gemv_within_the_contract(out, latent, weight)


@pytest.mark.parametrize("heads", [8, 64])
def test_head_gemv_seed_order_absorb_fp8_and_cache_write_are_bitwise(heads, generator):
    m, rows, latent = 4, 256, 512
    x, weight = bf16((m, heads, rows), generator), bf16((heads, rows, latent), generator, 0.05)
    q_scale = torch.tensor([0.02], device=DEVICE)
    k_scale = torch.tensor([0.05], device=DEVICE)
    out = torch.empty((m, heads, latent), dtype=FP8, device=DEVICE)
    kv = bf16((m, latent), generator)
    cache = torch.zeros((4, 256, latent), dtype=FP8, device=DEVICE)
    slots = torch.tensor([5, 300, -1, 700], dtype=torch.int64, device=DEVICE)
    errors = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    dd.head_gemv(
        x, weight, out, scale=q_scale, cache=dd.KvCacheWrite(kv, cache, slots, k_scale, errors), sums="seed-order"
    )
    torch.cuda.synchronize()
    assert np.array_equal(bits(out), dd.reference.head_gemv(bits(x), bits(weight), fp8_scale=0.02))
    flat = cache.view(-1, latent)
    want = (kv.float() / k_scale).clamp(-448, 448).to(FP8)
    for t, slot in enumerate([5, 300, -1, 700]):
        if slot >= 0:
            assert torch.equal(flat[slot].view(torch.uint8), want[t].view(torch.uint8)), t
    written = torch.zeros(flat.shape[0], dtype=torch.bool, device=DEVICE)
    written[[5, 300, 700]] = True
    assert not flat[~written].view(torch.uint8).any()
    assert errors.item() == 0


def test_head_gemv_seed_order_value_up_is_bitwise_the_reference(generator):
    m, heads, value = 2, 8, 256
    latent, weight = bf16((m, heads, 512), generator), bf16((heads, 512, value), generator, 0.05)
    out = torch.empty((m, heads, value), dtype=torch.bfloat16, device=DEVICE)
    dd.head_gemv(latent, weight, out, sums="seed-order")
    torch.cuda.synchronize()
    assert np.array_equal(bits(out), dd.reference.head_gemv(bits(latent), bits(weight)))


def sparse_mla_problem(generator, m, heads, top_k=2176, blocks=16, spread=None):
    """spread: the scores' standard deviation (the contract's bounds hold up
    to 10), set through the codes' scale as the C++ tests do; None: codes of
    scale 4 (scores of spread about 0.06, a nearly flat softmax)."""
    softmax_scale, q_scale, k_scale = 256**-0.5, 0.05, 0.05
    sigma = 4.0 if spread is None else (spread / (softmax_scale * q_scale * k_scale * 512**0.5)) ** 0.5
    q = fp8_codes((m, heads, 512), generator, sigma)
    cache = fp8_codes((blocks, 256, 512), generator, sigma)
    indices = torch.randint(0, blocks * 256, (m, top_k), generator=generator, device=DEVICE, dtype=torch.int32)
    indices[:, -100:] = -1  # the padding of a top-k row
    return dict(
        q=q,
        q_scale=torch.tensor([q_scale], device=DEVICE),
        kv_cache=cache,
        k_scale=torch.tensor([k_scale], device=DEVICE),
        indices=indices,
        softmax_scale=softmax_scale,
        latent=torch.empty((m, heads, 512), dtype=torch.bfloat16, device=DEVICE),
        lse=torch.empty((m, heads), dtype=torch.float32, device=DEVICE),
        split_counters=torch.zeros(
            dd.sparse_mla_split_counter_count(m, heads, top_k), dtype=torch.int32, device=DEVICE
        ),
        split_partials=torch.empty(
            max(dd.sparse_mla_split_partials_count(m, heads, top_k), 1), dtype=torch.float32, device=DEVICE
        ),
    )


def sparse_mla_float64(p):
    q = p["q"].double() * p["q_scale"].double()
    kv = p["kv_cache"].view(-1, 512).double() * p["k_scale"].double()
    latent, lse = [], []
    for t in range(q.shape[0]):
        rows = p["indices"][t]
        keys = kv[rows[rows >= 0].long()]
        scores = p["softmax_scale"] * q[t] @ keys.T  # [H, valid]
        lse.append(torch.logsumexp(scores, dim=1))
        latent.append(torch.softmax(scores, dim=1) @ keys)
    return torch.stack(latent), torch.stack(lse)


@pytest.mark.parametrize("spread", [None, 1.0, 10.0])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("plan", dd.ATTENTION_PLANS)
@pytest.mark.parametrize("heads", [8, 64])
def test_sparse_mla_is_within_the_contract(heads, plan, m, spread, generator):
    """Either plan against float64: latent within 5e-3 relative Frobenius,
    lse within 1e-3 absolute (DESIGN.md section 2), the same bits on a
    second run."""
    p = sparse_mla_problem(generator, m, heads, spread=spread)
    dd.sparse_mla(**p, plan=plan)
    first = (p["latent"].clone(), p["lse"].clone())
    dd.sparse_mla(**p, plan=plan)
    torch.cuda.synchronize()
    assert torch.equal(first[0], p["latent"]) and torch.equal(first[1], p["lse"])
    want_latent, want_lse = sparse_mla_float64(p)
    error = torch.linalg.norm(p["latent"].double() - want_latent) / torch.linalg.norm(want_latent)
    assert error < 5e-3, error
    assert torch.max(torch.abs(p["lse"].double() - want_lse)) < 1e-3
    assert not p["split_counters"].any()  # left zero for the next launch


@pytest.mark.parametrize("heads", [8, 64])
def test_sparse_mla_batch_invariant_plan_gives_a_token_its_bits_in_any_batch(heads, generator):
    m = 16
    p = sparse_mla_problem(generator, m, heads, spread=3.0)
    dd.sparse_mla(**p, plan="batch-invariant")
    torch.cuda.synchronize()
    batch = (p["latent"].clone(), p["lse"].clone())
    for t in (0, 5, m - 1):
        alone = sparse_mla_problem(generator, 1, heads)
        alone.update(q=p["q"][t : t + 1], kv_cache=p["kv_cache"], indices=p["indices"][t : t + 1])
        dd.sparse_mla(**alone, plan="batch-invariant")
        torch.cuda.synchronize()
        assert torch.equal(alone["latent"][0].view(torch.int16), batch[0][t].view(torch.int16)), t
        assert torch.equal(alone["lse"][0].view(torch.int32), batch[1][t].view(torch.int32)), t


# --- errors ---------------------------------------------------------------------


def test_errors_from_the_checks_name_the_argument(generator):
    x, weight = bf16((1, 64), generator), bf16((8, 64), generator)
    with pytest.raises(dd.InvalidArgument, match="argument 'out': expected dtype bf16, got f32"):
        dd.linear_gemv(x, weight, torch.empty((1, 8), device=DEVICE))
    with pytest.raises(dd.InvalidArgument, match="argument 'out'"):
        dd.linear_gemv(x, weight, torch.empty((1, 8), dtype=torch.bfloat16))  # host memory
    # A scale quantizes an FP8 out: given with a BF16 out, the scale is the wrong argument.
    latent, w_uv = bf16((1, 8, 512), generator), bf16((8, 512, 256), generator)
    heads = torch.empty((1, 8, 256), dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(dd.InvalidArgument, match="argument 'scale': expected None for a bfloat16 out"):
        dd.head_gemv(latent, w_uv, heads, scale=torch.ones(1, device=DEVICE))


# --- graphs and streams ---------------------------------------------------------


def test_captured_graph_replays_the_eager_bits_on_new_inputs(generator):
    x, weight = bf16((4, 1536), generator), bf16((512, 1536), generator, 0.02)
    out = torch.empty((4, 512), dtype=torch.bfloat16, device=DEVICE)
    p = sparse_mla_problem(generator, 4, 64)
    dd.linear_gemv(x, weight, out)  # outside the capture first: sets the kernels' limits
    dd.sparse_mla(**p)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dd.linear_gemv(x, weight, out)
        dd.sparse_mla(**p)
    x.copy_(bf16((4, 1536), generator))
    p["q"].copy_(fp8_codes(p["q"].shape, generator, 4.0))
    graph.replay()
    torch.cuda.synchronize()
    replayed = (out.clone(), p["latent"].clone(), p["lse"].clone())
    dd.linear_gemv(x, weight, out)
    dd.sparse_mla(**p)
    torch.cuda.synchronize()
    assert torch.equal(replayed[0], out)
    assert torch.equal(replayed[1], p["latent"]) and torch.equal(replayed[2], p["lse"])


def slow_then_copy(source, target):
    """Work on the current stream that ends by writing `target`: a launch on
    another stream would read target's old contents."""
    big = torch.randn((4096, 4096), device=DEVICE)
    for _ in range(8):
        big = big @ big * 1e-3
    target.copy_(source + big[:1, :1].to(source.dtype) * 0)


@pytest.mark.parametrize("how", ["current", "int", "object"])
def test_launches_go_to_the_callers_stream(how, generator):
    x, weight = bf16((2, 1536), generator), bf16((256, 1536), generator, 0.02)
    staged = torch.zeros_like(x)
    out = torch.zeros((2, 256), dtype=torch.bfloat16, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        slow_then_copy(x, staged)
        if how == "current":
            dd.linear_gemv(staged, weight, out)
    if how != "current":  # outside the block, where the current stream is another one
        dd.linear_gemv(staged, weight, out, stream=side.cuda_stream if how == "int" else side)
    side.synchronize()
    assert np.array_equal(bits(out), dd.reference.linear_gemv(bits(x), bits(weight)))


# --- the stage ------------------------------------------------------------------


def stage_layer(generator, tp=8, index_heads=32, index_pool=4):
    c = dd.layer_config("glm5next", tp=tp)
    D, H, Q, L, P, V = (c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim)
    weights = dict(
        fused_qkv_a_proj=bf16((Q + L, D), generator, D**-0.5),
        q_a_norm=bf16((Q,), generator, 0.1) + 1,
        kv_a_norm=bf16((L,), generator, 0.1) + 1,
        q_b_proj=bf16((H * P, Q), generator, Q**-0.5),
        w_uk_t=bf16((H, P, L), generator, P**-0.5),
        w_uv=bf16((H, L, V), generator, L**-0.5),
        o_proj=bf16((D, H * V), generator, (H * V) ** -0.5),
        q_scale=torch.tensor([0.02], device=DEVICE),
        k_scale=torch.tensor([0.02], device=DEVICE),
        index_wq_b=bf16((index_heads * 128, Q), generator, Q**-0.5),
        index_wk=bf16((128, D), generator, D**-0.5),
        index_weights_proj=bf16((index_heads, D), generator, D**-0.5),
        index_compress_gate=bf16((128, D), generator, D**-0.5),
        index_k_norm_weight=torch.ones(128, device=DEVICE),
        index_k_norm_bias=torch.zeros(128, device=DEVICE),
        index_ape=torch.randn((index_pool, 128), generator=generator, device=DEVICE) * 0.1,
    )
    return c, weights


def stage_step(stage, c, weights, generator, m, context=3000):
    """m requests of one decode token each at position `context`, their
    indexer state prefilled with `context` random tokens."""
    plan = stage.indexer_plan()
    pages = plan.max_context // plan.block_size
    block_table = torch.arange(m * pages, dtype=torch.int32, device=DEVICE).view(m, pages)
    state = dd.IndexerState(
        block_table,
        torch.zeros((m, 2, plan.ring, 128), dtype=torch.bfloat16, device=DEVICE),
        torch.zeros((m * pages, plan.page_bytes), dtype=torch.uint8, device=DEVICE),
    )
    for request in range(m):
        dd.indexer_prefill(
            plan,
            bf16((context, 128), generator),
            bf16((context, 128), generator),
            weights["index_k_norm_weight"],
            weights["index_k_norm_bias"],
            weights["index_ape"],
            request,
            state,
        )
    positions = torch.full((m,), context, dtype=torch.int64, device=DEVICE)
    slots = block_table[:, context // plan.block_size].long() * plan.block_size + context % plan.block_size
    return dd.StepArgs(
        hidden=bf16((m, c.hidden_size), generator),
        positions=positions,
        token_requests=torch.arange(m, dtype=torch.int32, device=DEVICE),
        slot_mapping=slots,
        kv_cache=fp8_codes((m * pages, plan.block_size, 512), generator, 8.0),
        indexer=state,
        out=torch.empty((m, c.hidden_size), dtype=torch.bfloat16, device=DEVICE),
        error_count=torch.zeros(1, dtype=torch.int32, device=DEVICE),
    )


def replay_captured(step, args, initial):
    """Captures step() (a path that already ran uncaptured at this m), puts
    the caches back to `initial`, clears out, replays once and waits."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    restore(args, initial)
    args.out.zero_()
    graph.replay()
    torch.cuda.synchronize()


def small_stage(generator, m, max_tokens, tp=8, **choices):
    """A glm5next layer (TP8 unless told; the indexer at the choices'
    indexer_heads and indexer_pool), its stage (contexts up to 8192,
    StagePlan `choices`) and one step of m tokens."""
    c, weights = stage_layer(generator, tp, choices.get("indexer_heads", 32), choices.get("indexer_pool", 4))
    stage = dd.Stage(c, weights, dd.StagePlan(max_tokens=max_tokens, max_context=8192, **choices))
    return c, weights, stage, stage_step(stage, c, weights, generator, m)


def caches_of(args):
    return [args.kv_cache, args.indexer.ring, args.indexer.k_cache]


def restore(args, saved):
    for tensor, copy in zip(caches_of(args), saved):
        tensor.copy_(copy)


@pytest.mark.parametrize("m", [1, 4])
def test_stage_fused_agrees_with_stock_and_replays_in_a_graph(m, generator):
    c, weights, stage, args = small_stage(generator, m, max_tokens=4)
    initial = [t.clone() for t in caches_of(args)]
    assert stage.supports(m, m, m) and not stage.supports(5, 5, 5)

    stage.stock_forward(args)
    stock_out, stock_caches = args.out.clone(), [t.clone() for t in caches_of(args)]
    restore(args, initial)
    stage.forward(args)
    torch.cuda.synchronize()
    fused_out = args.out.clone()
    error = torch.linalg.norm(fused_out.double() - stock_out.double()) / torch.linalg.norm(stock_out.double())
    assert error < 2e-2, error
    for fused, stock in zip(caches_of(args), stock_caches):  # KV cache, ring and pools: bitwise
        assert torch.equal(fused.view(torch.uint8), stock.view(torch.uint8))
    assert args.error_count.item() == 0
    names = stage.step_names(args)
    assert names[0].startswith("qkv_a_proj") and "attention" in " ".join(names)

    views = stage.intermediates(m)
    slots = torch.from_dlpack(views["slots"])
    assert slots.shape == (m, 2176) and slots.dtype == torch.int32
    assert torch.from_dlpack(views["latent"]).shape == (m, c.num_heads, 512)

    replay_captured(lambda: stage.forward(args), args, initial)
    assert torch.equal(args.out, fused_out)


@pytest.mark.parametrize("heads, pool, topk", [(16, 16, 2048), (64, 8, 1024)])
def test_stage_at_other_indexer_shapes(heads, pool, topk, generator):
    """The plan's indexer shape reaches every buffer: both paths agree, the
    rows are the shape's (top-k pools plus the tail, W wide) and the
    intermediates have its heads."""
    m = 3
    c, weights, stage, args = small_stage(
        generator, m, max_tokens=4, indexer_heads=heads, indexer_pool=pool, indexer_topk=topk, ring=pool
    )
    plan = stage.indexer_plan()
    assert (plan.heads, plan.pool, plan.topk) == (heads, pool, topk)
    initial = [t.clone() for t in caches_of(args)]
    stage.stock_forward(args)
    stock_out, stock_caches = args.out.clone(), [t.clone() for t in caches_of(args)]
    stock_slots = torch.from_dlpack(stage.intermediates(m)["slots"]).clone()
    restore(args, initial)
    stage.forward(args)
    torch.cuda.synchronize()
    error = torch.linalg.norm(args.out.double() - stock_out.double()) / torch.linalg.norm(stock_out.double())
    assert error < 2e-2, error
    for fused, stock in zip(caches_of(args), stock_caches):
        assert torch.equal(fused.view(torch.uint8), stock.view(torch.uint8))
    assert args.error_count.item() == 0
    views = stage.intermediates(m)
    slots = torch.from_dlpack(views["slots"])
    assert slots.shape == (m, plan.row_width)
    assert torch.equal(slots, stock_slots)
    context = int(args.positions[0].item()) + 1  # 3001 > topk: pools selected, then the tail
    valid = (slots >= 0).sum(dim=1)
    assert torch.all(valid == topk + context % pool), valid
    assert torch.from_dlpack(views["index_q"]).shape == (m, heads, 128)
    assert torch.from_dlpack(views["head_weights"]).shape == (m, heads)
    assert torch.from_dlpack(views["index_logits"]).shape[1] == -(-8192 // pool)


def test_stage_step_errors_name_the_argument(generator):
    c, weights, stage, args = small_stage(generator, 1, max_tokens=2)
    args.out = torch.empty((1, c.hidden_size), dtype=torch.float32, device=DEVICE)
    with pytest.raises(dd.InvalidArgument, match="argument 'out'"):
        stage.forward(args)


# The plan choices the fused path's ops take, and a token count for each.
# value_up_tokens and projection_gemv_tokens put every step of the fused
# path on one of the package's ops (head_gemv value-up, linear_gemv
# projections) at that m; m = 1 at TP8 does so by default, and
# batch_invariant at every m.
OP_CHOICES = {
    "defaults": (1, {}),
    "defaults, m = 4": (4, {}),
    "opt-ins: seed-order, exact, batch-invariant attention": (
        4,
        dict(head_gemv_sums="seed-order", indexer_logits="exact", attention_plan="batch-invariant"),
    ),
    "batch_invariant": (2, dict(batch_invariant=True)),
}


@pytest.mark.parametrize("choice", list(OP_CHOICES))
def test_every_op_reproduces_the_stages_cpp_path_bit_for_bit(generator, choice):
    """Each op through the binding, fed the stage's own intermediates and
    given the plan's choices (sums, attention plan, logits), gives the bits
    the C++ stage (DsaAttentionStage::forward) wrote."""
    m, choices = OP_CHOICES[choice]
    if m > 1 and not choices.get("batch_invariant"):
        choices = dict(choices, value_up_tokens=set(range(1, m + 1)), projection_gemv_tokens=set(range(1, m + 1)))
    c, weights, stage, args = small_stage(generator, m, max_tokens=max(m, 2), **choices)
    sums = choices.get("head_gemv_sums", dd.HEAD_GEMV_SUMS[0])
    attention_plan = "batch-invariant" if choices.get("batch_invariant") else choices.get("attention_plan", "auto")
    initial = [t.clone() for t in caches_of(args)]
    stage.forward(args)
    torch.cuda.synchronize()
    assert "o_proj (GEMV)" in stage.step_names(args) and "value_up (head_gemv)" in stage.step_names(args)
    v = {name: torch.from_dlpack(array) for name, array in stage.intermediates(m).items() if array is not None}
    H, P, V, D = c.num_heads, c.qk_nope_head_dim, c.v_head_dim, c.hidden_size

    def empty(shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device=DEVICE)

    qkv = empty(v["qkv"].shape)
    dd.linear_gemv(args.hidden, weights["fused_qkv_a_proj"], qkv)
    q_c, kv_c = empty(v["q_c"].shape), empty(v["kv_c"].shape)
    dd.qkv_rmsnorm(v["qkv"], weights["q_a_norm"], weights["kv_a_norm"], c.rms_norm_eps, q_c, kv_c)
    q = empty((m, H * P))
    dd.linear_gemv(v["q_c"], weights["q_b_proj"], q)

    kv_cache = initial[0].clone()
    q_fp8 = empty((m, H, 512), FP8)
    dd.head_gemv(
        v["q"],
        weights["w_uk_t"],
        q_fp8,
        scale=weights["q_scale"],
        sums=sums,
        cache=dd.KvCacheWrite(v["kv_c"], kv_cache, args.slot_mapping, weights["k_scale"]),
    )

    plan = stage.indexer_plan()
    index_q, index_k = empty((m, 32, 128)), empty((m, 128))
    head_weights, gate = empty((m, 32), torch.float32), empty((m, 128))
    dd.indexer_project(
        plan,
        v["q_c"],
        args.hidden,
        weights["index_wq_b"],
        weights["index_wk"],
        weights["index_weights_proj"],
        weights["index_compress_gate"],
        index_q,
        index_k,
        head_weights,
        gate,
    )
    state = dd.IndexerState(args.indexer.block_table, initial[1].clone(), initial[2].clone())
    workspace = empty((plan.workspace_bytes(),), torch.uint8)
    dd.indexer_prepare(
        plan,
        v["index_q"],
        v["index_k"],
        v["head_weights"],
        v["gate"],
        weights["index_k_norm_weight"],
        weights["index_k_norm_bias"],
        weights["index_ape"],
        args.positions,
        args.token_requests,
        state,
        workspace,
    )
    slots = empty((m, 2176), torch.int32)
    dd.indexer_select(plan, args.positions, args.token_requests, state, workspace, slots)

    top_k = v["slots"].shape[1]
    latent, lse = empty((m, H, 512)), empty((m, H), torch.float32)
    counters = torch.zeros(dd.sparse_mla_split_counter_count(m, H, top_k), dtype=torch.int32, device=DEVICE)
    partials = empty((max(dd.sparse_mla_split_partials_count(m, H, top_k), 1),), torch.float32)
    dd.sparse_mla(
        v["q_fp8"],
        weights["q_scale"],
        args.kv_cache,
        weights["k_scale"],
        v["slots"],
        c.softmax_scale,
        latent,
        lse,
        counters,
        partials,
        plan=attention_plan,
    )
    heads = empty((m, H, V))
    dd.head_gemv(v["latent"], weights["w_uv"], heads, sums=sums)
    out = empty((m, D))
    dd.linear_gemv(v["heads"].reshape(m, H * V), weights["o_proj"], out)
    torch.cuda.synchronize()

    def same(a, b):
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    checks = {
        "qkv_a_proj": same(qkv, v["qkv"]),
        "norm q_c": same(q_c, v["q_c"]),
        "norm kv_c": same(kv_c, v["kv_c"]),
        "q_b_proj": same(q, v["q"].reshape(m, H * P)),
        "absorb q_fp8": same(q_fp8, v["q_fp8"]),
        "cache write": same(kv_cache, args.kv_cache),
        "indexer index_q": same(index_q, v["index_q"]),
        "indexer index_k": same(index_k, v["index_k"]),
        "indexer head_weights": same(head_weights, v["head_weights"]),
        "indexer gate": same(gate, v["gate"]),
        "indexer ring": same(state.ring, args.indexer.ring),
        "indexer k_cache": same(state.k_cache, args.indexer.k_cache),
        "indexer slots": same(slots, v["slots"]),
        "attention latent": same(latent, v["latent"]),
        "attention lse": same(lse, v["lse"]),
        "value_up": same(heads, v["heads"]),
        "o_proj": same(out, args.out),
    }
    assert all(checks.values()), [name for name, ok in checks.items() if not ok]


def token_alone(args, t):
    """Token t of a step as a step of its own (m = 1): its own rows of every
    input, the same caches and indexer state, an out of its own."""
    return dd.StepArgs(
        hidden=args.hidden[t : t + 1],
        positions=args.positions[t : t + 1],
        token_requests=args.token_requests[t : t + 1],
        slot_mapping=args.slot_mapping[t : t + 1],
        kv_cache=args.kv_cache,
        indexer=args.indexer,
        out=torch.empty_like(args.out[t : t + 1]),
        error_count=args.error_count,
    )


@pytest.mark.parametrize("tp, m", [(8, 4), (8, 16), (1, 16)])
def test_batch_invariant_stage_gives_a_token_alone_its_bits_in_the_batch(generator, tp, m):
    """StagePlan(batch_invariant=True), the one switch: a token run alone
    (m = 1) gives the `out` bits it gets in a step of m tokens, on the same
    caches (each token its own request, its own pages)."""
    c, weights, stage, args = small_stage(generator, m, max_tokens=m, tp=tp, batch_invariant=True)
    assert stage.value_up_tokens == set(range(1, m + 1))
    initial = [t.clone() for t in caches_of(args)]
    stage.forward(args)
    torch.cuda.synchronize()
    batch_out = args.out.clone()
    for t in range(m):
        restore(args, initial)
        alone = token_alone(args, t)
        stage.forward(alone)
        torch.cuda.synchronize()
        assert torch.equal(alone.out[0].view(torch.int16), batch_out[t].view(torch.int16)), f"token {t} of {m}"
    assert args.error_count.item() == 0


def test_single_token_slices_pass_the_checks(generator):
    """A token's row sliced out of a wider one ([1, 512] of a [1, 2048]
    buffer): PyTorch exports its size-1 dimension's stride as 1, which the
    C++ checks never judge (it addresses nothing), so the absorb's cache
    write takes kv_c as the norm left it in qkv's layout."""
    qkv = bf16((1, 2048), generator)
    kv = qkv[:, 1536:]
    x, weight = bf16((1, 8, 256), generator), bf16((8, 256, 512), generator, 0.05)
    out = torch.empty((1, 8, 512), dtype=FP8, device=DEVICE)
    cache = torch.zeros((2, 256, 512), dtype=FP8, device=DEVICE)
    k_scale = torch.tensor([0.05], device=DEVICE)
    slot = torch.tensor([300], dtype=torch.int64, device=DEVICE)
    dd.head_gemv(
        x, weight, out, scale=torch.tensor([0.02], device=DEVICE), cache=dd.KvCacheWrite(kv, cache, slot, k_scale)
    )
    torch.cuda.synchronize()
    want = (kv.float() / k_scale).clamp(-448, 448).to(FP8)
    assert torch.equal(cache.view(-1, 512)[300].view(torch.uint8), want[0].view(torch.uint8))


def test_stage_keeps_its_weights_alive_and_takes_parameters(generator):
    """Weights given as DLPack capsules of temporaries (nothing else owns
    them) and as nn.Parameters (autograd tensors, refused by DLPack as they
    are) give the same step as plain tensors."""
    c, weights = stage_layer(generator)
    plan = dd.StagePlan(max_tokens=1, max_context=8192)
    reference = dd.Stage(c, weights, plan)
    as_parameters = dd.Stage(
        c,
        {k: torch.nn.Parameter(w.clone(), requires_grad=True) for k, w in weights.items() if w.is_floating_point()}
        | {k: w for k, w in weights.items() if not w.is_floating_point()},
        plan,
    )
    as_capsules = dd.Stage(c, {k: torch.utils.dlpack.to_dlpack(w.clone()) for k, w in weights.items()}, plan)
    # Blocks of the clones' sizes: PyTorch's caching allocator hands back
    # freed ones, so a clone the stage did not keep would be overwritten.
    scribble = [torch.full_like(w, float("nan")) for w in weights.values()]
    args = stage_step(reference, c, weights, generator, 1)
    initial = [t.clone() for t in caches_of(args)]
    outs = []
    for stage in (reference, as_parameters, as_capsules):
        restore(args, initial)
        stage.forward(args)
        outs.append(args.out.clone())
    del scribble
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_indexer_remap_reproduces_the_stages_caller_rows(generator):
    """With caller rows (MTP draft steps 1+) the C++ stage skips the indexer
    and remaps the rows (DsaAttentionStage's indexer_remap step): the op
    gives the same slots, block_table[request, pos / 256] * 256 + pos % 256
    with -1 kept, and the indexer's state is left as it was."""
    m = 1
    c, weights, stage, args = small_stage(generator, m, max_tokens=2)
    rows = torch.full((m, 2176), -1, dtype=torch.int32, device=DEVICE)
    rows[:, :2048] = torch.randint(0, 3000, (m, 2048), generator=generator, device=DEVICE, dtype=torch.int32)
    args.topk_positions = rows
    ring, pools = args.indexer.ring.clone(), args.indexer.k_cache.clone()
    stage.forward(args)
    slots = torch.empty((m, 2176), dtype=torch.int32, device=DEVICE)
    dd.indexer_remap(stage.indexer_plan(), args.positions, args.token_requests, args.indexer, rows, slots)
    torch.cuda.synchronize()
    assert torch.equal(slots, torch.from_dlpack(stage.intermediates(m)["slots"]))
    positions = rows.clamp(min=0).long()
    block_size = stage.indexer_plan().block_size
    want = args.indexer.block_table[0].long()[positions // block_size] * block_size + positions % block_size
    assert torch.equal(slots.long(), torch.where(rows >= 0, want, -1))
    assert torch.equal(args.indexer.ring, ring) and torch.equal(args.indexer.k_cache, pools)


def test_indexer_prefill_equals_prepare_token_by_token(generator):
    """indexer.h's promise for prefill, through the binding: n tokens
    prefilled at once leave the same ring and pooled keys as a shorter
    prefill continued by prepare one token at a time."""
    plan = dd.IndexerPlan(max_tokens=1, max_context=8192, ring=4)
    pages = plan.max_context // plan.block_size
    n, prefilled = 67, 57  # neither a whole number of pools
    state = dd.IndexerState(
        torch.arange(2 * pages, dtype=torch.int32, device=DEVICE).view(2, pages),
        torch.zeros((2, 2, plan.ring, 128), dtype=torch.bfloat16, device=DEVICE),
        torch.zeros((2 * pages, plan.block_size // 4 * 132), dtype=torch.uint8, device=DEVICE),
    )
    index_k, gate = bf16((n, 128), generator), bf16((n, 128), generator)
    norm_weight = torch.rand(128, generator=generator, device=DEVICE) + 0.5
    norm_bias = torch.randn(128, generator=generator, device=DEVICE) * 0.1
    ape = torch.randn((4, 128), generator=generator, device=DEVICE) * 0.1
    dd.indexer_prefill(plan, index_k, gate, norm_weight, norm_bias, ape, 0, state)
    dd.indexer_prefill(plan, index_k[:prefilled], gate[:prefilled], norm_weight, norm_bias, ape, 1, state)
    workspace = torch.empty(plan.workspace_bytes(), dtype=torch.uint8, device=DEVICE)
    index_q = torch.zeros((1, 32, 128), dtype=torch.bfloat16, device=DEVICE)
    head_weights = torch.zeros((1, 32), dtype=torch.float32, device=DEVICE)
    request = torch.ones(1, dtype=torch.int32, device=DEVICE)
    for position in range(prefilled, n):
        dd.indexer_prepare(
            plan,
            index_q,
            index_k[position : position + 1],
            head_weights,
            gate[position : position + 1],
            norm_weight,
            norm_bias,
            ape,
            torch.tensor([position], dtype=torch.int64, device=DEVICE),
            request,
            state,
            workspace,
        )
    torch.cuda.synchronize()
    assert torch.equal(state.ring[0], state.ring[1])
    assert torch.equal(state.k_cache[:pages], state.k_cache[pages:])
    assert state.k_cache[0].any()  # the pools were written


def test_stage_stock_path_replays_in_a_graph_and_forward_runs_on_a_side_stream(generator):
    """The stock path (cuBLAS, CUB, a memset) captured through PyTorch gives
    its eager bits; the fused path launched on a side stream (its indexer
    forked from and joined to that stream) gives the bits it gives on the
    default stream."""
    m = 2
    c, weights, stage, args = small_stage(generator, m, max_tokens=2)
    initial = [t.clone() for t in caches_of(args)]
    stage.stock_forward(args)
    stock_out = args.out.clone()
    replay_captured(lambda: stage.stock_forward(args), args, initial)
    assert torch.equal(args.out, stock_out)

    restore(args, initial)
    stage.forward(args)
    fused_out = args.out.clone()
    restore(args, initial)
    args.out.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stage.forward(args)
    side.synchronize()
    assert torch.equal(args.out, fused_out)
