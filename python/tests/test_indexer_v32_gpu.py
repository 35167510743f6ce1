"""GPU tests of DeepSeek-V3.2's indexer through the Python package (pool 1,
64 heads x 128, top-2048, RoPE of the first 64 dims half-split by the dsv32
indexer table): prefill, prepare and select at the V3.2 shape against NumPy
float64, as the C++ tests judge them (src/indexer/indexer_v32_test.cu):

  keys and q  each FP8 value within its e4m3 rounding (2^-4 relative, half a
              subnormal step of its scale) plus a few BF16 roundings of the
              row's magnitude of the float64 chain LayerNorm -> RoPE -> Hadamard
  logits      within indexer.h's FP32-accumulation bound of float64 over the
              FP8 values prepare wrote (kscale sum_h |w'_h| (2^-10 sum_i |q k|
              + (2H + 6) 2^-24 |dot_h|))
  selection   the exact top-2048 of the GPU's logits (ties to the lower
              position), and within the bound of the float64 top-2048: a
              chosen key's float64 logit plus its bound reaches the 2048th's
              minus its bound, and no float64 top key clearly above it is left out
  slots       block_table[r, pos / 64] * 64 + pos % 64

plus the table's and the pool-1 state's argument errors. They skip, with a
message, without PyTorch or without a Hopper GPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests drive the package through PyTorch, not installed here")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the package's GPU tests skip", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the kernels are built for sm_90a (H100/H200) only", allow_module_level=True)

import dsa_decode as dd  # noqa: E402

DEVICE = "cuda"
DIM, HEADS, TOPK, ROPE, BLOCK = 128, 64, 2048, 64, 64


def hadamard() -> np.ndarray:
    """The orthonormal Sylvester Hadamard-128: H[i, j] = (-1)^popcount(i & j) / sqrt(128)."""
    i = np.arange(DIM)
    parity = np.vectorize(lambda x: bin(x).count("1") & 1)(i[:, None] & i[None, :])
    return np.where(parity == 1, -1.0, 1.0) / np.sqrt(DIM)


HADAMARD = hadamard()


def rotate_half_split(x: np.ndarray, row: np.ndarray) -> np.ndarray:
    """RoPE of the first 64 dims (pairs i, i + 32) by a table row cos | sin, float64."""
    out = x.copy()
    c, s = row[: ROPE // 2], row[ROPE // 2 :]
    a, b = x[..., : ROPE // 2], x[..., ROPE // 2 : ROPE]
    out[..., : ROPE // 2] = a * c - b * s
    out[..., ROPE // 2 : ROPE] = b * c + a * s
    return out


def within_fp8(got: np.ndarray, want: np.ndarray, scale) -> bool:
    """e4m3 code x scale against float64: 2^-4 relative, half a subnormal step of the scale,
    and four BF16 roundings of the row's magnitude before the quant."""
    magnitude = np.abs(want).max(axis=-1, keepdims=True)
    bound = np.abs(want) * 2.0**-4 + np.asarray(scale) * 2.0**-10 + 4 * magnitude * 2.0**-9
    return bool((np.abs(got - want) <= bound).all())


class V32Step:
    """Requests prefilled up to their first token, then one step of m tokens (draft tokens of a
    request at consecutive positions), through prefill, prepare and select."""

    def __init__(self, context: int, groups: int, per_request: int, seed: int, table_dtype=torch.float32):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.m = groups * per_request
        self.plan = dd.IndexerPlan.dsv32(max_tokens=self.m, max_context=context)
        config = dd.rope_preset_config("dsv32", "indexer")
        self.table_np = dd.rope_cos_sin_table(config, 0, context)
        self.table = torch.from_numpy(self.table_np).to(DEVICE, table_dtype)
        self.table_np = self.table.double().cpu().numpy()  # the values the kernels read
        pages = (context + BLOCK - 1) // BLOCK
        self.blocks = groups * pages + 3
        perm = torch.randperm(self.blocks, device=DEVICE, generator=gen)[: groups * pages].to(torch.int32)
        self.block_table = perm.view(groups, pages).contiguous()
        self.k_cache = torch.zeros((self.blocks, self.plan.page_bytes), dtype=torch.uint8, device=DEVICE)
        self.state = dd.IndexerState(self.block_table, None, self.k_cache)
        self.norm_weight = (1 + 0.2 * torch.randn(DIM, device=DEVICE, generator=gen)).float()
        self.norm_bias = (0.1 * torch.randn(DIM, device=DEVICE, generator=gen)).float()
        self.errors = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        positions, requests = [], []
        for r in range(groups):
            for j in range(per_request):
                positions.append(context - 1 - 13 * r - (per_request - 1 - j))
                requests.append(r)
        self.positions = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
        self.requests = torch.tensor(requests, dtype=torch.int32, device=DEVICE)
        self.prefill_k = []
        for r in range(groups):
            n = positions[r * per_request]
            k = (2 * torch.randn((n, DIM), device=DEVICE, generator=gen)).to(torch.bfloat16)
            self.prefill_k.append(k)
            dd.indexer_prefill(self.plan, k, None, self.norm_weight, self.norm_bias, None, r, self.state,
                               cos_sin=self.table, error_count=self.errors)
        self.index_q = torch.randn((self.m, HEADS, DIM), device=DEVICE, generator=gen).to(torch.bfloat16)
        self.index_k = (2 * torch.randn((self.m, DIM), device=DEVICE, generator=gen)).to(torch.bfloat16)
        self.weights = torch.randn((self.m, HEADS), device=DEVICE, generator=gen).float()
        self.workspace = torch.full((self.plan.workspace_bytes(),), 0xA5, dtype=torch.uint8, device=DEVICE)
        dd.indexer_prepare(self.plan, self.index_q, self.index_k, self.weights, None, self.norm_weight,
                           self.norm_bias, None, self.positions, self.requests, self.state, self.workspace,
                           cos_sin=self.table, error_count=self.errors)
        width = self.plan.row_width
        self.topk = torch.full((self.m, width), -7, dtype=torch.int32, device=DEVICE)
        self.slots = torch.full((self.m, width), -7, dtype=torch.int32, device=DEVICE)
        dd.indexer_select(self.plan, self.positions, self.requests, self.state, self.workspace, self.slots,
                          topk_positions=self.topk, error_count=self.errors)
        torch.cuda.synchronize()

    # The bytes the kernels wrote, as float64 NumPy.
    def workspace_q(self):
        layout = self.plan.workspace_layout()
        q = self.workspace[layout["q_fp8"] : layout["q_fp8"] + self.m * HEADS * DIM]
        w = self.workspace[layout["head_weights"] : layout["head_weights"] + self.m * HEADS * 4]
        codes = q.view(torch.float8_e4m3fn).double().view(self.m, HEADS, DIM).cpu().numpy()
        return codes, w.view(torch.float32).double().view(self.m, HEADS).cpu().numpy()

    def gpu_logits(self, t: int, length: int) -> np.ndarray:
        layout = self.plan.workspace_layout()
        start = layout["logits"] + t * layout["logits_stride"] * 4
        return self.workspace[start : start + length * 4].view(torch.float32).double().cpu().numpy()

    def keys(self, request: int, length: int):
        """Codes [length, 128] (float64 values) and scales [length] of a request's first keys."""
        pages = self.block_table[request, : (length + BLOCK - 1) // BLOCK].long()
        page = self.k_cache[pages]
        codes = page[:, : BLOCK * DIM].contiguous().view(torch.float8_e4m3fn).double().view(-1, DIM)[:length]
        scales = page[:, BLOCK * DIM :].contiguous().view(torch.float32).double().reshape(-1)[:length]
        return codes.cpu().numpy(), scales.cpu().numpy()

    def key_inputs(self, request: int, position: int) -> np.ndarray:
        """The BF16 index_k row that position of the request came from."""
        first = int(self.positions[self.requests.tolist().index(request)])
        if position < first:
            return self.prefill_k[request][position].double().cpu().numpy()
        t = [i for i, (p, r) in enumerate(zip(self.positions.tolist(), self.requests.tolist()))
             if p == position and r == request][0]
        return self.index_k[t].double().cpu().numpy()


def float64_key(s: V32Step, x: np.ndarray, position: int) -> np.ndarray:
    w, b = s.norm_weight.double().cpu().numpy(), s.norm_bias.double().cpu().numpy()
    y = (x - x.mean()) / np.sqrt(x.var() + 1e-6) * w + b
    return HADAMARD @ rotate_half_split(y, s.table_np[position])


def check_keys(s: V32Step, request: int, length: int, stride: int):
    codes, scales = s.keys(request, length)
    checked = 0
    for p in list(range(0, length, stride)) + [length - 1]:
        want = float64_key(s, s.key_inputs(request, p), p)
        assert within_fp8(codes[p] * scales[p], want, scales[p]), f"request {request} key {p}"
        checked += 1
    return checked


def check_q(s: V32Step):
    codes, folded = s.workspace_q()
    weights = s.weights.double().cpu().numpy()
    q = s.index_q.double().cpu().numpy()
    c = np.float32((128 * HEADS) ** -0.5)
    for t in range(s.m):
        # w' = (w s) c with s a power of two: s recovered from the folded weight.
        scale = 2.0 ** np.round(np.log2(np.abs(folded[t] / (weights[t] * np.float64(c)))))
        np.testing.assert_allclose(folded[t], weights[t] * scale * np.float64(c), rtol=2.0**-23)
        want = rotate_half_split(q[t], s.table_np[int(s.positions[t])]) @ HADAMARD.T
        assert within_fp8(codes[t] * scale[:, None], want, scale[:, None]), f"token {t} q"


def check_selection(s: V32Step, t: int):
    position, request = int(s.positions[t]), int(s.requests[t])
    length = position + 1
    codes, scales = s.keys(request, length)
    q, folded = s.workspace_q()
    dots = q[t] @ codes.T  # [64, L]: every partial sum exact in float64
    absdots = np.abs(q[t]) @ np.abs(codes).T
    ref = scales * (folded[t][:, None] * np.maximum(dots, 0)).sum(0)
    bound = np.abs(scales) * (np.abs(folded[t])[:, None]
                              * (2.0**-10 * absdots + (2 * HEADS + 6) * 2.0**-24 * np.abs(dots))).sum(0)
    gpu = s.gpu_logits(t, length)
    outside = np.abs(gpu - ref) > bound
    assert not outside.any(), f"token {t}: {int(outside.sum())} logits outside their bound"

    row = s.topk[t].cpu().numpy()
    chosen = row[:TOPK]
    assert (chosen >= 0).all() and (chosen < length).all() and (np.diff(chosen) > 0).all()
    # The exact top-2048 of the GPU's logits, ties to the lower position (-0 == +0).
    order = np.lexsort((np.arange(length), -(gpu + 0.0)))
    assert np.array_equal(np.sort(order[:TOPK]), chosen), f"token {t}: rows are not the top-2048 of its logits"
    # Within the bound of the float64 selection.
    top = np.argsort(-ref, kind="stable")[:TOPK]
    threshold, slack = ref[top[-1]], bound[top[-1]]
    assert (ref[chosen] + bound[chosen] >= threshold - slack).all(), f"token {t}: a chosen key below the bound"
    clear = top[ref[top] - bound[top] > threshold + slack]
    assert np.isin(clear, chosen).all(), f"token {t}: a float64 top key clearly above the 2048th left out"
    # Slots: the remap of the rows through the block table.
    table = s.block_table[request].long().cpu().numpy()
    want = table[chosen // BLOCK] * BLOCK + chosen % BLOCK
    assert np.array_equal(s.slots[t].cpu().numpy()[:TOPK], want)
    assert s.plan.row_width == TOPK


@pytest.mark.parametrize("context", [5000, 32768])
@pytest.mark.parametrize("groups, per_request", [(1, 1), (1, 4), (2, 4)])
def test_prefill_prepare_select_at_the_v32_shape(context, groups, per_request):
    s = V32Step(context, groups, per_request, seed=context + 10 * groups + per_request)
    assert int(s.errors[0]) == 0
    for r in range(groups):
        assert check_keys(s, r, int(s.positions[r * per_request]) + per_request, stride=97) > 40
    check_q(s)
    for t in range(s.m):
        check_selection(s, t)


def test_bf16_table_and_interleaved_style_reach_the_kernels():
    s = V32Step(3000, 1, 2, seed=5, table_dtype=torch.bfloat16)
    assert int(s.errors[0]) == 0
    check_keys(s, 0, 3000, stride=131)
    check_q(s)
    # The other style rotates other pairs: the same inputs give other keys.
    plan = dd.IndexerPlan.dsv32(max_tokens=s.m, max_context=3000, rope_style="interleaved")
    other = torch.zeros_like(s.k_cache)
    dd.indexer_prefill(plan, s.prefill_k[0], None, s.norm_weight, s.norm_bias, None, 0,
                       dd.IndexerState(s.block_table, None, other), cos_sin=s.table)
    torch.cuda.synchronize()
    page = s.block_table[0, 0].long()
    assert not torch.equal(other[page, : BLOCK * DIM], s.k_cache[page, : BLOCK * DIM])


def test_short_contexts_take_every_token():
    s = V32Step(1000, 1, 3, seed=9)  # L = 998, 999, 1000 <= 2048
    for t in range(s.m):
        length = int(s.positions[t]) + 1
        row = s.topk[t].cpu().numpy()
        assert np.array_equal(row[:length], np.arange(length)) and (row[length:] == -1).all()
        assert (s.slots[t].cpu().numpy()[length:] == -1).all()


def test_the_table_and_the_pool_one_state_are_checked_by_name():
    s = V32Step(3000, 1, 1, seed=3)
    plan = s.plan

    def prepare(**kw):
        args = dict(gate=None, ape=None, state=s.state, cos_sin=s.table)
        args.update(kw)
        dd.indexer_prepare(plan, s.index_q, s.index_k, s.weights, args["gate"], s.norm_weight, s.norm_bias,
                           args["ape"], s.positions, s.requests, args["state"], s.workspace, cos_sin=args["cos_sin"])

    def prefill(**kw):
        args = dict(cos_sin=s.table)
        args.update(kw)
        dd.indexer_prefill(plan, s.prefill_k[0], None, s.norm_weight, s.norm_bias, None, 0, s.state,
                           cos_sin=args["cos_sin"])

    for call in (prepare, prefill):
        with pytest.raises(dd.InvalidArgument, match="argument 'cos_sin'"):
            call(cos_sin=None)
        with pytest.raises(dd.InvalidArgument, match=r"argument 'cos_sin': expected at least plan.max_context = 3000 rows"):
            call(cos_sin=s.table[:2999])
        with pytest.raises(dd.InvalidArgument, match=r"argument 'cos_sin': expected dtype f32 or bf16"):
            call(cos_sin=s.table.half())
        with pytest.raises(dd.InvalidArgument, match="argument 'cos_sin'"):
            call(cos_sin=s.table[:, :32])
    # No table without RoPE: rope_dims 0 reads none.
    plain = dd.IndexerPlan.dsv32(max_tokens=1, max_context=3000, rope_dims=0)
    dd.indexer_prefill(plain, s.prefill_k[0], None, s.norm_weight, s.norm_bias, None, 0, s.state)
    # A pooled plan still needs its ring, gate and ape, named.
    pooled = dd.IndexerPlan(max_tokens=1, max_context=3000, heads=64)
    with pytest.raises(dd.InvalidArgument, match="argument '(gate|ring)'"):
        dd.indexer_prepare(pooled, s.index_q, s.index_k, s.weights, None, s.norm_weight, s.norm_bias, None,
                           s.positions, s.requests, dd.IndexerState(s.block_table, None, s.k_cache), s.workspace)
    torch.cuda.synchronize()
