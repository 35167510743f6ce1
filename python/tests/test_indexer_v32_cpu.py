"""CPU tests of DeepSeek-V3.2's indexer in the Python package (indexer.h pool 1,
rope_dims / rope_style, the cos_sin table of prepare and prefill): the plan's
new fields cross the binding intact and are checked by the C++ rules, the
derived shapes and workspace offsets are indexer.h's, and the table, gate,
ape and ring arguments arrive by name. No GPU needed: the kernels' own checks
past the first CUDA one run in test_indexer_v32_gpu.py."""

import inspect

import numpy as np
import pytest

import dsa_decode as dd
from dsa_decode import ops


def unchecked(plan, **fields):
    """A plan changed after its construction's check (frozen: object.__setattr__ only)."""
    for name, value in fields.items():
        object.__setattr__(plan, name, value)
    return plan


def test_dsv32_plan_is_deepseeks_shape_and_derives_the_pool_one_shapes():
    plan = dd.IndexerPlan.dsv32()
    assert (plan.heads, plan.pool, plan.topk, plan.ring, plan.rope_dims, plan.rope_style, plan.block_size) == (
        64, 1, 2048, 1, 64, "half-split", 64)
    assert plan == dd.IndexerPlan(heads=64, pool=1, topk=2048, ring=1, rope_dims=64, block_size=64)
    # A key per token: 2048 columns (no tail), pages of 64 x 132 bytes, top_pools = the tokens.
    assert (plan.row_width, plan.top_pools, plan.pools_per_page, plan.page_bytes) == (2048, 2048, 64, 64 * 132)
    # No ring: a step may hold any number of one request's tokens (indexer.h: kIndexerMaxTokens).
    assert plan.tokens_per_request == 16
    assert dd.IndexerPlan.dsv32(max_tokens=4).tokens_per_request == 16
    assert dd.IndexerPlan.dsv32(topk=1000).row_width == 1024  # K rounded up to 128
    assert dd.IndexerPlan.dsv32(block_size=256).page_bytes == 256 * 132


def test_default_plan_keeps_no_rope():
    plan = dd.IndexerPlan()
    assert (plan.rope_dims, plan.rope_style) == (0, "half-split")
    assert plan.rope_style == ops.INDEXER_ROPE_STYLES[0]


def test_workspace_layout_is_indexer_workspace_layouts():
    def up(x):
        return (x + 255) // 256 * 256

    for plan in (dd.IndexerPlan.dsv32(), dd.IndexerPlan.dsv32(max_tokens=3, max_context=40001),
                 dd.IndexerPlan(), dd.IndexerPlan(heads=16, pool=16, ring=16, max_context=1000, max_tokens=5)):
        m, h = plan.max_tokens, plan.heads
        pools = -(-plan.max_context // plan.pool)
        layout = plan.workspace_layout()
        assert layout["q_fp8"] == 0
        assert layout["head_weights"] == up(m * h * 128)
        assert layout["logits"] == up(layout["head_weights"] + m * h * 4)
        assert layout["logits_stride"] == pools
        assert layout["bytes"] == up(layout["logits"] + m * pools * 4) == plan.workspace_bytes()
    # Pool 1 scores every token: max_context logits a row.
    assert dd.IndexerPlan.dsv32().workspace_layout()["logits_stride"] == 131072


def test_rope_styles_are_rope_styles_names_each_accepted():
    assert set(ops.INDEXER_ROPE_STYLES) == set(dd.ROPE_STYLES)
    assert ops.INDEXER_ROPE_STYLES[0] == "half-split"  # IndexerPlan's default (vLLM's V3.2 indexer)
    for style in dd.ROPE_STYLES:
        assert dd.IndexerPlan.dsv32(rope_style=style).rope_style == style
    # The indexer preset's style is one the plan takes.
    assert dd.rope_preset_config("dsv32", "indexer").style in ops.INDEXER_ROPE_STYLES


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(rope_style="neox"), r"argument 'rope_style': expected half-split or interleaved, got 'neox'"),
        (dict(rope_dims=48), r"argument 'plan.rope_dims': expected 0 \(no RoPE\), 16, 32, 64 or 128 rotated dims, got 48"),
        (dict(rope_dims=256), r"argument 'plan.rope_dims': .* got 256"),
        (dict(ring=4), r"argument 'plan.ring': expected 1 \(plan.pool 1 keeps no ring\), got 4"),
        (dict(topk=2049), r"argument 'plan.topk': expected 1..2048 tokens \(plan.pool 1\), got 2049"),
        (dict(topk=0), r"argument 'plan.topk': expected 1..2048 tokens"),
        (dict(block_size=96), r"argument 'plan.block_size': expected a positive multiple of 64 tokens \(plan.pool 1"),
        (dict(heads=24), r"argument 'plan.heads'"),
    ],
)
def test_dsv32_plan_names_a_bad_field(fields, match):
    with pytest.raises(dd.InvalidArgument, match=match):
        dd.IndexerPlan.dsv32(**fields)


def test_rope_needs_pool_one_and_pool_one_takes_any_rope():
    with pytest.raises(dd.InvalidArgument, match=r"argument 'plan.rope_dims': expected 0 with pools of 4 \(RoPE"):
        dd.IndexerPlan(rope_dims=64)
    with pytest.raises(dd.InvalidArgument, match=r"argument 'plan.rope_dims': expected 0 with pools of 16"):
        dd.IndexerPlan(pool=16, ring=16, rope_dims=16)
    for r in (0, 16, 32, 64, 128):
        assert dd.IndexerPlan.dsv32(rope_dims=r).rope_dims == r
    # Pool 1 at the glm5next head counts, without RoPE.
    assert dd.IndexerPlan(heads=32, pool=1, topk=512, ring=1, block_size=128).row_width == 512


def test_new_fields_cross_the_binding_intact():
    # A plan changed after its check reaches every function's C++ check with its new fields.
    a = np.zeros((1, 128), dtype=np.float32)
    state = dd.IndexerState(a, None, a)
    calls = {
        "prepare": lambda plan: dd.indexer_prepare(plan, a, a, a, None, a, a, None, a, a, state, a),
        "prefill": lambda plan: dd.indexer_prefill(plan, a, None, a, a, None, 0, state),
        "select": lambda plan: dd.indexer_select(plan, a, a, state, a, a),
        "remap": lambda plan: dd.indexer_remap(plan, a, a, state, a, a),
    }
    for name, call in calls.items():
        with pytest.raises(dd.InvalidArgument, match="plan.rope_dims"):
            call(unchecked(dd.IndexerPlan.dsv32(), rope_dims=48))
        with pytest.raises(dd.InvalidArgument, match="plan.rope_dims.*pools of 4"):
            call(unchecked(dd.IndexerPlan(), rope_dims=64))
        with pytest.raises(dd.InvalidArgument, match="argument 'rope_style'"):
            call(unchecked(dd.IndexerPlan.dsv32(), rope_style="gptj"))
        with pytest.raises(dd.InvalidArgument, match="plan.topk"):
            call(unchecked(dd.IndexerPlan.dsv32(), topk=4096))
        # A valid V3.2 plan passes the plan checks: the first array check speaks (CPU arrays).
        with pytest.raises(dd.InvalidArgument, match="argument '(index_q|index_k|positions)'") as e:
            call(dd.IndexerPlan.dsv32())
        assert "plan." not in str(e.value), name


def test_cos_sin_is_an_optional_keyword_of_prepare_and_prefill_named_in_errors():
    for fn in (dd.indexer_prepare, dd.indexer_prefill):
        p = inspect.signature(fn).parameters["cos_sin"]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None
    plan = dd.IndexerPlan.dsv32()
    a = np.zeros((1, 128), dtype=np.float32)
    state = dd.IndexerState(a, None, a)
    bad = np.zeros((plan.max_context, 64), dtype=np.float64)  # no dtype the library takes
    with pytest.raises(dd.InvalidArgument, match=r"argument 'cos_sin': expected bfloat16, float16, float32"):
        dd.indexer_prepare(plan, a, a, a, None, a, a, None, a, a, state, a, cos_sin=bad)
    with pytest.raises(dd.InvalidArgument, match=r"argument 'cos_sin': expected bfloat16, float16, float32"):
        dd.indexer_prefill(plan, a, None, a, a, None, 0, state, cos_sin=bad)
    # The table is an array argument like any other: a well-typed one reaches the C++ checks.
    table = np.zeros((plan.max_context, 64), dtype=np.float32)
    with pytest.raises(dd.InvalidArgument, match="argument 'index_k'"):
        dd.indexer_prefill(plan, a, None, a, a, None, 0, state, cos_sin=table)


def test_gate_ape_and_ring_may_be_none_and_are_named_when_bad():
    plan = dd.IndexerPlan.dsv32()
    a = np.zeros((1, 128), dtype=np.float32)
    wrong = np.zeros((1, 128), dtype=np.complex64)
    for name, args in (
        ("gate", dict(gate=wrong)),
        ("ape", dict(ape=wrong)),
        ("state.ring", dict(ring=wrong)),
    ):
        state = dd.IndexerState(a, args.get("ring"), a)
        with pytest.raises(dd.InvalidArgument, match=f"argument '{name}"):
            dd.indexer_prefill(plan, a, args.get("gate"), a, a, args.get("ape"), 0, state)
        with pytest.raises(dd.InvalidArgument, match=f"argument '{name}"):
            dd.indexer_prepare(plan, a, a, a, args.get("gate"), a, a, args.get("ape"), a, a, state, a)
