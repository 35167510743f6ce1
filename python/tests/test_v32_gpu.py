"""GPU tests of the RoPE presets' kernels through the Python package and
PyTorch: sparse_mla_v32_cache_write's bytes against a model of vLLM's
concat_and_cache_ds_mla written here, sparse_mla_v32 against float64 on the
dequantized cache (latent 5e-3 relative Frobenius, lse 1e-3: DESIGN.md
section 2), rope_absorb against float64 (head_gemv's bound on the latent
columns, rope.h's on the rotated ones), untrusted positions and indices,
the torch.library ops and a graph replay. They skip, with a message,
without PyTorch or without a Hopper GPU."""


import pytest

torch = pytest.importorskip("torch", reason="the GPU tests drive the package through PyTorch, not installed here")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the package's GPU tests skip", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the kernels are built for sm_90a (H100/H200) only", allow_module_level=True)

import dsa_decode as dd  # noqa: E402
from v32_model import ENTRY, FP8, LATENT, ROPE, attention_float64, v32_entry_model  # noqa: E402

DEVICE = "cuda"
LATENT_TOL, LSE_TOL = 5e-3, 1e-3
DSV32 = dd.rope_preset_config("dsv32")
SOFTMAX_SCALE = dd.rope_softmax_scale(DSV32, 192)


@pytest.fixture
def gen():
    return torch.Generator(device=DEVICE).manual_seed(11)


def bf16(shape, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=DEVICE) * scale).to(torch.bfloat16)


# --- the cache write --------------------------------------------------------------


def write_cache(gen, blocks, block_size, tokens, scale=1.0):
    cache = torch.full((blocks, block_size, ENTRY), 0xA5, dtype=torch.uint8, device=DEVICE)
    slots = torch.randperm(blocks * block_size, generator=gen, device=DEVICE)[:tokens].to(torch.int64)
    kv_c, k_pe = bf16((tokens, LATENT), gen, scale), bf16((tokens, ROPE), gen, scale)
    dd.sparse_mla_v32_cache_write(kv_c, k_pe, slots, cache)
    return cache, slots, kv_c, k_pe


def test_cache_write_gives_vllms_bytes(gen):
    cache, slots, kv_c, k_pe = write_cache(gen, blocks=8, block_size=64, tokens=200, scale=3.0)
    torch.cuda.synchronize()
    got = cache.view(-1, ENTRY)[slots].cpu()
    want = v32_entry_model(kv_c, k_pe)
    assert torch.equal(got, want), int((got != want).sum())
    untouched = torch.ones(8 * 64, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert bool((cache.view(-1, ENTRY).cpu()[untouched] == 0xA5).all())


def test_cache_write_skips_padding_and_counts_slots_past_the_cache(gen):
    cache = torch.zeros((2, 16, ENTRY), dtype=torch.uint8, device=DEVICE)
    kv_c, k_pe = bf16((4, LATENT), gen), bf16((4, ROPE), gen)
    slots = torch.tensor([3, -1, 32, 5], dtype=torch.int64, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    dd.sparse_mla_v32_cache_write(kv_c, k_pe, slots, cache.view(FP8), error_count=count)
    torch.cuda.synchronize()
    assert int(count) == 1
    flat = cache.view(-1, ENTRY).cpu()
    want = v32_entry_model(kv_c, k_pe)
    assert torch.equal(flat[3], want[0]) and torch.equal(flat[5], want[3])
    assert int(flat.sum(dim=1).ne(0).sum()) == 2


# --- the attention ------------------------------------------------------------------


def relative_frobenius(x, ref):
    return float(torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref))


@pytest.mark.parametrize("heads, m, top_k", [(128, 1, 2048), (16, 4, 2048), (128, 3, 100), (16, 2, 1), (64, 2, 2048)])
def test_attention_within_the_contract(gen, heads, m, top_k):
    blocks, block_size = 40, 64
    cache, _, _, _ = write_cache(gen, blocks, block_size, blocks * block_size)
    capacity = blocks * block_size
    indices = torch.stack([torch.randperm(capacity, generator=gen, device=DEVICE)[:top_k] for _ in range(m)]).int()
    if top_k > 4:  # padding and an entry past the cache mid-row
        indices[:, 1] = -1
        indices[0, 3] = capacity + 7
    q = bf16((m, heads, 576), gen, 0.5)
    latent = torch.full((m, heads, LATENT), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty((m, heads), dtype=torch.float32, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    dd.sparse_mla_v32(q, cache, indices, SOFTMAX_SCALE, latent, lse, error_count=count)
    torch.cuda.synchronize()
    ref_latent, ref_lse = attention_float64(q, cache, indices, SOFTMAX_SCALE)
    assert relative_frobenius(latent, ref_latent) <= LATENT_TOL
    assert float((lse.double() - ref_lse).abs().max()) <= LSE_TOL
    assert int(count) == (1 if top_k > 4 else 0)
    # Deterministic: the same bits again.
    again = torch.empty_like(latent)
    dd.sparse_mla_v32(q, cache, indices, SOFTMAX_SCALE, again, lse)
    torch.cuda.synchronize()
    assert torch.equal(again.view(torch.int16), latent.view(torch.int16))


def test_a_row_without_valid_entries_gives_zero_and_minus_infinity(gen):
    cache, _, _, _ = write_cache(gen, 4, 64, 256)
    q = bf16((2, 16, 576), gen)
    indices = torch.full((2, 64), -1, dtype=torch.int32, device=DEVICE)
    indices[1, :10] = torch.arange(10, dtype=torch.int32, device=DEVICE)
    latent = torch.full((2, 16, LATENT), 1.0, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.zeros((2, 16), dtype=torch.float32, device=DEVICE)
    dd.sparse_mla_v32(q, cache.view(FP8), indices, SOFTMAX_SCALE, latent, lse)
    torch.cuda.synchronize()
    assert bool((latent[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())
    ref_latent, ref_lse = attention_float64(q[1:], cache, indices[1:], SOFTMAX_SCALE)
    assert relative_frobenius(latent[1:], ref_latent) <= LATENT_TOL


def test_attention_replays_in_a_cuda_graph(gen):
    cache, _, _, _ = write_cache(gen, 16, 64, 1024)
    q = bf16((2, 128, 576), gen, 0.5)
    indices = torch.randint(0, 1024, (2, 512), generator=gen, device=DEVICE, dtype=torch.int32)
    latent = torch.empty((2, 128, LATENT), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty((2, 128), dtype=torch.float32, device=DEVICE)
    dd.sparse_mla_v32(q, cache, indices, SOFTMAX_SCALE, latent, lse)  # the first call outside a capture
    torch.cuda.synchronize()
    eager = latent.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dd.sparse_mla_v32(q, cache, indices, SOFTMAX_SCALE, latent, lse)
    latent.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(latent.view(torch.int16), eager.view(torch.int16))


def test_attention_argument_errors_on_the_gpu(gen):
    cache, _, _, _ = write_cache(gen, 4, 64, 16)
    q = bf16((1, 16, 576), gen)
    indices = torch.zeros((1, 8), dtype=torch.int32, device=DEVICE)
    latent = torch.empty((1, 16, LATENT), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty((1, 16), dtype=torch.float32, device=DEVICE)
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(dd.InvalidArgument, match="argument 'softmax_scale'"):
            dd.sparse_mla_v32(q, cache, indices, scale, latent, lse)
    with pytest.raises(dd.InvalidArgument, match="argument 'kv_cache'"):
        dd.sparse_mla_v32(q, cache[..., :576], indices, SOFTMAX_SCALE, latent, lse)
    with pytest.raises(dd.InvalidArgument, match="argument 'latent'"):
        dd.sparse_mla_v32(q, cache, indices, SOFTMAX_SCALE, latent.float(), lse)
    with pytest.raises(dd.InvalidArgument, match="argument '(latent|q)'"):
        dd.sparse_mla_v32(q, cache, indices, SOFTMAX_SCALE, q[..., :LATENT], lse)  # aliased output


# --- the RoPE absorb -----------------------------------------------------------------


def rotate64(x, cos, sin, style):
    """float64 rotation of x [..., R] by per-token cos, sin [..., R/2] (broadcast), and each
    value's bound factor (|a| + |b|) max(|c|, |s|) of its pair, in x's layout."""
    half = x.shape[-1] // 2
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    pair_bound = (a.abs() + b.abs()) * torch.maximum(cos.abs(), sin.abs())
    out, bound = torch.empty_like(x), torch.empty_like(x)
    if style == "interleaved":
        out[..., 0::2], out[..., 1::2] = ra, rb
        bound[..., 0::2], bound[..., 1::2] = pair_bound, pair_bound
    else:
        out[..., :half], out[..., half:] = ra, rb
        bound[..., :half], bound[..., half:] = pair_bound, pair_bound
    return out, bound


def within(got, exact, bound):
    """got (BF16) within bound of exact, plus the BF16 rounding (half an ulp, 2^-9 relative)."""
    slack = bound + exact.abs() * 2.0**-8 + 1e-30
    return bool(((got.double() - exact).abs() <= slack).all())


@pytest.mark.parametrize("preset, target, heads, nope, m", [
    ("dsv32", "attention", 128, 128, 1), ("dsv32", "attention", 16, 128, 4),
    ("glm5", "attention", 64, 192, 16), ("dsv32", "indexer", 8, 128, 3),
])
def test_rope_absorb_within_the_contract(gen, preset, target, heads, nope, m):
    config = dd.rope_preset_config(preset, target)
    rows = 4096
    table = torch.from_numpy(dd.rope_cos_sin_table(config, 0, rows)).to(DEVICE)
    q = bf16((m, heads, nope + ROPE), gen)  # vLLM's q: q_nope and q_pe as views
    kv_a = bf16((m, LATENT + ROPE), gen)
    weight = bf16((heads, nope, LATENT), gen, 0.05)
    positions = torch.randint(0, rows, (m,), generator=gen, device=DEVICE, dtype=torch.int64)
    out = torch.empty((m, heads, LATENT + ROPE), dtype=torch.bfloat16, device=DEVICE)
    k_pe_out = torch.empty((m, ROPE), dtype=torch.bfloat16, device=DEVICE)
    dd.rope_absorb(q[..., :nope], q[..., nope:], kv_a[:, LATENT:], positions, table, weight, out, k_pe_out,
                   style=config.style)
    torch.cuda.synchronize()
    qd, wd = q[..., :nope].double(), weight.double()
    exact = torch.einsum("thp,hpl->thl", qd, wd)
    bound = 2.0**-14 * torch.einsum("thp,hpl->thl", qd.abs(), wd.abs())
    assert within(out[..., :LATENT], exact, bound)
    t64 = table.double()[positions]
    cos, sin = t64[:, None, : ROPE // 2], t64[:, None, ROPE // 2:]
    rq, bq = rotate64(q[..., nope:].double(), cos, sin, config.style)
    assert within(out[..., LATENT:], rq, 2.0**-22 * bq)
    rk, bk = rotate64(kv_a[:, LATENT:].double(), t64[:, : ROPE // 2], t64[:, ROPE // 2:], config.style)
    assert within(k_pe_out, rk, 2.0**-22 * bk)


def test_rope_absorb_untrusted_positions_give_zeros_and_count(gen):
    config = dd.rope_preset_config("dsv32")
    table = torch.from_numpy(dd.rope_cos_sin_table(config, 0, 100)).to(DEVICE)
    m, heads = 3, 16
    q = bf16((m, heads, 192), gen)
    k_pe = bf16((m, ROPE), gen)
    weight = bf16((heads, 128, LATENT), gen, 0.05)
    positions = torch.tensor([5, -1, 100], dtype=torch.int64, device=DEVICE)
    out = torch.full((m, heads, LATENT + ROPE), 7.0, dtype=torch.bfloat16, device=DEVICE)
    k_pe_out = torch.full((m, ROPE), 7.0, dtype=torch.bfloat16, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    dd.rope_absorb(q[..., :128], q[..., 128:], k_pe, positions, table, weight, out, k_pe_out,
                   style=config.style, error_count=count)
    torch.cuda.synchronize()
    assert int(count) == 1
    for t in (1, 2):
        assert bool((out[t, :, LATENT:] == 0).all()) and bool((k_pe_out[t] == 0).all())
    assert not bool((k_pe_out[0] == 0).all())


def test_rope_absorb_errors_name_the_argument(gen):
    table = torch.from_numpy(dd.rope_cos_sin_table(DSV32, 0, 16)).to(DEVICE)
    q = bf16((1, 16, 192), gen)
    k_pe = bf16((1, ROPE), gen)
    weight = bf16((16, 128, LATENT), gen)
    positions = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    out = torch.empty((1, 16, LATENT + ROPE), dtype=torch.bfloat16, device=DEVICE)
    k_pe_out = torch.empty((1, ROPE), dtype=torch.bfloat16, device=DEVICE)
    base = [q[..., :128], q[..., 128:], k_pe, positions, table, weight, out, k_pe_out]
    names = ["q_nope", "q_pe", "k_pe", "positions", "cos_sin", "weight", "out", "k_pe_out"]
    for i, name in enumerate(names):
        bad = list(base)
        bad[i] = base[i].to(torch.float16)
        with pytest.raises(dd.InvalidArgument, match=f"argument '{name}'"):
            dd.rope_absorb(*bad)
    with pytest.raises(dd.InvalidArgument, match="argument 'positions'"):
        dd.rope_absorb(*base[:3], positions.int(), *base[4:])
    with pytest.raises(dd.InvalidArgument, match="argument 'k_pe_out'"):  # aliased onto out
        dd.rope_absorb(*base[:7], out[:, 0, :ROPE])
    with pytest.raises(dd.InvalidArgument, match="argument 'style'"):
        dd.rope_absorb(*base, style="gpt-j")


# --- torch.library --------------------------------------------------------------------


def test_the_ops_are_registered_and_give_the_functions_bits(gen):
    from dsa_decode import torch_ops

    for name, written in (
        ("rope_absorb", {"out", "k_pe_out", "error_count"}),
        ("sparse_mla_v32_cache_write", {"kv_cache", "error_count"}),
        ("sparse_mla_v32", {"latent", "lse", "error_count"}),
    ):
        assert name in torch_ops.OPS
        schema = getattr(torch.ops.dsa_decode, name).default._schema
        assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == written
        assert len(schema.returns) == 0
    cache, _, _, _ = write_cache(gen, 8, 64, 512)
    q = bf16((2, 16, 576), gen)
    indices = torch.randint(0, 512, (2, 256), generator=gen, device=DEVICE, dtype=torch.int32)
    a_latent = torch.empty((2, 16, LATENT), dtype=torch.bfloat16, device=DEVICE)
    b_latent = torch.empty_like(a_latent)
    a_lse, b_lse = torch.empty((2, 16), device=DEVICE), torch.empty((2, 16), device=DEVICE)
    dd.sparse_mla_v32(q, cache, indices, SOFTMAX_SCALE, a_latent, a_lse)
    torch.ops.dsa_decode.sparse_mla_v32(q, cache, indices, SOFTMAX_SCALE, b_latent, b_lse, None)
    torch.cuda.synchronize()
    assert torch.equal(a_latent.view(torch.int16), b_latent.view(torch.int16)) and torch.equal(a_lse, b_lse)
    copy = torch.zeros_like(cache)
    kv_c, k_pe = bf16((3, LATENT), gen), bf16((3, ROPE), gen)
    slots = torch.tensor([1, 9, 77], dtype=torch.int64, device=DEVICE)
    torch.ops.dsa_decode.sparse_mla_v32_cache_write(kv_c, k_pe, slots, copy, None)
    torch.cuda.synchronize()
    assert torch.equal(copy.view(-1, ENTRY)[slots].cpu(), v32_entry_model(kv_c, k_pe))
