"""Tests of dsa_decode.torch_ops, the torch.library registration of the ops.

Without PyTorch the whole module is skipped. Without a Hopper GPU only the
registration itself is tested (schemas, the stage registry, the fake
implementations on meta tensors); with one, every op is checked to give the
bits of the plain binding on the same inputs, under torch.compile too, and
the fake implementations are checked under FakeTensorMode, make_fx and
torch.library.opcheck."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="dsa_decode.torch_ops needs PyTorch, which is not importable here")

import dsa_decode as dd  # noqa: E402
from dsa_decode import torch_ops  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
requires_hopper = pytest.mark.skipif(
    not HOPPER, reason="needs a CUDA GPU of compute capability 9.0 (the kernels are built for sm_90a)"
)

# glm5next at TP1: H heads, Q q_lora_rank, L kv_lora_rank, P qk_nope_head_dim, V v_head_dim.
H, Q, L, P, V = 64, 1536, 512, 256, 256
FP8_SCALE = 6.0 / 448.0
OPS = torch.ops.dsa_decode


def written_arguments(op) -> set:
    return {a.name for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def same_bits(a, b) -> bool:
    """Bitwise equality of two tensors of one dtype (NaN-safe: compares integer views)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(as_int), b.view(as_int))


# --- registration (no GPU needed) -------------------------------------------


def test_importing_dsa_decode_does_not_import_torch():
    code = "import sys, dsa_decode; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_every_op_is_registered_returning_nothing_and_writing_its_outputs():
    expected = {
        "qkv_rmsnorm": {"q_out", "kv_out"},
        "linear_gemv": {"out"},
        "head_gemv": {"out"},
        "head_gemv_absorb": {"out", "cache", "error_count"},
        "sparse_mla": {"latent", "lse", "split_counters", "split_partials", "error_count"},
        "stage_forward": {"kv_cache", "ring", "index_k_cache", "out", "error_count"},
        "rope_absorb": {"out", "k_pe_out", "error_count"},
        "sparse_mla_v32_cache_write": {"kv_cache", "error_count"},
        "sparse_mla_v32": {"latent", "lse", "error_count"},
    }
    assert set(torch_ops.OPS) == set(expected)
    for name, written in expected.items():
        op = getattr(OPS, name)
        assert written_arguments(op) == written, name
        assert len(op.default._schema.returns) == 0, name


def test_stage_registry_refuses_what_it_does_not_hold():
    with pytest.raises(TypeError, match="dsa_decode.Stage"):
        torch_ops.register_stage(object())
    with pytest.raises(ValueError, match="argument 'handle'"):
        torch_ops.registered_stage(-1)
    with pytest.raises(ValueError, match="no stage is registered as -1"):
        torch_ops.unregister_stage(-1)


def test_fake_implementations_take_meta_tensors():
    # register_fake also serves the Meta key: nothing runs, outputs keep their shapes.
    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    m = 2
    q_out, kv_out = meta(m, Q), meta(m, L)
    assert OPS.qkv_rmsnorm(meta(m, Q + L), meta(Q), meta(L), 1e-6, q_out, kv_out) is None
    assert q_out.shape == (m, Q) and kv_out.shape == (m, L)
    assert OPS.linear_gemv(meta(m, 64), meta(32, 64), meta(m, 32)) is None
    assert OPS.head_gemv(meta(m, H, L), meta(H, L, V), meta(m, H, V), None, "tensor-cores") is None
    absorb_out = meta(m, H, L, dtype=torch.float8_e4m3fn)
    scale = meta(1, dtype=torch.float32)
    cache = meta(4, 256, L, dtype=torch.float8_e4m3fn)
    slots = meta(m, dtype=torch.int64)
    assert (
        OPS.head_gemv_absorb(
            meta(m, H, P), meta(H, P, L), absorb_out, scale, meta(m, L), cache, slots, scale, "tensor-cores", None
        )
        is None
    )
    assert absorb_out.dtype == torch.float8_e4m3fn
    assert (
        OPS.sparse_mla(
            meta(m, H, L, dtype=torch.float8_e4m3fn),
            scale,
            cache,
            scale,
            meta(m, 2176, dtype=torch.int32),
            0.0625,
            meta(m, H, L),
            meta(m, H, dtype=torch.float32),
            meta(m * H, dtype=torch.int32),
            None,
            "auto",
            None,
        )
        is None
    )
    # The stage's fake does not look the handle up: a trace needs no stage.
    assert (
        OPS.stage_forward(
            12345,
            meta(m, 4096),
            slots,
            meta(m, dtype=torch.int32),
            slots,
            cache,
            meta(1, 4, dtype=torch.int32),
            meta(1, 2, 8, 128),
            meta(4, 8448, dtype=torch.uint8),
            meta(m, 4096),
            None,
            None,
        )
        is None
    )


# --- the ops give the binding's bits (GPU) ----------------------------------


@pytest.fixture
def generator():
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    return g


def normal(generator, *shape, std=1.0, mean=0.0, dtype=torch.bfloat16):
    return (torch.randn(shape, generator=generator, device="cuda") * std + mean).to(dtype)


def fp8_codes(generator, *shape, scale=FP8_SCALE):
    # Values uniform in [-2, 2) over scale: codes up to +-150, never the NaN codes 0x7F / 0xFF.
    values = torch.rand(shape, generator=generator, device="cuda") * 4 - 2
    return (values / scale).to(torch.float8_e4m3fn)


def scale_tensor(value=FP8_SCALE):
    return torch.full((1,), value, dtype=torch.float32, device="cuda")


@requires_hopper
@pytest.mark.parametrize("m", [1, 4, 16])
def test_qkv_rmsnorm_op_gives_the_binding_bits(generator, m):
    qkv = normal(generator, m, Q + L)
    q_weight, kv_weight = normal(generator, Q, std=0.05, mean=1.0), normal(generator, L, std=0.05, mean=1.0)
    expected_q, expected_kv = torch.empty((m, Q), dtype=torch.bfloat16, device="cuda"), qkv.new_empty((m, L))
    dd.qkv_rmsnorm(qkv, q_weight, kv_weight, 1e-6, expected_q, expected_kv)
    q_out, kv_out = torch.full_like(expected_q, float("nan")), torch.full_like(expected_kv, float("nan"))
    OPS.qkv_rmsnorm(qkv, q_weight, kv_weight, 1e-6, q_out, kv_out)
    torch.cuda.synchronize()
    assert same_bits(q_out, expected_q) and same_bits(kv_out, expected_kv)


@requires_hopper
@pytest.mark.parametrize("m", [1, 3, 8])
def test_linear_gemv_op_gives_the_binding_bits(generator, m):
    x, weight = normal(generator, m, 4096), normal(generator, 1024, 4096, std=4096**-0.5)
    expected = x.new_empty((m, 1024))
    dd.linear_gemv(x, weight, expected)
    out = torch.full_like(expected, float("nan"))
    OPS.linear_gemv(x, weight, out)
    torch.cuda.synchronize()
    assert same_bits(out, expected)


@requires_hopper
@pytest.mark.parametrize("sums", dd.HEAD_GEMV_SUMS)
@pytest.mark.parametrize("m", [1, 2, 8])
def test_head_gemv_value_up_op_gives_the_binding_bits(generator, m, sums):
    latent, w_uv = normal(generator, m, H, L), normal(generator, H, L, V, std=L**-0.5)
    expected = latent.new_empty((m, H, V))
    dd.head_gemv(latent, w_uv, expected, sums=sums)
    out = torch.full_like(expected, float("nan"))
    OPS.head_gemv(latent, w_uv, out, None, sums)
    torch.cuda.synchronize()
    assert same_bits(out, expected)


@requires_hopper
@pytest.mark.parametrize("m", [1, 4])
def test_head_gemv_absorb_op_gives_the_binding_bits_and_cache_bytes(generator, m):
    q, w_uk_t = normal(generator, m, H, P), normal(generator, H, P, L, std=P**-0.5)
    kv_c = normal(generator, m, L)
    # Slots in three of four blocks; with m = 4 one of them (-1) is skipped.
    slot_mapping = torch.tensor([5, 300, 1023, -1][:m], dtype=torch.int64, device="cuda")
    scale, k_scale = scale_tensor(), scale_tensor()

    def run(call):
        out = torch.zeros((m, H, L), dtype=torch.float8_e4m3fn, device="cuda")
        cache = torch.zeros((4, 256, L), dtype=torch.float8_e4m3fn, device="cuda")
        errors = torch.zeros((1,), dtype=torch.int32, device="cuda")
        call(out, cache, errors)
        torch.cuda.synchronize()
        return out, cache, errors

    expected = run(
        lambda out, cache, errors: dd.head_gemv(
            q, w_uk_t, out, scale=scale, cache=dd.KvCacheWrite(kv_c, cache, slot_mapping, k_scale, errors)
        )
    )
    got = run(
        lambda out, cache, errors: OPS.head_gemv_absorb(
            q, w_uk_t, out, scale, kv_c, cache, slot_mapping, k_scale, dd.HEAD_GEMV_SUMS[0], errors
        )
    )
    for name, a, b in zip(("out", "cache", "error_count"), got, expected):
        assert same_bits(a, b), name
    assert got[1].view(torch.uint8).any(), "the cache write wrote nothing"


@requires_hopper
@pytest.mark.parametrize("plan", dd.ATTENTION_PLANS)
@pytest.mark.parametrize("heads", [8, 64])
def test_sparse_mla_op_gives_the_binding_bits(generator, heads, plan):
    m, top_k, blocks = 2, 2176, 8
    q = fp8_codes(generator, m, heads, L)
    kv_cache = fp8_codes(generator, blocks, 256, L)
    indices = torch.randint(0, blocks * 256, (m, top_k), generator=generator, device="cuda", dtype=torch.int32)
    indices[:, 2051:] = -1  # the -1 padding of a top-k row
    indices[1, 7] = blocks * 256 + 3  # past the cache: skipped and counted
    q_scale, k_scale = scale_tensor(), scale_tensor()
    counters_count = dd.sparse_mla_split_counter_count(m, heads, top_k)
    partials_count = dd.sparse_mla_split_partials_count(m, heads, top_k)

    def run(call):
        latent = torch.full((m, heads, L), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((m, heads), float("nan"), dtype=torch.float32, device="cuda")
        counters = torch.zeros((counters_count,), dtype=torch.int32, device="cuda")
        partials = torch.empty((partials_count,), dtype=torch.float32, device="cuda") if partials_count else None
        errors = torch.zeros((1,), dtype=torch.int32, device="cuda")
        call(latent, lse, counters, partials, errors)
        torch.cuda.synchronize()
        return latent, lse, counters, errors

    softmax_scale = P**-0.5
    expected = run(
        lambda latent, lse, counters, partials, errors: dd.sparse_mla(
            q,
            q_scale,
            kv_cache,
            k_scale,
            indices,
            softmax_scale,
            latent,
            lse,
            counters,
            partials,
            plan=plan,
            error_count=errors,
        )
    )
    got = run(
        lambda latent, lse, counters, partials, errors: OPS.sparse_mla(
            q, q_scale, kv_cache, k_scale, indices, softmax_scale, latent, lse, counters, partials, plan, errors
        )
    )
    for name, a, b in zip(("latent", "lse", "split_counters", "error_count"), got, expected):
        assert same_bits(a, b), name
    assert not got[2].any(), "the split counters were not left zero"
    assert got[3].item() >= 1, "the slot past the cache was not counted"


def load_bench_module():
    """python/bench/bench_python.py, whose synthetic layer the stage test shares."""
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_python.py"
    spec = importlib.util.spec_from_file_location("bench_python", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def small_layer():
    """glm5next at TP8 (8 heads), two tokens after 3000 cached ones (past 2048: the indexer's logits run)."""
    if not HOPPER:
        pytest.skip("needs a CUDA GPU of compute capability 9.0")
    return load_bench_module().build_synthetic_layer("glm5next", tp=8, tokens=2, context=3000, seed=3)


STEP_WRITES = ("out", "kv_cache", "ring", "k_cache", "error_count")


def step_writes(args):
    """The tensors a stage step writes, in STEP_WRITES order."""
    return [args.out, args.kv_cache, args.indexer.ring, args.indexer.k_cache, args.error_count]


def run_then_restore(stage, args, stock=False):
    """Runs one step directly and returns copies of what it wrote; then puts
    the written state back as it was and fills out with NaN."""
    before = [t.clone() for t in step_writes(args)]
    (stage.stock_forward if stock else stage.forward)(args)
    torch.cuda.synchronize()
    written = [t.clone() for t in step_writes(args)]
    for t, saved in zip(step_writes(args), before):
        t.copy_(saved)
    args.out.fill_(float("nan"))
    return written


def assert_wrote(args, expected):
    for name, t, wanted in zip(STEP_WRITES, step_writes(args), expected):
        assert same_bits(t, wanted), name
    assert args.error_count.item() == 0


@requires_hopper
@pytest.mark.parametrize("stock", [False, True])
def test_stage_forward_op_gives_the_stage_bits(small_layer, stock):
    stage, args = small_layer.stages[0], small_layer.args
    expected = run_then_restore(stage, args, stock)
    handle = torch_ops.register_stage(stage)
    try:
        assert torch_ops.register_stage(stage) == handle
        assert torch_ops.registered_stage(handle) is stage
        torch_ops.run_stage(handle, args, stock=stock)
        torch.cuda.synchronize()
    finally:
        torch_ops.unregister_stage(handle)
    assert_wrote(args, expected)


@requires_hopper
def test_torch_compile_fullgraph_runs_stage_forward_with_the_stage_bits(small_layer):
    """stage_forward inside a compiled function (its handle a constant of the
    trace, the written tensors functionalized and written back) gives
    Stage.forward's bits, and the op after it reads what it wrote."""
    torch._dynamo.reset()
    stage, args = small_layer.stages[0], small_layer.args
    expected = run_then_restore(stage, args)
    handle = torch_ops.register_stage(stage)
    try:

        def step(*tensors):
            *inputs, out, errors = tensors
            torch.ops.dsa_decode.stage_forward(handle, *inputs, out, None, errors, False)
            return out.float().sum(dim=-1)

        inputs = (args.hidden, args.positions, args.token_requests, args.slot_mapping, args.kv_cache)
        indexer = (args.indexer.block_table, args.indexer.ring, args.indexer.k_cache)
        row_sums = torch.compile(step, fullgraph=True)(*inputs, *indexer, args.out, args.error_count)
        torch.cuda.synchronize()
    finally:
        torch_ops.unregister_stage(handle)
    assert_wrote(args, expected)
    # Inductor's reduction may add in another order than eager's: close, not bitwise.
    torch.testing.assert_close(row_sums, expected[0].float().sum(dim=-1))


# --- tracing: torch.compile, fake tensors, opcheck (GPU) --------------------


@requires_hopper
def test_torch_compile_fullgraph_runs_the_ops_with_the_binding_bits(generator):
    torch._dynamo.reset()

    def norm_then_project(qkv, q_weight, kv_weight, weight):
        m = qkv.shape[0]
        q_c, kv_c = qkv.new_empty((m, q_weight.shape[0])), qkv.new_empty((m, kv_weight.shape[0]))
        torch.ops.dsa_decode.qkv_rmsnorm(qkv, q_weight, kv_weight, 1e-6, q_c, kv_c)
        out = qkv.new_empty((m, weight.shape[0]))
        torch.ops.dsa_decode.linear_gemv(q_c, weight, out)
        return out, kv_c

    m = 2
    qkv = normal(generator, m, Q + L)
    q_weight, kv_weight = normal(generator, Q, std=0.05, mean=1.0), normal(generator, L, std=0.05, mean=1.0)
    weight = normal(generator, 2048, Q, std=Q**-0.5)

    compiled = torch.compile(norm_then_project, fullgraph=True)
    out, kv_c = compiled(qkv, q_weight, kv_weight, weight)

    expected_q, expected_kv = qkv.new_empty((m, Q)), qkv.new_empty((m, L))
    dd.qkv_rmsnorm(qkv, q_weight, kv_weight, 1e-6, expected_q, expected_kv)
    expected_out = qkv.new_empty((m, 2048))
    dd.linear_gemv(expected_q, weight, expected_out)
    torch.cuda.synchronize()
    assert same_bits(out, expected_out) and same_bits(kv_c, expected_kv)


@requires_hopper
def test_fake_tensor_mode_and_make_fx_trace_the_ops(generator):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    m = 4
    x, weight = normal(generator, m, 256), normal(generator, 128, 256)
    out = x.new_zeros((m, 128))
    with FakeTensorMode() as mode:
        fake_x, fake_weight, fake_out = (mode.from_tensor(t) for t in (x, weight, out))
        assert OPS.linear_gemv(fake_x, fake_weight, fake_out) is None
        assert isinstance(fake_out, FakeTensor) and fake_out.shape == (m, 128) and fake_out.device == out.device
    assert not out.any(), "the fake implementation ran the kernel"

    def project(x, weight, out):
        torch.ops.dsa_decode.linear_gemv(x, weight, out)
        return out

    traced = make_fx(project, tracing_mode="fake")(x, weight, out)
    targets = [node.target for node in traced.graph.nodes if node.op == "call_function"]
    assert torch.ops.dsa_decode.linear_gemv.default in targets
    assert not out.any(), "tracing ran the kernel"


@requires_hopper
@pytest.mark.parametrize(
    "check",
    [
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_static",
        "test_aot_dispatch_dynamic",
    ],
)
def test_opcheck_linear_gemv(generator, check):
    x, weight = normal(generator, 2, 64), normal(generator, 32, 64)
    torch.library.opcheck(OPS.linear_gemv.default, (x, weight, x.new_zeros((2, 32))), test_utils=(check,))


@requires_hopper
@pytest.mark.parametrize("check", ["test_schema", "test_faketensor"])
def test_opcheck_qkv_rmsnorm(generator, check):
    m, q_size, kv_size = 2, 64, 32
    args = (
        normal(generator, m, q_size + kv_size),
        normal(generator, q_size, std=0.05, mean=1.0),
        normal(generator, kv_size, std=0.05, mean=1.0),
        1e-6,
        torch.zeros((m, q_size), dtype=torch.bfloat16, device="cuda"),
        torch.zeros((m, kv_size), dtype=torch.bfloat16, device="cuda"),
    )
    torch.library.opcheck(OPS.qkv_rmsnorm.default, args, test_utils=(check,))
