"""The RoPE layers (DeepSeek-V3.2's dsv32, GLM-5's glm5) through the
package's stage API, without a GPU: the layer configuration carries both
rotaries (layer_config, LayerConfig.from_model_config of a Hugging Face
config.json), the plan is the unpooled indexer's (stage_plan_for,
StagePlan.from_model_config), the indexer plan gets the rotary's dims and
style, and every refusal names its argument (the Python checks and the C++
stage's creation checks, which run before any GPU work)."""

import dataclasses
import math

import numpy as np
import pytest

import dsa_decode as dd
from dsa_decode.stage import ROPE_UNREAD_WEIGHTS, V32_BLOCK_SIZE, stage_plan_for
from hf_configs import DSV32, GLM5


def f32(x):
    return float(np.float32(x))


# --- layer_config and the presets ---------------------------------------------------------------


@pytest.mark.parametrize("tp, heads", [(1, 128), (8, 16)])
def test_dsv32_layer_config_carries_both_rotaries(tp, heads):
    c = dd.layer_config("dsv32", tp=tp)
    assert (c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank) == (7168, heads, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert c.rotary_embedding and c.indexer and c.kv_cache_dtype == "fp8_ds_mla"
    assert c.rope == dd.rope_preset_config("dsv32", "attention")
    assert c.indexer_rope == dd.rope_preset_config("dsv32", "indexer")
    assert (c.rope.style, c.indexer_rope.style) == ("interleaved", "half-split")
    assert (c.rope.factor, c.rope.max_position) == (40.0, 163840)
    assert c.softmax_scale == f32(dd.rope_softmax_scale(c.rope, 192)) == pytest.approx(0.1352338, abs=1e-7)


@pytest.mark.parametrize("tp, heads", [(1, 64), (8, 8)])
def test_glm5_layer_config_carries_both_rotaries(tp, heads):
    c = dd.layer_config("glm5", tp=tp)
    assert (c.hidden_size, c.num_heads, c.q_lora_rank, c.qk_nope_head_dim, c.v_head_dim) == (6144, heads, 2048, 192, 256)
    assert c.rope == dd.rope_preset_config("glm5") and c.indexer_rope == dd.rope_preset_config("glm5", "indexer")
    assert (c.rope.style, c.indexer_rope.style, c.rope.factor, c.rope.theta) == ("interleaved", "interleaved", 1.0, 1e6)
    assert c.softmax_scale == 1 / 16 and c.kv_cache_dtype == "fp8_ds_mla"


def test_the_nope_preset_has_no_rotary():
    c = dd.layer_config("glm5next", tp=8)
    assert c.rope is None and c.indexer_rope is None and not c.rotary_embedding


def test_a_layer_config_round_trips_through_asdict_and_names_a_bad_rotary():
    c = dd.layer_config("dsv32", tp=8)
    fields = dataclasses.asdict(c)
    assert isinstance(fields["rope"], dict)  # asdict recurses into the RopeConfig
    assert dd.LayerConfig(**fields) == c
    bad = dict(fields, rope=dict(fields["rope"], theta=0.5))
    with pytest.raises(dd.InvalidArgument, match=r"argument 'rope.theta': expected a finite value > 1, got 0.5"):
        dd.LayerConfig(**bad)
    with pytest.raises(dd.InvalidArgument, match=r"argument 'indexer_rope.style': expected interleaved or half-split"):
        dd.LayerConfig(**dict(fields, indexer_rope=dict(fields["indexer_rope"], style="neox")))
    with pytest.raises(dd.InvalidArgument, match=r"argument 'rope': expected RopeConfig's fields"):
        dd.LayerConfig(**dict(fields, rope=dict(fields["rope"], frequency=2)))
    with pytest.raises(dd.InvalidArgument, match=r"argument 'indexer_rope': expected None or a dsa_decode.RopeConfig, got tuple"):
        dd.LayerConfig(**dict(fields, indexer_rope=(64, 10000.0)))
    # A RopeConfig changed after its construction's check is named by the extension's (the C++ check).
    changed = dataclasses.replace(c, rope=dataclasses.replace(c.rope))
    object.__setattr__(changed.rope, "theta", 0.5)  # frozen: forced past RopeConfig's own check
    with pytest.raises(dd.InvalidArgument, match=r"argument 'config.rope.theta': expected a finite value > 1"):
        dd.Stage(changed, {})


# --- from a Hugging Face config.json ----------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 8])
def test_a_deepseek_v32_config_gives_the_presets_layer(tp):
    c = dd.LayerConfig.from_model_config(DSV32, tp=tp)
    assert c == dd.layer_config("dsv32", tp=tp, rms_norm_eps=1e-6)
    # vLLM's rope_parameters form (transformers 5: rope_theta inside, rope_type "yarn").
    parameters = dict(DSV32, rope_parameters=dict(DSV32["rope_scaling"], rope_type="yarn", rope_theta=10000.0))
    del parameters["rope_scaling"], parameters["rope_theta"]
    del parameters["rope_parameters"]["type"]
    assert dd.LayerConfig.from_model_config(parameters, tp=tp) == c
    # vLLM's own name for the branch it takes.
    deepseek_yarn = dict(DSV32, rope_scaling=dict(DSV32["rope_scaling"], type="deepseek_yarn"))
    assert dd.LayerConfig.from_model_config(deepseek_yarn, tp=tp) == c


def test_a_glm5_config_gives_the_presets_layer():
    c = dd.LayerConfig.from_model_config(GLM5, tp=8)
    assert c == dd.layer_config("glm5", tp=8, rms_norm_eps=1e-5)
    # Without indexer_rope_interleave the indexer is half-split (vLLM: is_neox_style = not ...).
    plain = {k: v for k, v in GLM5.items() if k != "indexer_rope_interleave"}
    assert dd.LayerConfig.from_model_config(plain, tp=8).indexer_rope.style == "half-split"


def test_yarn_defaults_text_config_objects_and_overrides():
    # The YaRN fields a config may leave out take vLLM's get_rope defaults (mscale_all_dim 0: no softmax factor).
    scaling = dict(type="yarn", factor=40, original_max_position_embeddings=4096)
    c = dd.LayerConfig.from_model_config(dict(DSV32, rope_scaling=scaling), tp=8)
    assert (c.rope.beta_fast, c.rope.beta_slow, c.rope.mscale, c.rope.mscale_all_dim) == (32.0, 1.0, 1.0, 0.0)
    assert c.rope.max_position == 163840  # vLLM's table: original x factor rows
    assert c.softmax_scale == f32(192**-0.5)
    # A multimodal checkpoint's text_config; a transformers-like object.
    assert dd.LayerConfig.from_model_config({"text_config": DSV32}, tp=8) == dd.LayerConfig.from_model_config(DSV32, tp=8)
    obj = type("Config", (), dict(DSV32))()
    assert dd.LayerConfig.from_model_config(obj, tp=8) == dd.LayerConfig.from_model_config(DSV32, tp=8)
    assert dd.LayerConfig.from_model_config(DSV32, tp=8, kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


def test_a_nope_config_gives_a_layer_without_rotaries():
    glm5next = dict(
        hidden_size=4096, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256,
        qk_rope_head_dim=0, v_head_dim=256, rms_norm_eps=1e-6,
    )
    assert dd.LayerConfig.from_model_config(glm5next, tp=8) == dd.layer_config("glm5next", tp=8)


def config_error(config, **kwargs) -> str:
    with pytest.raises(dd.InvalidArgument) as error:
        dd.LayerConfig.from_model_config(config, **kwargs)
    message = str(error.value)
    assert message.startswith("invalid argument: argument 'config': expected a DSA layer's Hugging Face config, got: ")
    return message


def test_every_missing_mistyped_or_unsupported_config_field_is_named_in_one_message():
    broken = {k: v for k, v in DSV32.items() if k not in ("q_lora_rank", "rope_theta")}
    broken.update(v_head_dim="128", rms_norm_eps=0.0, indexer_rope_interleave="yes")
    broken["rope_scaling"] = dict(type="yarn", original_max_position_embeddings=4096, beta_fast="fast")
    message = config_error(broken, tp=3)
    for part in (
        "missing q_lora_rank, rope_theta, rope_scaling.factor",
        "v_head_dim: expected an int >= 0, got '128'",
        "rms_norm_eps: expected a finite value > 0, got 0.0",
        "num_attention_heads: 128 heads do not split over tp = 3",
        "rope_scaling.beta_fast: expected a number, got 'fast'",
        "indexer_rope_interleave: expected true or false, got 'yes'",
    ):
        assert part in message, (part, message)


@pytest.mark.parametrize(
    "change, part",
    [
        (dict(rope_scaling=dict(type="llama3", factor=8.0)), "rope_scaling.rope_type: expected 'default', 'yarn'"),
        (dict(rope_scaling=dict(type="yarn", factor=0.5, original_max_position_embeddings=4096)),
         "rope_scaling.factor: expected a finite value >= 1, got 0.5"),
        (dict(rope_scaling="yarn"), "rope_scaling: expected a dict or null, got 'yarn'"),
        (dict(rope_scaling=None, max_position_embeddings=None), "missing max_position_embeddings"),
        (dict(rope_theta=1.0), "rope_theta: expected a finite value > 1, got 1.0"),
        (dict(rope_parameters=[1, 2]), "rope_parameters: expected a dict, got [1, 2]"),
    ],
)
def test_an_unsupported_rotary_is_named(change, part):
    assert part in config_error(dict(DSV32, **change))


def test_a_rope_dim_the_library_has_no_rotary_for_is_named():
    assert "the rotary: invalid argument: argument 'rope_dim'" in config_error(dict(DSV32, qk_rope_head_dim=48))


def test_tp_is_checked():
    assert "tp: expected an int >= 1, got 0" in config_error(DSV32, tp=0)


# --- the plan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, heads", [("dsv32", 64), ("glm5", 32)])
def test_the_rope_presets_plans_are_the_unpooled_indexers(preset, heads):
    plan = stage_plan_for(preset)
    assert (plan.indexer_heads, plan.indexer_pool, plan.indexer_topk, plan.ring) == (heads, 1, 2048, 1)
    config = dd.layer_config(preset, tp=8)
    ip = plan.indexer_plan(config)
    assert (ip.heads, ip.pool, ip.topk, ip.ring, ip.rope_dims) == (heads, 1, 2048, 1, 64)
    assert ip.rope_style == config.indexer_rope.style
    assert ip.row_width == 2048 and ip.page_bytes == plan.block_size * 132
    # Without the layer's configuration (or with a NoPE one) the plan has no rotary.
    assert plan.indexer_plan().rope_dims == 0
    assert dd.StagePlan().indexer_plan(dd.layer_config("glm5next")).rope_dims == 0
    with pytest.raises(TypeError, match="argument 'config'"):
        plan.indexer_plan("dsv32")


@pytest.mark.parametrize("config, heads", [(DSV32, 64), (GLM5, 32)])
def test_a_rope_models_config_gives_the_unpooled_plan(config, heads):
    plan = dd.StagePlan.from_model_config(config)
    assert (plan.indexer_heads, plan.indexer_pool, plan.indexer_topk, plan.ring) == (heads, 1, 2048, 1)
    assert plan.block_size == V32_BLOCK_SIZE == 64
    # Draft tokens need no ring at pool 1; explicit fields win.
    plan = dd.StagePlan.from_model_config(config, draft_tokens=3, block_size=128, indexer_topk=1024, max_context=8192)
    assert (plan.ring, plan.block_size, plan.indexer_topk, plan.max_context) == (1, 128, 1024, 8192)
    layer = dd.LayerConfig.from_model_config(config, tp=8)
    assert plan.indexer_plan(layer).rope_dims == 64


def test_a_rope_models_bad_indexer_fields_are_named():
    with pytest.raises(dd.InvalidArgument) as error:
        dd.StagePlan.from_model_config({**DSV32, "index_n_heads": 24, "index_head_dim": 64, "index_topk": None})
    message = str(error.value)
    for part in ("argument 'config'", "index_topk: expected an int, got None", "index_head_dim: expected 128, got 64",
                 "index_n_heads: expected 16, 32 or 64, got 24"):
        assert part in message, (part, message)
    with pytest.raises(dd.InvalidArgument, match="plan.indexer_topk"):
        dd.StagePlan.from_model_config({**DSV32, "index_topk": 4096})  # more than 2048 at pool 1
    # A NoPE config without index_kpool still misses it (pool 1 is the RoPE layers' indexer).
    with pytest.raises(dd.InvalidArgument, match="missing index_kpool"):
        dd.StagePlan.from_model_config({**DSV32, "qk_rope_head_dim": 0})
    # A pooled config with rotary dims keeps its pool (the stage then names it for a RoPE layer).
    assert dd.StagePlan.from_model_config({**DSV32, "index_kpool": 4}).indexer_pool == 4


# --- the stage's creation checks (CPU: they run before any GPU work) ----------------------------------


def stage_error(config, weights=None, plan=None) -> str:
    with pytest.raises(dd.InvalidArgument) as error:
        dd.Stage(config, weights or {}, plan)
    return str(error.value)


@pytest.mark.parametrize("preset", ["dsv32", "glm5"])
def test_a_rope_stage_names_every_weight_it_reads_and_not_the_ones_it_does_not(preset):
    message = stage_error(dd.layer_config(preset, tp=8), plan=stage_plan_for(preset, max_tokens=2))
    for name in dd.WEIGHT_NAMES:
        assert (f"'{name}'" in message) == (name not in ROPE_UNREAD_WEIGHTS), (name, message)
    assert "config.rope" not in message and "plan." not in message, message


def test_a_rope_stage_names_a_wrong_weight_with_its_dtype_and_shape():
    # (NumPy has no BF16: the BF16 weights' shapes, with their R rope rows, are
    # checked by the GPU tests and stage_rope_test.cu; here an F32 one's shape.)
    config = dd.layer_config("dsv32", tp=8)
    weights = {
        "fused_qkv_a_proj": np.zeros((1536 + 512 + 64, 7168), np.float32),
        "index_k_norm_weight": np.zeros(64, np.float32),
    }
    message = stage_error(config, weights, stage_plan_for("dsv32", max_tokens=2))
    assert "argument 'fused_qkv_a_proj': expected dtype bf16, got f32[2112, 7168]" in message, message
    assert "argument 'index_k_norm_weight': expected shape [128], got f32[64]" in message, message


def test_a_rope_stage_names_missing_or_wrong_rotaries_and_the_plan():
    config = dd.layer_config("dsv32", tp=8)
    plan = stage_plan_for("dsv32", max_tokens=2)
    message = stage_error(dataclasses.replace(config, rope=None, indexer_rope=dd.RopeConfig(rope_dim=32)), plan=plan)
    assert "argument 'config.rope': expected the layer's rotary" in message, message
    assert "argument 'config.indexer_rope.rope_dim': expected qk_rope_head_dim = 64 rotated dims, got 32" in message
    message = stage_error(config, plan=dd.StagePlan(max_tokens=2))  # glm5next's pooled indexer
    assert "argument 'plan.indexer_pool': expected 1 for a RoPE layer" in message, message
    message = stage_error(config, plan=stage_plan_for("dsv32", max_tokens=2, max_context=200000))
    assert "argument 'plan.max_context': expected at most config.rope.max_position = 163840" in message, message
    message = stage_error(dataclasses.replace(config, kv_cache_dtype="auto"), plan=plan)
    assert "fp8_ds_mla" in message, message
    message = stage_error(dataclasses.replace(config, rotary_embedding=False), plan=plan)
    assert "rotary_embedding true with qk_rope_head_dim 64" in message, message
    # A NoPE layer with the unpooled plan.
    message = stage_error(dd.layer_config("glm5next", tp=8), plan=plan)
    assert "argument 'plan.indexer_pool': expected 4, 8 or 16 for a NoPE layer" in message, message


def test_a_stage_needs_a_layer_config():
    with pytest.raises(TypeError, match="argument 'config': expected a dsa_decode.LayerConfig, got dict"):
        dd.Stage(dataclasses.asdict(dd.layer_config("dsv32")), {})


def test_a_step_takes_no_ring_at_pool_1():
    """StepArgs and torch_ops.stage_forward take ring None (the unpooled
    indexer keeps none): the binding passes an empty view, which a pooled
    stage's own checks name."""
    args = dd.StepArgs(None, None, None, None, None, dd.IndexerState(None, None, None), None)
    assert args._args()[6] is None
    assert math.isfinite(dd.layer_config("dsv32").softmax_scale)


def test_the_unpooled_indexers_projection_takes_no_gate():
    """indexer_project at pool 1 takes compress_gate and gate None (the
    stage's RoPE lane runs it so); the checks then judge the tensors."""
    plan = dd.IndexerPlan.dsv32(max_tokens=2, max_context=4096)
    x = np.zeros((2, 7168), np.float32)
    with pytest.raises(dd.InvalidArgument, match=r"argument 'q_c': expected dtype bf16"):
        dd.indexer_project(plan, np.zeros((2, 1536), np.float32), x, x, x, x, None, x, x, x, None)
