"""CPU tests of the Python package: import, DLPack round trips, argument
errors surfacing from the C++ checks, and the bound CPU references against
float64 NumPy. No GPU and no PyTorch needed (CI runs these)."""

import dataclasses
import inspect
import math
from pathlib import Path

import numpy as np
import pytest

import dsa_decode as dd


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits (uint16), round to nearest even (finite values)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def random_bf16(rng, shape, scale=1.0):
    return bf16_bits(rng.standard_normal(shape).astype(np.float32) * scale)


# --- the package ------------------------------------------------------------


def test_imports_without_torch_and_exposes_the_api():
    assert dd.__version__ == "0.1.0"
    for name in ("qkv_rmsnorm", "head_gemv", "linear_gemv", "sparse_mla", "indexer_select", "Stage", "StagePlan"):
        assert callable(getattr(dd, name)), name
    assert issubclass(dd.InvalidArgument, ValueError)
    assert issubclass(dd.Unsupported, NotImplementedError)
    assert issubclass(dd.CudaError, RuntimeError)


def test_choices_come_from_the_cpp_tables_default_first():
    # include/dsa_decode/choices.h: one list each, the default first.
    assert dd.HEAD_GEMV_SUMS == ("tensor-cores", "seed-order")
    assert dd.INDEXER_LOGITS == ("fp32-accumulation", "exact")
    assert dd.ATTENTION_PLANS == ("auto", "batch-invariant")
    assert not hasattr(dd, "ATTENTION_SPLITS")


def test_every_default_is_the_tables_first_choice():
    """Contract v2: the defaults are the fastest paths; batch invariance is one opt-in switch."""
    assert inspect.signature(dd.head_gemv).parameters["sums"].default == dd.HEAD_GEMV_SUMS[0]
    assert inspect.signature(dd.sparse_mla).parameters["plan"].default == dd.ATTENTION_PLANS[0]
    assert dd.IndexerPlan().logits == dd.INDEXER_LOGITS[0]
    plan = dd.StagePlan()
    assert plan.batch_invariant is False
    assert (plan.head_gemv_sums, plan.indexer_logits, plan.attention_plan) == (
        dd.HEAD_GEMV_SUMS[0],
        dd.INDEXER_LOGITS[0],
        dd.ATTENTION_PLANS[0],
    )
    assert plan.indexer_plan().logits == dd.INDEXER_LOGITS[0]
    assert dd.StagePlan(batch_invariant=True).batch_invariant
    fields = {f.name for f in dataclasses.fields(dd.StagePlan)}
    assert "stock_select_fused" not in fields and "attention_splits" not in fields


# --- DLPack round trips -----------------------------------------------------


@pytest.mark.parametrize(
    "dtype, name", [(np.float32, "f32"), (np.float16, "f16"), (np.int32, "i32"), (np.int64, "i64"), (np.uint8, "u8")]
)
def test_dlpack_dtypes_map_to_the_library_dtypes(dtype, name):
    array = np.zeros((4, 8), dtype=dtype)
    assert dd.describe(array) == f"{name}[4, 8] strides [8, 1] on cpu"


def test_dlpack_strides_of_views_are_kept_in_elements():
    array = np.zeros((4, 6, 8), dtype=np.float32)
    assert dd.describe(array[:, 1:5:2, :]) == "f32[4, 2, 8] strides [48, 16, 1] on cpu"
    assert dd.describe(array.transpose(2, 0, 1)) == "f32[8, 4, 6] strides [1, 48, 8] on cpu"
    assert dd.describe(np.zeros((), dtype=np.float32)) == "f32[] strides [] on cpu"


def test_size_one_dimensions_keep_their_stride():
    # Producers disagree on a size-1 dimension's stride (PyTorch exports 1
    # where the tensor breaks the contiguous pattern); it addresses nothing,
    # the C++ checks never judge it, and the binding passes it on as given,
    # a negative one included.
    row = np.zeros((1, 2048), dtype=np.float32)
    assert dd.describe(row[:, 1536:]) == "f32[1, 512] strides [2048, 1] on cpu"
    assert dd.describe(np.zeros((3, 1, 8), dtype=np.float32)[:, :, ::2]) == "f32[3, 1, 4] strides [8, 8, 2] on cpu"
    assert dd.describe(np.zeros((1, 4), dtype=np.float32)[::-1]) == "f32[1, 4] strides [-4, 1] on cpu"


def test_dlpack_capsules_are_taken_as_arrays():
    assert dd.describe(np.zeros((2, 3), dtype=np.int32).__dlpack__()) == "i32[2, 3] strides [3, 1] on cpu"


def test_negative_strides_are_refused_by_name():
    with pytest.raises(dd.InvalidArgument, match="argument 'array': expected non-negative strides"):
        dd.describe(np.zeros((4, 8), dtype=np.float32)[::-1])


def test_fp8_arguments_take_byte_views():
    assert dd.describe(np.zeros((2, 3), dtype=np.uint8), fp8=True) == "fp8_e4m3[2, 3] strides [3, 1] on cpu"
    assert dd.describe(np.zeros((2, 3), dtype=np.int8), fp8=True).startswith("fp8_e4m3[2, 3]")
    with pytest.raises(dd.InvalidArgument, match="argument 'array'.*FP8 e4m3"):
        dd.describe(np.zeros(3, dtype=np.float32), fp8=True)


def test_dlpack_refuses_what_the_library_cannot_name():
    with pytest.raises(dd.InvalidArgument, match="argument 'array'.*bfloat16, float16, float32"):
        dd.describe(np.zeros(3, dtype=np.float64))
    with pytest.raises(dd.InvalidArgument, match="argument 'array': expected at most 4 dimensions, got 5"):
        dd.describe(np.zeros((1, 1, 1, 1, 1), dtype=np.float32))


# --- errors from the C++ checks -----------------------------------------------


def norm_arrays(q_size=1536, kv_size=512, width=None, dtype=np.float32):
    qkv = np.zeros((1, width if width is not None else q_size + kv_size), dtype=dtype)
    return qkv, np.zeros(q_size, dtype=dtype), np.zeros(kv_size, dtype=dtype)


def test_kernel_argument_errors_name_the_argument():
    qkv, q_weight, kv_weight = norm_arrays()
    q_out, kv_out = np.zeros((1, 1536), dtype=np.float32), np.zeros((1, 512), dtype=np.float32)
    with pytest.raises(dd.InvalidArgument) as error:
        dd.qkv_rmsnorm(qkv, q_weight, kv_weight, 1e-6, q_out, kv_out)
    assert str(error.value).startswith("invalid argument: argument 'qkv': expected")
    assert "f32[1, 2048]" in str(error.value)


def test_a_bad_norm_weight_is_blamed_not_qkv():
    """qkv [1, 2048] and both outputs agree on 1536 + 512 columns: a q_weight
    (or kv_weight) of another size is the wrong argument, and is named."""
    qkv, _, kv_weight = norm_arrays()
    q_out, kv_out = np.zeros((1, 1536), dtype=np.float32), np.zeros((1, 512), dtype=np.float32)
    with pytest.raises(dd.InvalidArgument, match=r"argument 'q_weight': expected \[1536\].*got float32\[1000\]"):
        dd.qkv_rmsnorm(qkv, np.zeros(1000, dtype=np.float32), kv_weight, 1e-6, q_out, kv_out)
    with pytest.raises(dd.InvalidArgument, match=r"argument 'kv_weight': expected \[512\].*got float32\[500\]"):
        dd.qkv_rmsnorm(qkv, np.zeros(1536, dtype=np.float32), np.zeros(500, dtype=np.float32), 1e-6, q_out, kv_out)
    # The reference has no outputs to tell which weight splits qkv wrongly: it names both, never qkv.
    qkv, q_weight, kv_weight = norm_arrays(dtype=np.uint16)
    with pytest.raises(dd.InvalidArgument) as error:
        dd.reference.qkv_rmsnorm(qkv, np.zeros(1000, dtype=np.uint16), kv_weight, 1e-6)
    message = str(error.value)
    assert message.startswith("invalid argument: argument 'q_weight, kv_weight': expected"), message
    assert "2048, qkv's columns" in message and "uint16[1000] strides [1] on cpu" in message, message


@pytest.mark.parametrize("eps", [0.0, -1e-6, math.nan, math.inf, 1e-50])
def test_nonsense_epsilons_are_refused_early(eps):
    """eps must be finite and > 0 as a float (1e-50 underflows to 0), in every
    place that takes one: the kernel, its reference, the presets' config and
    LayerConfig at construction."""
    qkv, q_weight, kv_weight = norm_arrays(dtype=np.uint16)
    match = "argument '{}': expected a finite value > 0"
    with pytest.raises(dd.InvalidArgument, match=match.format("eps")):
        dd.qkv_rmsnorm(qkv, q_weight, kv_weight, eps, qkv, qkv)
    with pytest.raises(dd.InvalidArgument, match=match.format("eps")):
        dd.reference.qkv_rmsnorm(qkv, q_weight, kv_weight, eps)
    with pytest.raises(dd.InvalidArgument, match=match.format("rms_norm_eps")):
        dd.layer_config("glm5next", rms_norm_eps=eps)
    fields = dataclasses.asdict(dd.layer_config("glm5next", tp=8))
    with pytest.raises(dd.InvalidArgument, match=match.format("rms_norm_eps")):
        dd.LayerConfig(**dict(fields, rms_norm_eps=eps))


def test_choices_are_checked_by_name():
    x = np.zeros((1, 1, 8), dtype=np.uint8)
    with pytest.raises(dd.InvalidArgument, match="argument 'sums': expected tensor-cores or seed-order, got 'x'"):
        dd.head_gemv(x, x, x, sums="x")
    with pytest.raises(dd.InvalidArgument, match="argument 'plan': expected auto or batch-invariant, got 'fast'"):
        dd.sparse_mla(x, x, x, x, x, 1.0, x, x, x, plan="fast")
    for gone in ("latency", "throughput", "by-batch", "whole-row"):  # contract v1's plans
        with pytest.raises(dd.InvalidArgument, match=f"argument 'plan'.*got '{gone}'"):
            dd.sparse_mla(x, x, x, x, x, 1.0, x, x, x, plan=gone)
    with pytest.raises(TypeError, match="argument 'stream'"):
        dd.linear_gemv(x, x, x, stream=object())


def test_dtype_errors_name_the_dtypes_and_show_shape_and_strides():
    x, weight = np.zeros((3, 256), dtype=np.float32), np.zeros((40, 256), dtype=np.uint16)
    with pytest.raises(dd.InvalidArgument) as error:
        dd.reference.linear_gemv(x, weight)
    assert str(error.value) == (
        "invalid argument: argument 'x': expected uint16 (BF16 bits), got float32[3, 256] strides [256, 1] on cpu"
    )
    with pytest.raises(dd.InvalidArgument, match=r"argument 'array'.*got float64\[3\] strides \[1\] on cpu"):
        dd.describe(np.zeros(3, dtype=np.float64))
    with pytest.raises(dd.InvalidArgument, match=r"FP8 e4m3.*got float32\[3\] strides \[1\] on cpu"):
        dd.describe(np.zeros(3, dtype=np.float32), fp8=True)
    transposed = np.zeros((256, 40), dtype=np.uint16).T
    with pytest.raises(
        dd.InvalidArgument,
        match=r"argument 'weight': expected a C-contiguous array, got uint16\[40, 256\] strides \[1, 40\] on cpu",
    ):
        dd.reference.linear_gemv(np.zeros((3, 256), dtype=np.uint16), transposed)


def test_reference_shape_errors_blame_the_argument_that_disagrees():
    x = np.zeros((2, 8, 128), dtype=np.uint16)
    with pytest.raises(dd.InvalidArgument, match=r"argument 'weight': expected \[H, I, J\] with I = 128 \(x's rows\)"):
        dd.reference.head_gemv(x, np.zeros((8, 64, 512), dtype=np.uint16))
    with pytest.raises(dd.InvalidArgument, match=r"argument 'weight': expected \[H, I, J\] with H = 8 \(x's heads\)"):
        dd.reference.head_gemv(x, np.zeros((4, 128, 512), dtype=np.uint16))
    with pytest.raises(dd.InvalidArgument, match=r"argument 'x': expected \[m, H, I\].*got uint16\[8, 128\]"):
        dd.reference.head_gemv(x[0], np.zeros((8, 128, 512), dtype=np.uint16))
    with pytest.raises(dd.InvalidArgument, match=r"argument 'weight': expected \[n, k\] with k = 256 \(x's columns\)"):
        dd.reference.linear_gemv(np.zeros((3, 256), dtype=np.uint16), np.zeros((40, 128), dtype=np.uint16))
    with pytest.raises(dd.InvalidArgument, match=r"argument 'kv_weight': expected \[kv_size\]"):
        dd.reference.qkv_rmsnorm(*norm_arrays(dtype=np.uint16)[:2], np.zeros((1, 512), dtype=np.uint16), 1e-6)


def test_error_counters_must_be_device_words():
    x = np.zeros((1, 1, 8), dtype=np.uint8)
    with pytest.raises(
        dd.InvalidArgument, match=r"argument 'error_count': expected an int32 or uint32 counter, got float32\[1\]"
    ):
        dd.sparse_mla(x, x, x, x, x, 1.0, x, x, x, error_count=np.zeros(1, dtype=np.float32))
    with pytest.raises(dd.InvalidArgument, match="argument 'error_count': expected at least one element"):
        dd.sparse_mla(x, x, x, x, x, 1.0, x, x, x, error_count=np.zeros(0, dtype=np.int32))
    with pytest.raises(dd.InvalidArgument, match=r"argument 'error_count': expected a CUDA array, got int32\[1\].*cpu"):
        dd.sparse_mla(x, x, x, x, x, 1.0, x, x, x, error_count=np.zeros(1, dtype=np.int32))


# --- sizes and plans ------------------------------------------------------------


def test_split_buffer_counts_grow_with_m():
    counters = [dd.sparse_mla_split_counter_count(m, 64, 2176) for m in (1, 2, 16)]
    partials = [dd.sparse_mla_split_partials_count(m, 64, 2176) for m in (1, 2, 16)]
    assert counters[0] >= 64 and counters == sorted(counters)
    assert partials[0] > 0 and partials == sorted(partials)
    assert dd.sparse_mla_split_partials_count(4, 8, 2176) == 0


def test_indexer_plan_workspace_and_its_checks_at_construction():
    small = dd.IndexerPlan(max_tokens=1, max_context=32768).workspace_bytes()
    large = dd.IndexerPlan(max_tokens=16, max_context=131072).workspace_bytes()
    assert 0 < small < large
    assert dd.IndexerPlan(logits="exact").workspace_bytes() == dd.IndexerPlan().workspace_bytes()
    with pytest.raises(dd.InvalidArgument, match="plan.ring"):
        dd.IndexerPlan(ring=5)
    with pytest.raises(dd.InvalidArgument, match="plan.max_tokens"):
        dd.IndexerPlan(max_tokens=0)
    with pytest.raises(dd.InvalidArgument, match="argument 'logits': expected fp32-accumulation or exact, got 'fp16'"):
        dd.IndexerPlan(logits="fp16")


def unchecked_plan(**fields):
    """An IndexerPlan changed after its construction's check (it is frozen:
    only object.__setattr__ gets past that), as a caller could."""
    plan = dd.IndexerPlan()
    for name, value in fields.items():
        object.__setattr__(plan, name, value)
    return plan


def test_indexer_functions_reach_their_checks_with_the_plan():
    # Host arrays fail a check in every function; what matters is that the
    # plan crossed intact (a bad one is named first) and the arrays by name.
    a = np.zeros((1, 128), dtype=np.float32)
    state = dd.IndexerState(a, a, a)
    calls = {
        "project": lambda plan: dd.indexer_project(plan, a, a, a, a, a, a, a, a, a, a),
        "prepare": lambda plan: dd.indexer_prepare(plan, a, a, a, a, a, a, a, a, a, state, a),
        "select": lambda plan: dd.indexer_select(plan, a, a, state, a, a),
        "remap": lambda plan: dd.indexer_remap(plan, a, a, state, a, a),
        "prefill": lambda plan: dd.indexer_prefill(plan, a, a, a, a, a, 0, state),
    }
    for name, call in calls.items():
        with pytest.raises(dd.InvalidArgument, match="plan.ring"):
            call(unchecked_plan(ring=5))
        with pytest.raises(dd.InvalidArgument, match="argument '"):
            call(dd.IndexerPlan())
        with pytest.raises(dd.InvalidArgument, match="argument 'logits'"):
            call(unchecked_plan(logits="fp16"))


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(max_tokens=0), r"argument 'max_tokens': expected 1..16 tokens a step, got 0"),
        (dict(max_tokens=17), r"argument 'max_tokens': expected 1..16 tokens a step, got 17"),
        (dict(attention_plan="latency"), r"argument 'attention_plan': expected auto or batch-invariant, got 'latency'"),
        (dict(head_gemv_sums="fast"), r"argument 'head_gemv_sums': expected tensor-cores or seed-order, got 'fast'"),
        (dict(indexer_logits="fp16"), r"argument 'indexer_logits': expected fp32-accumulation or exact, got 'fp16'"),
        (dict(value_up_tokens={0, 1}), r"argument 'value_up_tokens': expected token counts in 1..16, got 0"),
        (dict(projection_gemv_tokens=[9]), r"argument 'projection_gemv_tokens': expected token counts in 1..8, got 9"),
        (dict(ring=5), r"argument 'plan.ring'"),
        (dict(block_size=100), r"argument 'plan.block_size'"),
        (dict(max_context=0), r"argument 'plan.max_context'"),
        (dict(max_tokens="4"), r"argument 'max_tokens': expected an int, got '4'"),
        (dict(batch_invariant="yes"), r"argument 'batch_invariant': expected True or False, got 'yes'"),
        (dict(value_up_tokens=3), r"argument 'value_up_tokens': expected None or a set of token counts, got 3"),
        (dict(attention_plan=None), r"argument 'attention_plan': expected a str, got None"),
    ],
)
def test_stage_plan_refuses_nonsense_at_construction(fields, match):
    with pytest.raises(dd.InvalidArgument, match=match):
        dd.StagePlan(**fields)


def test_stage_plan_takes_its_choices_and_is_checked_again_by_the_stage():
    plan = dd.StagePlan(
        max_tokens=4,
        batch_invariant=True,
        head_gemv_sums="seed-order",
        indexer_logits="exact",
        attention_plan="batch-invariant",
        value_up_tokens=[1, 2],
        projection_gemv_tokens=range(1, 3),
    )
    assert plan.indexer_plan() == dd.IndexerPlan(max_tokens=4, logits="exact")
    with pytest.raises(TypeError):
        dd.StagePlan(stock_select_fused=True)  # gone: the stock path always runs the fused path's select
    plan.max_tokens = 0  # changed after construction: the stage names it before anything else
    with pytest.raises(dd.InvalidArgument, match="argument 'max_tokens'"):
        dd.Stage(dd.layer_config("glm5next", tp=8), {}, plan)


def test_layer_config_of_the_presets():
    config = dd.layer_config("glm5next", tp=8)
    assert (config.num_heads, config.kv_lora_rank, config.qk_rope_head_dim, config.indexer) == (8, 512, 0, True)
    assert dd.layer_config("glm5next").num_heads == 64
    with pytest.raises(dd.InvalidArgument):
        dd.layer_config("nonesuch")
    with pytest.raises(dd.InvalidArgument):
        dd.layer_config("glm5next", tp=3)


def test_supports_is_the_seeds_rule():
    assert dd.supports(4, 4, 4)
    assert not dd.supports(17, 17, 17)
    assert not dd.supports(4, 4, 3)  # a prefill token in the batch
    assert not dd.supports(4, 4, 4, max_tokens=2)


def test_stage_names_every_missing_weight_without_a_gpu():
    with pytest.raises(dd.InvalidArgument) as error:
        dd.Stage(dd.layer_config("glm5next", tp=8), {})
    for name in dd.WEIGHT_NAMES:
        assert name in str(error.value), name


def test_stage_refuses_unknown_weight_names():
    with pytest.raises(ValueError, match="unknown names \\['W_UK'\\]"):
        dd.Stage(dd.layer_config("glm5next"), {"W_UK": np.zeros(1)})


def test_stage_names_the_seeds_unmet_checks():
    config = dd.layer_config("glm5next", tp=8)
    config.rotary_embedding = True
    config.kv_cache_dtype = "auto"
    with pytest.raises((dd.InvalidArgument, dd.Unsupported)) as error:
        dd.Stage(config, {})
    message = str(error.value)
    assert "rotary" in message.lower() or "nope" in message.lower(), message
    assert "fp8" in message.lower(), message


# --- CPU references against float64 ------------------------------------------------


def test_reference_linear_gemv_is_the_float64_product_within_fp32_error():
    rng = np.random.default_rng(1)
    x, weight = random_bf16(rng, (3, 256)), random_bf16(rng, (40, 256), 0.05)
    got = bf16_values(dd.reference.linear_gemv(x, weight))
    exact = bf16_values(x) @ bf16_values(weight).T
    magnitude = np.abs(bf16_values(x)) @ np.abs(bf16_values(weight)).T
    assert got.shape == (3, 40)
    assert np.all(np.abs(got - exact) <= np.abs(exact) * 2.0**-8 + magnitude * 1e-5)


def test_reference_qkv_rmsnorm_is_the_float64_norm_within_a_bf16_ulp():
    rng = np.random.default_rng(2)
    q_size, kv_size, eps = 64, 32, 1e-6
    qkv = random_bf16(rng, (2, q_size + kv_size))
    q_weight, kv_weight = random_bf16(rng, q_size), random_bf16(rng, kv_size)
    q_out, kv_out = dd.reference.qkv_rmsnorm(qkv, q_weight, kv_weight, eps)
    values = bf16_values(qkv)
    for out, part, gamma in ((q_out, values[:, :q_size], q_weight), (kv_out, values[:, q_size:], kv_weight)):
        exact = part / np.sqrt(np.mean(part**2, axis=1, keepdims=True) + eps) * bf16_values(gamma)
        assert np.all(np.abs(bf16_values(out) - exact) <= np.abs(exact) * 2.0**-7 + 1e-30)


def test_reference_head_gemv_bf16_and_fp8_outputs():
    rng = np.random.default_rng(3)
    x, weight = random_bf16(rng, (2, 8, 128)), random_bf16(rng, (8, 128, 512), 0.05)
    got = bf16_values(dd.reference.head_gemv(x, weight))
    exact = np.einsum("thi,hij->thj", bf16_values(x), bf16_values(weight))
    assert got.shape == (2, 8, 512)
    assert np.all(np.abs(got - exact) <= np.abs(exact) * 2.0**-8 + 1e-4)
    codes = dd.reference.head_gemv(x, weight, fp8_scale=0.01)
    assert codes.dtype == np.uint8 and codes.shape == (2, 8, 512)
    assert not np.any((codes & 0x7F) == 0x7F)  # saturating: no NaN codes
    with pytest.raises(dd.InvalidArgument, match="argument 'weight': expected"):
        dd.reference.head_gemv(x, weight[:, :64])


def test_numpy_is_a_runtime_dependency():
    """dsa_decode.reference returns NumPy arrays, so the package requires NumPy."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    assert any(requirement.split(">")[0].split("=")[0].strip() == "numpy" for requirement in project["dependencies"])
    assert isinstance(dd.reference.linear_gemv(np.zeros((1, 8), np.uint16), np.zeros((2, 8), np.uint16)), np.ndarray)


# --- the indexer's shape (heads, pool, top-k) --------------------------------


def test_indexer_plan_carries_its_shape_and_derives_the_state_shapes():
    from dsa_decode.ops import indexer_ring_for

    default = dd.IndexerPlan()
    assert (default.heads, default.pool, default.topk) == (32, 4, 2048)
    assert (default.row_width, default.top_pools, default.pools_per_page, default.page_bytes) == (2176, 512, 64, 64 * 132)
    assert default.tokens_per_request == 1
    plan = dd.IndexerPlan(heads=16, pool=16, topk=2048, ring=32)
    assert (plan.row_width, plan.top_pools, plan.pools_per_page, plan.page_bytes) == (2176, 128, 16, 16 * 132)
    assert plan.tokens_per_request == 17
    assert dd.IndexerPlan(heads=64, pool=8, topk=1024, ring=8).row_width == 1152
    assert dd.IndexerPlan(heads=16, pool=16, topk=512, ring=16).row_width == 640
    # The workspace grows with the heads (q and weights) and shrinks with the pool (logits).
    assert dd.IndexerPlan(heads=64).workspace_bytes() > default.workspace_bytes()
    assert dd.IndexerPlan(pool=16, ring=16).workspace_bytes() < default.workspace_bytes()
    assert [indexer_ring_for(4, n) for n in (1, 2, 5, 6)] == [4, 8, 8, 0]
    assert indexer_ring_for(16, 17) == 32


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(heads=24), r"argument 'plan.heads': expected 16, 32 or 64 index heads, got 24"),
        (dict(pool=2, ring=2), r"argument 'plan.pool': expected 4, 8 or 16 tokens per pool, or 1 \(no pooling\), got 2"),
        (dict(topk=2050), r"argument 'plan.topk': expected a multiple of plan.pool = 4"),
        (dict(pool=8), r"argument 'plan.ring': expected 8 \(plan.pool"),  # the default RING 4 is no ring of pools of 8
    ],
)
def test_indexer_plan_names_a_bad_shape(fields, match):
    with pytest.raises(dd.InvalidArgument, match=match):
        dd.IndexerPlan(**fields)


def test_indexer_functions_take_the_shape_across_the_binding():
    # A plan changed after its check must reach the C++ check with its shape intact.
    a = np.zeros((1, 128), dtype=np.float32)
    state = dd.IndexerState(a, a, a)
    for fields, match in ((dict(heads=48), "plan.heads"), (dict(topk=7), "plan.topk")):
        with pytest.raises(dd.InvalidArgument, match=match):
            dd.indexer_select(unchecked_plan(**fields), a, a, state, a, a)


def test_stage_plan_carries_the_indexer_shape_to_its_indexer_plan():
    plan = dd.StagePlan(indexer_heads=16, indexer_pool=16, indexer_topk=1024, ring=16)
    indexer = plan.indexer_plan()
    assert (indexer.heads, indexer.pool, indexer.topk, indexer.ring) == (16, 16, 1024, 16)
    assert indexer.row_width == 1152
    default = dd.StagePlan()
    assert (default.indexer_heads, default.indexer_pool, default.indexer_topk) == (32, 4, 2048)
    assert default.indexer_plan() == dd.IndexerPlan()


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(indexer_heads=8), r"argument 'plan.indexer_heads': expected 16, 32 or 64 index heads \(index_n_heads\), got 8"),
        (dict(indexer_pool=12, ring=12), r"argument 'plan.indexer_pool': expected 4, 8 or 16 tokens per pool \(index_kpool\), or 1 \(no pooling: a RoPE layer's indexer\), got 12"),
        (dict(indexer_topk=2047), r"argument 'plan.indexer_topk': expected a multiple of plan.indexer_pool = 4 from 4 to 2048"),
        (dict(indexer_pool=16, indexer_topk=16 * 513, ring=16), r"argument 'plan.indexer_topk': .* from 16 to 8192"),
        (dict(indexer_pool=16), r"argument 'plan.ring': expected 16 \(plan.pool"),
        (dict(indexer_heads="16"), r"argument 'indexer_heads': expected an int, got '16'"),
    ],
)
def test_stage_plan_names_a_bad_indexer_shape(fields, match):
    with pytest.raises(dd.InvalidArgument, match=match):
        dd.StagePlan(**fields)


def test_stage_plan_for_a_preset_and_from_a_model_config():
    from dsa_decode.stage import INDEXER_CONFIG_FIELDS, stage_plan_for

    assert INDEXER_CONFIG_FIELDS == {"indexer_heads": "index_n_heads", "indexer_pool": "index_kpool", "indexer_topk": "index_topk"}
    plan = stage_plan_for("glm5next")
    assert (plan.indexer_heads, plan.indexer_pool, plan.indexer_topk, plan.ring) == (32, 4, 2048, 4)
    plan = stage_plan_for("glm5next", indexer_heads=16, max_tokens=4)
    assert (plan.indexer_heads, plan.max_tokens) == (16, 4)
    with pytest.raises(dd.InvalidArgument, match="argument 'preset'"):
        stage_plan_for("nope")

    config = {"index_n_heads": 16, "index_kpool": 16, "index_topk": 2048, "index_head_dim": 128, "hidden_size": 4096}
    plan = dd.StagePlan.from_model_config(config)
    assert (plan.indexer_heads, plan.indexer_pool, plan.indexer_topk, plan.ring) == (16, 16, 2048, 16)
    plan = dd.StagePlan.from_model_config(config, draft_tokens=3, max_context=4096)
    assert (plan.ring, plan.max_context) == (32, 4096)
    # Explicit fields override the config; a transformers-like object works as a dict does.
    plan = dd.StagePlan.from_model_config(config, indexer_heads=64, indexer_topk=1024)
    assert (plan.indexer_heads, plan.indexer_pool, plan.indexer_topk) == (64, 16, 1024)
    obj = type("Config", (), dict(index_n_heads=32, index_kpool=8, index_topk=2048, index_head_dim=128))()
    assert dd.StagePlan.from_model_config(obj).indexer_plan().row_width == 2176
    # Every missing, mistyped or unsupported field in one message.
    with pytest.raises(dd.InvalidArgument) as bad:
        dd.StagePlan.from_model_config({"index_n_heads": 24, "index_kpool": "16", "index_head_dim": 64})
    message = str(bad.value)
    for part in ("argument 'config'", "missing index_topk", "index_kpool: expected an int, got '16'",
                 "index_head_dim: expected 128, got 64", "index_n_heads: expected 16, 32 or 64, got 24"):
        assert part in message, (part, message)
    with pytest.raises(dd.InvalidArgument, match="index_kpool: expected 4, 8 or 16, got 2"):
        dd.StagePlan.from_model_config({"index_n_heads": 16, "index_kpool": 2, "index_topk": 64, "index_head_dim": 128})
    with pytest.raises(dd.InvalidArgument, match="argument 'draft_tokens': expected at most 4 draft tokens"):
        dd.StagePlan.from_model_config({**config, "index_kpool": 4}, draft_tokens=5)
    with pytest.raises(dd.InvalidArgument, match="plan.indexer_topk"):
        dd.StagePlan.from_model_config({**config, "index_topk": 2040})  # not a multiple of 16


def test_stage_checks_the_indexer_weights_at_the_plans_shape():
    # An F32 index_ape of the default shape (host memory: refused either way)
    # under a plan of pools of 16: named with the plan's shape [16, 128];
    # under the default plan its shape passes and the device is what is named.
    config = dd.layer_config("glm5next", tp=8)
    weights = {"index_ape": np.zeros((4, 128), np.float32)}
    with pytest.raises(dd.InvalidArgument) as refused:
        dd.Stage(config, weights, dd.StagePlan(indexer_heads=16, indexer_pool=16, ring=16, max_tokens=2))
    message = str(refused.value)
    assert "argument 'index_ape': expected shape [16, 128], got f32[4, 128]" in message, message
    assert "'index_wq_b'" in message and "'index_weights_proj'" in message, message  # absent: named too
    with pytest.raises(dd.InvalidArgument) as default:
        dd.Stage(config, weights, dd.StagePlan(max_tokens=2))
    assert "'index_ape'" in str(default.value) and "[16, 128]" not in str(default.value), str(default.value)
