"""GPU tests of the RoPE layers' stage through the Python package: a
DeepSeek-V3.2 (dsv32) and a GLM-5 (glm5) layer at TP8 (H = 16 and 8) built
from Python (layer_config with its rotaries, the unpooled indexer's plan,
the 656-byte KV cache), one decode step of tokens of several requests
(several tokens of one request in the step) over contexts past the
indexer's top-2048, and:

  - every op of the package fed the stage's own intermediates gives the
    bits the C++ stage wrote (linear_gemv, qkv_rmsnorm over the strided
    [m, Q + L] view, rope_absorb, sparse_mla_v32_cache_write,
    indexer_project / prepare / select, sparse_mla_v32, head_gemv);
  - each product against its reference on the stage's own inputs, within
    the bounds docs/stage.md states: the projections bitwise the CPU
    reference (linear_gemv), the norms within 1 BF16 ulp, rope_absorb's
    latent within head_gemv's tensor-core bound and its rotations within
    rope.h's bound of the float64 rotation by the table, the cache entries
    bitwise vLLM's rule, the indexer's keys within their e4m3 rounding of
    float64 (LayerNorm, RoPE, Hadamard), its logits within indexer.h's
    FP32-accumulation bound and its rows the top-2048 of them (within the
    bound of the float64 selection), the attention's latent within 5e-3
    relative Frobenius and lse within 1e-3 of float64 on the dequantized
    cache, value-up within head_gemv's bound;
  - fused against stock (caches and slots bitwise, out within 2e-2), a
    CUDA-graph replay, batch_invariant (a token alone gets its bits in the
    batch), the step's argument errors by name, Stage.from_checkpoint of a
    whole-model dsv32 layer against the stage built from its arrays, and the
    vLLM adapter installed on a dsv32 layer's tensors held as vLLM holds
    them (its forward gives Stage.forward's bits).

They skip, with a message, without PyTorch or without a Hopper GPU."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests drive the package through PyTorch, not installed here")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the package's GPU tests skip", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the kernels are built for sm_90a (H100/H200) only", allow_module_level=True)

import dsa_decode as dd  # noqa: E402
from dsa_decode.stage import stage_plan_for  # noqa: E402
from v32_model import attention_float64, v32_entry_model  # noqa: E402

DEVICE = "cuda"
FP8 = torch.float8_e4m3fn
TP = 8
BLOCK = 64  # tokens per KV block (vLLM's for V3.2; a multiple of 64 at pool 1)
MAX_CONTEXT = 8192
ENTRY, LATENT, GROUP, DIM = 656, 512, 128, 128
LATENT_TOL, LSE_TOL = 5e-3, 1e-3
PRESETS = ["dsv32", "glm5"]


def bf16(shape, gen, std=1.0, mean=0.0):
    return (torch.randn(shape, generator=gen, device=DEVICE) * std + mean).to(torch.bfloat16)


def bits(t):
    """BF16 bits (uint16) on the host, for the CPU references."""
    return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def ordered(t):
    """BF16 values as integers in value order (one step = one BF16 ulp)."""
    b = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(b >= 0, b, -(b & 0x7FFF))


def assert_between_roundings(got, exact, bound, what):
    """got (BF16) lies between the BF16 roundings of exact - bound and exact +
    bound (float64): an FP32 result within `bound` of exact, rounded once."""
    low = ordered((exact - bound).float().to(torch.bfloat16))
    high = ordered((exact + bound).float().to(torch.bfloat16))
    g = ordered(got)
    outside = ~((low <= g) & (g <= high))
    assert not bool(outside.any()), f"{what}: {int(outside.sum())} of {g.numel()} values outside their bound"


def assert_head_gemv_within_the_contract(out, x, weight, what):
    """head_gemv's tensor-core sums: each within 2^-14 x sum |products| of the exact sum."""
    exact = torch.einsum("thi,hij->thj", x.double(), weight.double())
    bound = 2.0**-14 * torch.einsum("thi,hij->thj", x.double().abs(), weight.double().abs())
    assert_between_roundings(out, exact, bound, what)


def same(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# --- a RoPE layer and one step --------------------------------------------------------------------


class RopeLayer:
    """A preset's layer at TP8 with random weights (each product near unit
    scale), its stage at `plan_fields`, and both rotaries' tables (the values
    the stage builds for itself)."""

    def __init__(self, preset, gen, **plan_fields):
        self.preset = preset
        self.c = c = dd.layer_config(preset, tp=TP)
        D, H, Q, L, P, R, V = (c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
                               c.qk_rope_head_dim, c.v_head_dim)
        self.plan = stage_plan_for(preset, max_context=MAX_CONTEXT, block_size=BLOCK, **plan_fields)
        HI = self.plan.indexer_heads
        self.weights = dict(
            fused_qkv_a_proj=bf16((Q + L + R, D), gen, D**-0.5),
            q_a_norm=bf16((Q,), gen, 0.1, 1.0),
            kv_a_norm=bf16((L,), gen, 0.1, 1.0),
            q_b_proj=bf16((H * (P + R), Q), gen, Q**-0.5),
            w_uk_t=bf16((H, P, L), gen, P**-0.5),
            w_uv=bf16((H, L, V), gen, L**-0.5),
            o_proj=bf16((D, H * V), gen, (H * V) ** -0.5),
            index_wq_b=bf16((HI * DIM, Q), gen, Q**-0.5),
            index_wk=bf16((DIM, D), gen, D**-0.5),
            index_weights_proj=bf16((HI, D), gen, D**-0.5),
            index_k_norm_weight=bf16((DIM,), gen, 0.1, 1.0).float(),
            index_k_norm_bias=bf16((DIM,), gen, 0.1).float(),
        )
        self.stage = dd.Stage(c, self.weights, self.plan)
        self.iplan = self.stage.indexer_plan()
        self.table = torch.from_numpy(dd.rope_cos_sin_table(c.rope, 0, MAX_CONTEXT)).to(DEVICE)
        self.itable = torch.from_numpy(dd.rope_cos_sin_table(c.indexer_rope, 0, MAX_CONTEXT)).to(DEVICE)


class RopeStep:
    """m tokens over min(m, 3) requests: token t is request t % r's next
    position (request r decodes from 2300 + 700 r), so a request holds
    several consecutive tokens of the step and every token's indexer selects
    (L > 2048). The KV cache holds 656-byte entries of latents and RoPE
    values of stddev 0.3 (scores of stddev ~1); the indexer's K cache is
    prefilled from random rows of each request's context."""

    def __init__(self, layer, m, gen):
        c = layer.c
        self.m, self.requests = m, min(m, 3)
        nxt = [2300 + 700 * r for r in range(self.requests)]
        positions, requests = [], []
        for t in range(m):
            r = t % self.requests
            requests.append(r)
            positions.append(nxt[r])
            nxt[r] += 1
        self.width = (max(positions) + 1 + BLOCK - 1) // BLOCK
        self.blocks = self.requests * self.width + 2
        order = torch.randperm(self.blocks, generator=torch.Generator().manual_seed(m + 101))
        self.block_table = order[: self.requests * self.width].view(self.requests, self.width).int().to(DEVICE)
        self.positions = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
        self.token_requests = torch.tensor(requests, dtype=torch.int32, device=DEVICE)
        self.slot_mapping = torch.tensor([self.slot_of(r, p) for r, p in zip(requests, positions)],
                                         dtype=torch.int64, device=DEVICE)
        self.hidden = bf16((m, c.hidden_size), gen)
        slots = self.blocks * BLOCK
        self.kv_cache = torch.zeros((self.blocks, BLOCK, ENTRY), dtype=torch.uint8, device=DEVICE)
        dd.sparse_mla_v32_cache_write(bf16((slots, LATENT), gen, 0.3), bf16((slots, 64), gen, 0.3),
                                      torch.arange(slots, dtype=torch.int64, device=DEVICE), self.kv_cache)
        self.k_cache = torch.zeros((self.blocks, layer.iplan.page_bytes), dtype=torch.uint8, device=DEVICE)
        self.state = dd.IndexerState(self.block_table, None, self.k_cache)
        self.context_keys = []
        for r in range(self.requests):
            k = bf16((positions[r], DIM), gen)  # token r is request r's first: positions 0..p - 1
            self.context_keys.append(k)
            dd.indexer_prefill(layer.iplan, k, None, layer.weights["index_k_norm_weight"],
                               layer.weights["index_k_norm_bias"], None, r, self.state, cos_sin=layer.itable)
        self.out = torch.full((m, c.hidden_size), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        self.errors = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        torch.cuda.synchronize()
        self.initial = (self.kv_cache.clone(), self.k_cache.clone())

    def slot_of(self, request, position):
        return int(self.block_table[request, position // BLOCK]) * BLOCK + position % BLOCK

    def args(self, tokens=None):
        t = slice(None) if tokens is None else tokens
        return dd.StepArgs(
            hidden=self.hidden[t],
            positions=self.positions[t],
            token_requests=self.token_requests[t],
            slot_mapping=self.slot_mapping[t],
            kv_cache=self.kv_cache,
            indexer=self.state,
            out=self.out[t],
            error_count=self.errors,
        )

    def restore(self):
        self.kv_cache.copy_(self.initial[0])
        self.k_cache.copy_(self.initial[1])
        self.errors.zero_()
        self.out.fill_(float("nan"))

    def caches(self):
        return self.kv_cache.clone(), self.k_cache.clone()


def run(layer, step, stock=False):
    step.restore()
    (layer.stage.stock_forward if stock else layer.stage.forward)(step.args())
    torch.cuda.synchronize()
    assert int(step.errors.item()) == 0
    views = layer.stage.intermediates(step.m)
    return {name: torch.from_dlpack(a).clone() for name, a in views.items() if a is not None}


def all_gemv(m):
    """The plan fields that put every projection on linear_gemv and value-up
    on head_gemv at m (the package's ops)."""
    return dict(projection_gemv_tokens=set(range(1, min(m, 8) + 1)), value_up_tokens=set(range(1, m + 1)))


def linear_rows(x, weight, out):
    """linear_gemv in launches of as many tokens as one takes (the stage's split)."""
    m, k = x.shape
    first = 0
    while first < m:
        rows = min(m - first, 8)
        while rows > 1 and not dd.linear_gemv_supports(rows, k):
            rows -= 1
        dd.linear_gemv(x[first : first + rows], weight, out[first : first + rows])
        first += rows


# --- every op against the stage's own bits -------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_every_op_reproduces_the_stages_products_bit_for_bit(preset):
    gen = torch.Generator(device=DEVICE).manual_seed(31)
    m = 4
    layer = RopeLayer(preset, gen, max_tokens=m, **all_gemv(m))
    step = RopeStep(layer, m, gen)
    v = run(layer, step)
    names = layer.stage.step_names(step.args())
    for name in ("qkv_a_proj (GEMV)", "q_b_proj (GEMV)", "o_proj (GEMV)", "value_up (head_gemv)"):
        assert name in names, (name, names)
    kv_after, k_after = step.caches()
    c, w, ip = layer.c, layer.weights, layer.iplan
    H, Q, L, P, R, V, D = (c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                           c.v_head_dim, c.hidden_size)
    HI = layer.plan.indexer_heads

    def empty(shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device=DEVICE)

    qkv = empty((m, Q + L + R))
    linear_rows(step.hidden, w["fused_qkv_a_proj"], qkv)
    q_c, kv_c = empty((m, Q)), empty((m, L))
    dd.qkv_rmsnorm(v["qkv"][:, : Q + L], w["q_a_norm"], w["kv_a_norm"], c.rms_norm_eps, q_c, kv_c)
    q = empty((m, H * (P + R)))
    linear_rows(v["q_c"], w["q_b_proj"], q)
    q3 = v["q"].view(m, H, P + R)
    q_absorbed, k_pe = empty((m, H, L + R)), empty((m, R))
    dd.rope_absorb(q3[..., :P], q3[..., P:], v["qkv"][:, Q + L :], step.positions, layer.table, w["w_uk_t"],
                   q_absorbed, k_pe, style=c.rope.style)
    kv_cache = step.initial[0].clone()
    dd.sparse_mla_v32_cache_write(v["kv_c"], v["k_pe"], step.slot_mapping, kv_cache)
    index_q, index_k, head_weights = empty((m, HI, DIM)), empty((m, DIM)), empty((m, HI), torch.float32)
    dd.indexer_project(ip, v["q_c"], step.hidden, w["index_wq_b"], w["index_wk"], w["index_weights_proj"], None,
                       index_q, index_k, head_weights, None)
    state = dd.IndexerState(step.block_table, None, step.initial[1].clone())
    workspace = empty((ip.workspace_bytes(),), torch.uint8)
    dd.indexer_prepare(ip, v["index_q"], v["index_k"], v["head_weights"], None, w["index_k_norm_weight"],
                       w["index_k_norm_bias"], None, step.positions, step.token_requests, state, workspace,
                       cos_sin=layer.itable)
    slots = empty((m, ip.row_width), torch.int32)
    dd.indexer_select(ip, step.positions, step.token_requests, state, workspace, slots)
    latent, lse = empty((m, H, LATENT)), empty((m, H), torch.float32)
    dd.sparse_mla_v32(v["q_absorbed"], kv_after, v["slots"], c.softmax_scale, latent, lse)
    heads = empty((m, H, V))
    dd.head_gemv(v["latent"], w["w_uv"], heads)
    out = empty((m, D))
    linear_rows(v["heads"].reshape(m, H * V), w["o_proj"], out)
    torch.cuda.synchronize()

    checks = {
        "qkv_a_proj": same(qkv, v["qkv"]),
        "norm q_c": same(q_c, v["q_c"]),
        "norm kv_c": same(kv_c, v["kv_c"]),
        "q_b_proj": same(q, v["q"].reshape(m, -1)),
        "rope_absorb q": same(q_absorbed, v["q_absorbed"]),
        "rope_absorb k_pe": same(k_pe, v["k_pe"]),
        "cache write": same(kv_cache, kv_after),
        "indexer index_q": same(index_q, v["index_q"]),
        "indexer index_k": same(index_k, v["index_k"]),
        "indexer head_weights": same(head_weights, v["head_weights"]),
        "indexer k_cache": same(state.k_cache, k_after),
        "indexer slots": same(slots, v["slots"]),
        "attention latent": same(latent, v["latent"]),
        "attention lse": same(lse, v["lse"]),
        "value_up": same(heads, v["heads"]),
        "o_proj": same(out, step.out),
    }
    assert all(checks.values()), [name for name, ok in checks.items() if not ok]
    for absent in ("q_fp8", "gate"):
        assert absent not in v, absent  # a NoPE layer's buffers: None here


# --- each product against its reference ----------------------------------------------------------


def rotate_float64(x, table_rows, style):
    """x [..., R] rotated in float64 by table rows [..., R] (cos | sin), and rope.h's bound per value:
    2^-22 (|a| + |b|) max(|c|, |s|)."""
    x, rows = x.double(), table_rows.double()
    half = x.shape[-1] // 2
    cos, sin = rows[..., :half], rows[..., half:]
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    bound = 2.0**-22 * (a.abs() + b.abs()) * torch.maximum(cos.abs(), sin.abs())
    out, out_bound = torch.empty_like(x), torch.empty_like(x)
    if style == "interleaved":
        out[..., 0::2], out[..., 1::2] = ra, rb
        out_bound[..., 0::2], out_bound[..., 1::2] = bound, bound
    else:
        out[..., :half], out[..., half:] = ra, rb
        out_bound[..., :half], out_bound[..., half:] = bound, bound
    return out, out_bound


def hadamard():
    """The orthonormal Sylvester Hadamard-128: H[i, j] = (-1)^popcount(i & j) / sqrt(128)."""
    parity = torch.tensor([[bin(a & b).count("1") & 1 for b in range(DIM)] for a in range(DIM)])
    return torch.where(parity == 1, -1.0, 1.0).double().to(DEVICE) / math.sqrt(DIM)


def page_keys(step, request, length):
    """A request's first `length` keys from the indexer K cache: codes [length, 128] as float64 and scales [length]."""
    pages = step.block_table[request, : (length + BLOCK - 1) // BLOCK].long()
    page = step.k_cache[pages]
    codes = page[:, : BLOCK * DIM].contiguous().view(FP8).double().view(-1, DIM)[:length]
    scales = page[:, BLOCK * DIM :].contiguous().view(torch.float32).double().reshape(-1)[:length]
    return codes, scales


def within_fp8(got, want, scale):
    """e4m3 code x scale against float64: 2^-4 relative, half a subnormal step
    of the scale, and four BF16 roundings of the row's magnitude before the quant."""
    magnitude = want.abs().amax(dim=-1, keepdim=True)
    bound = want.abs() * 2.0**-4 + scale * 2.0**-10 + 4 * magnitude * 2.0**-9
    return bool(((got - want).abs() <= bound).all())


def check_indexer(layer, step, v):
    """The step's keys against float64 (LayerNorm, the indexer's RoPE, the
    Hadamard), the logits against indexer.h's bound over the FP8 values
    prepare wrote, the rows the top-2048 of the GPU's logits and within the
    bound of the float64 selection, the slots their remap."""
    ip, m = layer.iplan, step.m
    H = ip.heads
    had = hadamard()
    w_norm = layer.weights["index_k_norm_weight"].double()
    b_norm = layer.weights["index_k_norm_bias"].double()
    for t in range(m):
        p, r = int(step.positions[t]), int(step.token_requests[t])
        codes, scales = page_keys(step, r, p + 1)
        x = v["index_k"][t].double()
        y = (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-6) * w_norm + b_norm
        rotated, _ = rotate_float64(y[:64], layer.itable[p], layer.c.indexer_rope.style)
        want = had @ torch.cat([rotated, y[64:]])
        assert within_fp8(codes[p] * scales[p], want, scales[p]), f"token {t}: its key"
    layout = ip.workspace_layout()
    ws = v["indexer_workspace"]
    q_codes = ws[layout["q_fp8"] : layout["q_fp8"] + m * H * DIM].view(FP8).double().view(m, H, DIM)
    folded = ws[layout["head_weights"] : layout["head_weights"] + m * H * 4].view(torch.float32).double().view(m, H)
    for t in range(m):
        p, r = int(step.positions[t]), int(step.token_requests[t])
        length = p + 1
        codes, scales = page_keys(step, r, length)
        dots = q_codes[t] @ codes.T
        absdots = q_codes[t].abs() @ codes.abs().T
        ref = scales * (folded[t][:, None] * dots.clamp(min=0)).sum(0)
        bound = scales.abs() * (folded[t].abs()[:, None] * (2.0**-10 * absdots + (2 * H + 6) * 2.0**-24 * dots.abs())).sum(0)
        start = layout["logits"] + t * layout["logits_stride"] * 4
        gpu = ws[start : start + length * 4].view(torch.float32).double()
        outside = (gpu - ref).abs() > bound
        assert not bool(outside.any()), f"token {t}: {int(outside.sum())} logits outside their bound"
        table = step.block_table[r].long()
        slot_row = v["slots"][t].long()
        assert bool((slot_row >= 0).all()) and ip.row_width == ip.topk  # L > 2048: every column a key
        # The rows' positions: the slots' inverse through the request's block table.
        page_of = {int(b): i for i, b in enumerate(table.tolist())}
        chosen = torch.tensor(sorted(page_of[int(s) // BLOCK] * BLOCK + int(s) % BLOCK for s in slot_row.tolist()))
        assert bool((chosen < length).all()) and len(set(chosen.tolist())) == ip.topk, f"token {t}: rows"
        gpu_cpu, ref_cpu, bound_cpu = gpu.cpu().numpy(), ref.cpu().numpy(), bound.cpu().numpy()
        order = np.lexsort((np.arange(length), -(gpu_cpu + 0.0)))
        assert np.array_equal(np.sort(order[: ip.topk]), chosen.numpy()), f"token {t}: not the top-k of its logits"
        top = np.argsort(-ref_cpu, kind="stable")[: ip.topk]
        threshold, slack = ref_cpu[top[-1]], bound_cpu[top[-1]]
        c = chosen.numpy()
        assert (ref_cpu[c] + bound_cpu[c] >= threshold - slack).all(), f"token {t}: a chosen key below the bound"
        clear = top[ref_cpu[top] - bound_cpu[top] > threshold + slack]
        assert np.isin(clear, c).all(), f"token {t}: a float64 top key clearly above the k-th left out"


@pytest.mark.parametrize("preset", PRESETS)
def test_each_product_is_within_its_bound_of_the_reference(preset):
    gen = torch.Generator(device=DEVICE).manual_seed(37)
    m = 4
    layer = RopeLayer(preset, gen, max_tokens=m, **all_gemv(m))
    step = RopeStep(layer, m, gen)
    v = run(layer, step)
    names = layer.stage.step_names(step.args())
    assert all(f"{p} (GEMV)" in names for p in ("qkv_a_proj", "q_b_proj", "o_proj")), names
    kv_after, _ = step.caches()
    c, w = layer.c, layer.weights
    H, Q, L, P, R = c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim
    # Projections: linear_gemv's bits, the CPU reference's.
    ref = dd.reference
    assert np.array_equal(bits(v["qkv"]), ref.linear_gemv(bits(step.hidden), bits(w["fused_qkv_a_proj"])))
    assert np.array_equal(bits(v["q"].reshape(m, -1)), ref.linear_gemv(bits(v["q_c"]), bits(w["q_b_proj"])))
    assert np.array_equal(bits(step.out), ref.linear_gemv(bits(v["heads"].reshape(m, -1)), bits(w["o_proj"])))
    # The norms over q_c | kv_c (k_pe not normed): within 1 BF16 ulp.
    want_q, want_kv = ref.qkv_rmsnorm(bits(v["qkv"][:, : Q + L]), bits(w["q_a_norm"]), bits(w["kv_a_norm"]),
                                      c.rms_norm_eps)
    for got, want in ((bits(v["q_c"]), want_q), (bits(v["kv_c"]), want_kv)):
        assert int(np.abs(got.astype(np.int32) - want.astype(np.int32)).max()) <= 1
    # rope_absorb: the latent columns within head_gemv's bound, the rotations within rope.h's.
    q3 = v["q"].view(m, H, P + R)
    assert_head_gemv_within_the_contract(v["q_absorbed"][..., :L], q3[..., :P], w["w_uk_t"], "rope_absorb latent")
    rows = layer.table[step.positions]
    exact, bound = rotate_float64(q3[..., P:], rows[:, None, :], c.rope.style)
    assert_between_roundings(v["q_absorbed"][..., L:], exact, bound, "rotated q_pe")
    exact, bound = rotate_float64(v["qkv"][:, Q + L :], rows, c.rope.style)
    assert_between_roundings(v["k_pe"], exact, bound, "rotated k_pe")
    # The cache write: vLLM's bytes at the step's slots, nothing else changed.
    flat = kv_after.view(-1, ENTRY)
    assert torch.equal(flat[step.slot_mapping].cpu(), v32_entry_model(v["kv_c"], v["k_pe"]))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[step.slot_mapping] = False
    assert torch.equal(flat[untouched], step.initial[0].view(-1, ENTRY)[untouched])
    # The indexer.
    check_indexer(layer, step, v)
    # The attention over the stage's rows, against float64 on the dequantized cache.
    want_latent, want_lse = attention_float64(v["q_absorbed"], kv_after, v["slots"], c.softmax_scale)
    error = float(torch.linalg.vector_norm(v["latent"].double() - want_latent) / torch.linalg.vector_norm(want_latent))
    assert error < LATENT_TOL, error
    assert float((v["lse"].double() - want_lse).abs().max()) < LSE_TOL
    # value-up.
    assert_head_gemv_within_the_contract(v["heads"], v["latent"], w["w_uv"], "value-up")


# --- the paths, graphs, batch invariance, errors --------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("m", [1, 4])
def test_fused_agrees_with_stock_and_replays_in_a_graph(preset, m):
    gen = torch.Generator(device=DEVICE).manual_seed(41 + m)
    layer = RopeLayer(preset, gen, max_tokens=4)  # the default plan: the stage's kernel per m
    step = RopeStep(layer, m, gen)
    stock = run(layer, step, stock=True)
    stock_out, stock_caches = step.out.clone(), step.caches()
    fused = run(layer, step)
    fused_out, fused_caches = step.out.clone(), step.caches()
    error = float(torch.linalg.vector_norm(fused_out.double() - stock_out.double())
                  / torch.linalg.vector_norm(stock_out.double()))
    assert error < 2e-2, error
    for a, b in zip(fused_caches, stock_caches):  # the KV cache and the indexer's keys: bitwise
        assert torch.equal(a, b)
    assert torch.equal(fused["slots"], stock["slots"])
    assert stage_path_names_are_the_rope_lists(layer, step)
    # Capture after the uncaptured call above, replay from the caches before the step.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.stage.forward(step.args())
    step.restore()
    graph.replay()
    torch.cuda.synchronize()
    assert same(step.out, fused_out)
    for a, b in zip(step.caches(), fused_caches):
        assert torch.equal(a, b)


def stage_path_names_are_the_rope_lists(layer, step):
    fused = " ".join(layer.stage.step_names(step.args()))
    stock = " ".join(layer.stage.step_names(step.args(), stock=True))
    return all(n in fused and n in stock for n in ("rope_absorb", "656-byte", "attention (sparse_mla_v32)"))


@pytest.mark.parametrize("preset", PRESETS)
def test_batch_invariant_gives_a_token_alone_its_bits_in_the_batch(preset):
    gen = torch.Generator(device=DEVICE).manual_seed(43)
    m = 6
    layer = RopeLayer(preset, gen, max_tokens=m, batch_invariant=True)
    step = RopeStep(layer, m, gen)
    run(layer, step)
    batch_out = step.out.clone()
    # Each token alone over the caches the batch left (its own entry and key
    # rewritten with the same bits; the later tokens' are past its position).
    for t in (0, 3, m - 1):
        alone = dd.StepArgs(
            hidden=step.hidden[t : t + 1],
            positions=step.positions[t : t + 1],
            token_requests=step.token_requests[t : t + 1],
            slot_mapping=step.slot_mapping[t : t + 1],
            kv_cache=step.kv_cache,
            indexer=step.state,
            out=torch.empty((1, layer.c.hidden_size), dtype=torch.bfloat16, device=DEVICE),
            error_count=step.errors,
        )
        layer.stage.forward(alone)
        torch.cuda.synchronize()
        assert same(alone.out, batch_out[t : t + 1]), f"token {t}"
    assert int(step.errors.item()) == 0


def test_the_steps_errors_name_the_argument():
    gen = torch.Generator(device=DEVICE).manual_seed(47)
    layer = RopeLayer("dsv32", gen, max_tokens=2)
    step = RopeStep(layer, 2, gen)
    args = step.args()
    args.kv_cache = torch.zeros((step.blocks, BLOCK, LATENT), dtype=torch.uint8, device=DEVICE)  # NoPE's entries
    with pytest.raises(dd.InvalidArgument, match="argument 'kv_cache'"):
        layer.stage.forward(args)
    args = step.args()
    args.out = torch.empty((2, layer.c.hidden_size), dtype=torch.float32, device=DEVICE)
    with pytest.raises(dd.InvalidArgument, match="argument 'out'"):
        layer.stage.forward(args)
    args = step.args()
    args.indexer = dd.IndexerState(step.block_table, None, step.k_cache[:, :100])
    with pytest.raises(dd.InvalidArgument, match="k_cache"):
        layer.stage.forward(args)


def test_torch_ops_stage_forward_takes_no_ring():
    import dsa_decode.torch_ops as torch_ops

    gen = torch.Generator(device=DEVICE).manual_seed(53)
    layer = RopeLayer("glm5", gen, max_tokens=2)
    step = RopeStep(layer, 2, gen)
    run(layer, step)
    want = step.out.clone()
    handle = torch_ops.register_stage(layer.stage)
    try:
        step.restore()
        torch_ops.run_stage(handle, step.args())
        torch.cuda.synchronize()
        assert same(step.out, want)
    finally:
        torch_ops.unregister_stage(handle)


# --- Stage.from_checkpoint ------------------------------------------------------------------------


def test_stage_from_a_dsv32_checkpoint_runs_the_bits_of_the_stage_from_its_arrays(tmp_path):
    """A whole-model dsv32 layer (128 heads, BF16, one file; its indexer's
    LayerNorm in F32, as DeepSeek's checkpoints hold it) loaded at TP8 on
    rank 5: the loader's arrays are the hand-split ones, and the stage from
    the checkpoint gives the bits of the stage built from them."""
    from test_checkpoint import bf16_round, name, write_safetensors

    layer_index, rank = 3, 5
    c = dd.layer_config("dsv32", tp=TP)
    D, H, Q, L, P, R, V = (c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
                           c.qk_rope_head_dim, c.v_head_dim)
    heads, HI = H * TP, 64
    rng = np.random.default_rng(19)
    shapes = {
        "q_a_proj.weight": (Q, D),
        "q_b_proj.weight": (heads * (P + R), Q),
        "kv_a_proj_with_mqa.weight": (L + R, D),
        "kv_b_proj.weight": (heads * (P + V), L),
        "o_proj.weight": (D, heads * V),
        "indexer.wq_b.weight": (HI * DIM, Q),
        "indexer.wk.weight": (DIM, D),
        "indexer.weights_proj.weight": (HI, D),
    }
    tensors, v = [], {}
    for suffix, shape in shapes.items():
        v[suffix] = bf16_round(rng.standard_normal(shape, dtype=np.float32) * shape[1] ** -0.5)
        tensors.append((name(suffix, layer_index), "BF16", v[suffix]))
    for suffix, shape, dtype in (("q_a_layernorm.weight", (Q,), "BF16"), ("kv_a_layernorm.weight", (L,), "BF16"),
                                 ("indexer.k_norm.weight", (DIM,), "F32"), ("indexer.k_norm.bias", (DIM,), "F32")):
        values = (rng.standard_normal(shape, dtype=np.float32) * 0.1 + (0 if suffix.endswith("bias") else 1))
        v[suffix] = bf16_round(values) if dtype == "BF16" else values.astype(np.float32)
        tensors.append((name(suffix, layer_index), dtype, v[suffix]))
    path = str(tmp_path / "model.safetensors")
    write_safetensors(path, tensors)
    kv_b = v["kv_b_proj.weight"][rank * H * (P + V) : (rank + 1) * H * (P + V)].reshape(H, P + V, L)
    direct = {
        "fused_qkv_a_proj": np.vstack([v["q_a_proj.weight"], v["kv_a_proj_with_mqa.weight"]]),
        "q_a_norm": v["q_a_layernorm.weight"],
        "kv_a_norm": v["kv_a_layernorm.weight"],
        "q_b_proj": v["q_b_proj.weight"][rank * H * (P + R) : (rank + 1) * H * (P + R)],
        "w_uk_t": np.ascontiguousarray(kv_b[:, :P, :]),
        "w_uv": np.ascontiguousarray(kv_b[:, P:, :].transpose(0, 2, 1)),
        "o_proj": np.ascontiguousarray(v["o_proj.weight"][:, rank * H * V : (rank + 1) * H * V]),
        "index_wq_b": v["indexer.wq_b.weight"],
        "index_wk": v["indexer.wk.weight"],
        "index_weights_proj": v["indexer.weights_proj.weight"],
        "index_k_norm_weight": v["indexer.k_norm.weight"],
        "index_k_norm_bias": v["indexer.k_norm.bias"],
    }
    plan = stage_plan_for("dsv32", max_tokens=4, max_context=MAX_CONTEXT, block_size=BLOCK)
    loaded = dd.load_layer_weights(path, layer_index, "dsv32", plan, tp=TP, rank=rank)
    assert sorted(loaded.weights) == sorted(direct)
    for key, array in direct.items():
        assert loaded.weights[key].tobytes() == np.ascontiguousarray(array).tobytes(), key

    def on_device(arrays):
        return {k: (torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
                    if a.dtype == np.uint16 else torch.from_numpy(np.ascontiguousarray(a))).to(DEVICE)
                for k, a in arrays.items()}

    stage = dd.Stage.from_checkpoint(path, layer_index, "dsv32", plan, tp=TP, rank=rank)
    assert stage.config == c and stage.indexer_plan().rope_dims == R
    # The step of a layer built around the direct weights (its stage the reference).
    gen = torch.Generator(device=DEVICE).manual_seed(23)
    layer = RopeLayer("dsv32", gen, max_tokens=4)
    layer.weights = on_device(direct)
    layer.stage = dd.Stage(c, layer.weights, plan)
    layer.iplan = layer.stage.indexer_plan()
    step = RopeStep(layer, 4, gen)
    for path_name in ("forward", "stock_forward"):
        results = []
        for s in (layer.stage, stage):
            step.restore()
            getattr(s, path_name)(step.args())
            torch.cuda.synchronize()
            results.append((step.out.clone(),) + step.caches())
        assert int(step.errors.item()) == 0
        assert bool(results[0][0].float().abs().sum() > 0), "the step wrote nothing"
        for what, a, b in zip(("out", "kv_cache", "k_cache"), *results):
            assert same(a, b), f"{path_name}: {what} differs"


# --- the vLLM adapter on a DeepSeek-V3.2 layer's tensors ---------------------------------------------------------


class DeepseekScalingRotaryEmbedding:
    """vLLM's YaRN rotary's attributes (the adapter reads them by these names),
    its cos_sin_cache on the GPU as vLLM holds it."""

    def __init__(self, config, cache):
        self.head_size = self.rotary_dim = config.rope_dim
        self.base, self.scaling_factor = config.theta, config.factor
        self.beta_fast, self.beta_slow = config.beta_fast, config.beta_slow
        self.mscale, self.max_position_embeddings = config.table_scale, config.original_max_position
        self.is_neox_style = config.style == "half-split"
        self.cos_sin_cache = cache


class StockWrapper:
    def __init__(self, **attributes):
        self.__dict__.update(attributes)

    def forward(self, positions, hidden_states, llama_4_scaling=None):
        raise AssertionError("the stock forward ran")


def test_the_vllm_adapter_runs_the_stage_on_a_v32_layers_tensors():
    """install() on DeepseekV2MLAAttention's attribute contract holding the
    layer's tensors as vLLM does (kv_b_proj's W_UK_T and W_UV views, the fused
    wk_weights_proj, both rotaries with their cos_sin_cache, the fp8_ds_mla
    cache, the indexer's [blocks, 64, 132] K cache): the installed forward
    gives the bits of Stage.forward on the same step."""
    from types import SimpleNamespace

    from dsa_decode import vllm as adapter_module

    gen = torch.Generator(device=DEVICE).manual_seed(59)
    m = 4
    layer = RopeLayer("dsv32", gen, max_tokens=16)
    step = RopeStep(layer, m, gen)
    run(layer, step)
    want = step.out.clone()
    c, w = layer.c, layer.weights
    H, P, L, V = c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank, c.v_head_dim
    kv_b = torch.empty((H, P + V, L), dtype=torch.bfloat16, device=DEVICE)
    kv_b[:, :P, :] = w["w_uk_t"]
    kv_b[:, P:, :] = w["w_uv"].transpose(1, 2)
    held = dict(
        W_UK_T=kv_b[:, :P, :],  # strides ((P + V) L, L, 1)
        W_UV=kv_b[:, P:, :].transpose(1, 2),  # [H, L, V] strides ((P + V) L, 1, L)
        wk_weights_proj=torch.cat([w["index_wk"], w["index_weights_proj"]]),
    )
    indexer = SimpleNamespace(
        config=SimpleNamespace(index_n_heads=64, index_topk=2048, index_head_dim=128,
                               rope_parameters=dict(rope_type="deepseek_yarn", factor=40.0, mscale=1.0,
                                                    mscale_all_dim=1.0)),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(max_model_len=MAX_CONTEXT)),
        wq_b=SimpleNamespace(weight=w["index_wq_b"]),
        wk_weights_proj=SimpleNamespace(weight=held["wk_weights_proj"]),
        k_norm=SimpleNamespace(weight=w["index_k_norm_weight"], bias=w["index_k_norm_bias"]),
        k_cache=SimpleNamespace(kv_cache=step.k_cache.view(step.blocks, BLOCK, 132)),
    )
    mla = SimpleNamespace(
        impl=SimpleNamespace(dcp_world_size=1, index_group=None),
        attn_backend=SimpleNamespace(get_name=lambda: "FLASHMLA_SPARSE"),
        layer_name="model.layers.0.self_attn.attn",
        scale=c.softmax_scale,
        kv_cache_dtype="fp8_ds_mla",
        q_pad_num_heads=None,
        use_pcp=False,
        hisparse_cache=None,
        W_UK_T=held["W_UK_T"],
        W_UV=held["W_UV"],
        kv_cache=step.kv_cache,
    )
    wrapper = StockWrapper(
        mla_attn=mla,
        num_heads=H,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=L,
        qk_nope_head_dim=P,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=V,
        fuse_qkv_rmsnorm=False,
        rotary_emb=DeepseekScalingRotaryEmbedding(c.rope, layer.table.to(torch.bfloat16)),
        indexer_rope_emb=DeepseekScalingRotaryEmbedding(c.indexer_rope, layer.itable.to(torch.bfloat16)),
        indexer=indexer,
        skip_topk=False,
        g_proj=None,
        dcp_q_replicate=False,
        fused_qkv_a_proj=SimpleNamespace(weight=w["fused_qkv_a_proj"]),
        q_a_layernorm=SimpleNamespace(weight=w["q_a_norm"], variance_epsilon=c.rms_norm_eps),
        kv_a_layernorm=SimpleNamespace(weight=w["kv_a_norm"], variance_epsilon=c.rms_norm_eps),
        q_b_proj=SimpleNamespace(weight=w["q_b_proj"]),
        o_proj=SimpleNamespace(weight=w["o_proj"], bias=None, input_is_parallel=True, reduce_results=True, tp_size=1),
    )

    def step_inputs(adapter, positions, hidden):
        return adapter_module.StepInputs(
            num_actual_tokens=hidden.shape[0],
            num_decode_tokens=hidden.shape[0],
            token_requests=step.token_requests,
            slot_mapping=step.slot_mapping,
            kv_cache=step.kv_cache,
            indexer=dd.IndexerState(step.block_table, None, adapter_module.pooled_key_view(indexer.k_cache.kv_cache)),
            error_count=step.errors,
        )

    adapter = adapter_module.install(SimpleNamespace(mla_attn=wrapper), step_inputs=step_inputs,
                                     indexer_keys="hadamard")
    # The rotaries as the stage's: the frequencies and styles of the preset, the rows vLLM's table holds.
    assert adapter.config.rope.style == "interleaved" and adapter.config.indexer_rope.style == "half-split"
    assert adapter.plan.max_context == MAX_CONTEXT and adapter.plan.block_size == BLOCK
    step.restore()
    out = wrapper.forward(step.positions, step.hidden)
    torch.cuda.synchronize()
    assert int(step.errors.item()) == 0
    assert same(out, want), "the adapter's step differs from Stage.forward's"
    adapter.uninstall()
