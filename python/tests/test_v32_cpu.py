"""CPU tests of the RoPE presets' Python API (rope.h, sparse_mla_v32.h through
dsa_decode): the exports, the served rotary configurations and softmax
scales, the cos/sin table against a float64 closed form written here from
DeepSeek's YaRN (not from the library), table shapes, and argument errors
that name the argument. No GPU and no PyTorch needed (CI runs these)."""

import math

import numpy as np
import pytest

import dsa_decode as dd


# --- exports -------------------------------------------------------------------


def test_the_v32_api_is_exported():
    for name in (
        "rope_absorb",
        "rope_cos_sin_table",
        "rope_preset_config",
        "rope_softmax_scale",
        "sparse_mla_v32",
        "sparse_mla_v32_cache_write",
        "stage_plan_for",
        "indexer_ring_for",
    ):
        assert callable(getattr(dd, name)), name
        assert name in dd.__all__, name
    assert dd.RopeConfig is dd.ops.RopeConfig
    assert dd.INDEXER_CONFIG_FIELDS is dd.stage.INDEXER_CONFIG_FIELDS
    assert dd.ROPE_STYLES == ("interleaved", "half-split")
    assert dd.ROPE_TARGETS == ("attention", "indexer")
    assert sorted(set(dd.__all__)) == sorted(dd.__all__)
    for name in dd.__all__:
        assert hasattr(dd, name), name


def test_the_cache_layout_is_the_656_byte_v32_entry():
    layout = dd.SPARSE_MLA_V32_LAYOUT
    assert layout["entry_bytes"] == 656 == layout["latent"] + 4 * 4 + 2 * layout["rope"]
    assert (layout["latent"], layout["rope"], layout["head_dim"], layout["group_size"]) == (512, 64, 576, 128)
    assert (layout["scale_offset"], layout["rope_offset"]) == (512, 528)
    assert layout["max_heads"] >= 128 and layout["max_top_k"] >= 2048


# --- presets and scales --------------------------------------------------------


def test_dsv32_preset_is_deepseeks_yarn():
    c = dd.rope_preset_config("dsv32")
    assert (c.rope_dim, c.theta, c.factor, c.original_max_position) == (64, 10000.0, 40.0, 4096)
    assert (c.beta_fast, c.beta_slow, c.mscale, c.mscale_all_dim) == (32.0, 1.0, 1.0, 1.0)
    assert c.max_position == 163840 == c.original_max_position * c.factor
    assert c.style == "interleaved"
    assert dd.rope_preset_config("dsv32", "indexer").style == "half-split"
    assert c.table_scale == 1.0  # mscale == mscale_all_dim


def test_glm5_preset_is_plain_rope_interleaved():
    for target in dd.ROPE_TARGETS:
        c = dd.rope_preset_config("glm5", target)
        assert (c.rope_dim, c.theta, c.factor, c.max_position, c.style) == (64, 1e6, 1.0, 202752, "interleaved")


def test_softmax_scales():
    dsv32 = dd.rope_preset_config("dsv32")
    mscale = 0.1 * math.log(40.0) + 1.0
    assert dd.rope_softmax_scale(dsv32, 192) == pytest.approx(192**-0.5 * mscale**2, rel=1e-15)
    assert dd.rope_softmax_scale(dsv32, 192) == pytest.approx(0.1352338, abs=5e-8)
    assert dd.rope_softmax_scale(dd.rope_preset_config("glm5"), 256) == pytest.approx(1 / 16, rel=1e-15)


def yarn_frequencies(theta, rope_dim, factor, original, beta_fast, beta_slow):
    """DeepSeek's YaRN frequencies in float64 (inference/model.py precompute_freqs_cis)."""
    base = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if factor <= 1.0:
        return base

    def correction_dim(rotations):
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    return base / factor * (1 - smooth) + base * smooth


@pytest.mark.parametrize("preset", ["dsv32", "glm5"])
def test_frequencies_match_the_closed_form(preset):
    c = dd.rope_preset_config(preset)
    f = yarn_frequencies(c.theta, c.rope_dim, c.factor, c.original_max_position, c.beta_fast, c.beta_slow)
    got = np.array([c.frequency(i) for i in range(c.rope_dim // 2)])
    np.testing.assert_allclose(got, f, rtol=1e-14, atol=0)


@pytest.mark.parametrize("preset", ["dsv32", "glm5"])
def test_table_matches_the_float64_closed_form(preset):
    """Each entry within 2^-24 * scale of cos / sin in float64 (rope.h), and
    nearly all of them exactly the float32 rounding of the float64 value."""
    c = dd.rope_preset_config(preset)
    f = yarn_frequencies(c.theta, c.rope_dim, c.factor, c.original_max_position, c.beta_fast, c.beta_slow)
    half = c.rope_dim // 2
    last = c.max_position - 1
    positions = [0, 1, 4095, 4096, 65537, 131072, last]
    table = dd.rope_cos_sin_table(c)  # every row
    assert table.shape == (c.max_position, c.rope_dim) and table.dtype == np.float32
    exact_entries = total = 0
    for p in positions:
        angle = p * f
        want = np.concatenate([np.cos(angle), np.sin(angle)]) * c.table_scale
        row = table[p].astype(np.float64)
        assert np.max(np.abs(row - want)) <= 2.0**-24 * c.table_scale, (preset, p)
        exact_entries += int(np.sum(table[p] == want.astype(np.float32)))
        total += c.rope_dim
    assert exact_entries >= total - 2  # libm's last-bit differences at most
    # The first half of row p is cos, the second sin: row 0 is [1..1 | 0..0].
    assert np.all(table[0, :half] == np.float32(c.table_scale)) and np.all(table[0, half:] == 0)


def test_table_rows_and_offsets():
    c = dd.rope_preset_config("glm5")
    full = dd.rope_cos_sin_table(c, 0, 1000)
    assert full.shape == (1000, 64)
    np.testing.assert_array_equal(dd.rope_cos_sin_table(c, 300, 7), full[300:307])
    assert dd.rope_cos_sin_table(c, 5, 0).shape == (0, 64)
    small = dd.RopeConfig(rope_dim=16, theta=500.0, max_position=37, style="half-split")
    assert dd.rope_cos_sin_table(small).shape == (37, 16)
    assert dd.rope_cos_sin_table(small, 30).shape == (7, 16)
    # Pair norms: cos^2 + sin^2 = scale^2 (to float32 rounding).
    t = dd.rope_cos_sin_table(dd.rope_preset_config("dsv32"), 100000, 50).astype(np.float64)
    np.testing.assert_allclose(t[:, :32] ** 2 + t[:, 32:] ** 2, 1.0, atol=2.0**-21)


# --- argument errors ------------------------------------------------------------


def raises_naming(name, call, exception=dd.InvalidArgument):
    with pytest.raises(exception) as info:
        call()
    assert f"argument '{name}'" in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("rope_dim", 48),
        ("theta", 1.0),
        ("factor", 0.5),
        ("factor", float("nan")),
        ("max_position", 0),
        ("mscale", float("inf")),
        ("style", "neox"),
    ],
)
def test_rope_config_fields_are_checked_by_name(field, value):
    raises_naming(field, lambda: dd.RopeConfig(**{field: value}))


def test_yarn_fields_are_checked_only_with_yarn():
    raises_naming("original_max_position", lambda: dd.RopeConfig(factor=4.0, original_max_position=0))
    raises_naming("beta_fast", lambda: dd.RopeConfig(factor=4.0, beta_fast=0.0))
    dd.RopeConfig(factor=1.0, original_max_position=0)  # plain RoPE ignores them


def test_preset_and_function_arguments_are_named():
    text = raises_naming("preset", lambda: dd.rope_preset_config("glm5next"))
    assert "dsv32 or glm5" in text
    raises_naming("target", lambda: dd.rope_preset_config("dsv32", "mla"))
    c = dd.rope_preset_config("dsv32")
    raises_naming("first_position", lambda: dd.rope_cos_sin_table(c, -1, 3))
    raises_naming("rows", lambda: dd.rope_cos_sin_table(c, 0, -2))
    raises_naming("rows", lambda: dd.rope_cos_sin_table(c, 0, 1 << 40))
    raises_naming("rows", lambda: dd.rope_cos_sin_table(c, c.max_position + 1))  # default rows < 0
    raises_naming("qk_head_dim", lambda: dd.rope_softmax_scale(c, 0))
    raises_naming("pair", lambda: c.frequency(32))
    raises_naming("pair", lambda: c.frequency(-1))
    for call in (lambda: dd.rope_cos_sin_table("dsv32"), lambda: dd.rope_softmax_scale(None, 192)):
        with pytest.raises(TypeError, match="argument 'config'"):
            call()


F32 = np.float32


def v32_args(m=1, heads=16, top_k=8):
    return dict(
        q=np.zeros((m, heads, 576), F32),
        kv_cache=np.zeros((4, 64, 656), np.uint8),
        indices=np.zeros((m, top_k), np.int32),
        softmax_scale=0.1352,
        latent=np.zeros((m, heads, 512), F32),
        lse=np.zeros((m, heads), F32),
    )


def test_sparse_mla_v32_errors_name_the_argument():
    a = v32_args()
    assert "bf16" in raises_naming("q", lambda: dd.sparse_mla_v32(**a))
    bad = dict(a, kv_cache=np.zeros((4, 64, 656), F32))
    assert "FP8 e4m3" in raises_naming("kv_cache", lambda: dd.sparse_mla_v32(**bad))
    bad = dict(a, indices=np.zeros((1, 8), np.float64))
    raises_naming("indices", lambda: dd.sparse_mla_v32(**bad))
    bad = dict(a, latent=np.zeros((1, 16, 512), np.complex64))
    raises_naming("latent", lambda: dd.sparse_mla_v32(**bad))
    counter = np.zeros(1, np.int32)
    assert "CUDA" in raises_naming("error_count", lambda: dd.sparse_mla_v32(**a, error_count=counter))
    raises_naming("error_count", lambda: dd.sparse_mla_v32(**a, error_count=np.zeros(1, F32)))
    with pytest.raises(TypeError, match="argument 'stream'"):
        dd.sparse_mla_v32(**a, stream="default")


def test_sparse_mla_v32_cache_write_errors_name_the_argument():
    kv_c, k_pe = np.zeros((2, 512), F32), np.zeros((2, 64), F32)
    slots, cache = np.zeros(2, np.int64), np.zeros((4, 64, 656), np.uint8)
    assert "bf16" in raises_naming("kv_c", lambda: dd.sparse_mla_v32_cache_write(kv_c, k_pe, slots, cache))
    bad_cache = np.zeros((4, 64, 656), np.float64)
    raises_naming("kv_cache", lambda: dd.sparse_mla_v32_cache_write(kv_c, k_pe, slots, bad_cache))
    raises_naming("slot_mapping", lambda: dd.sparse_mla_v32_cache_write(kv_c, k_pe, np.zeros(2, np.float64), cache))
    raises_naming(
        "error_count",
        lambda: dd.sparse_mla_v32_cache_write(kv_c, k_pe, slots, cache, error_count=np.zeros(1, np.int32)),
    )


def rope_args(m=1, heads=16, p=128, r=64, latent=512):
    return dict(
        q_nope=np.zeros((m, heads, p), F32),
        q_pe=np.zeros((m, heads, r), F32),
        k_pe=np.zeros((m, r), F32),
        positions=np.zeros(m, np.int64),
        cos_sin=np.zeros((16, r), F32),
        weight=np.zeros((heads, p, latent), F32),
        out=np.zeros((m, heads, latent + r), F32),
        k_pe_out=np.zeros((m, r), F32),
    )


def test_rope_absorb_errors_name_the_argument():
    a = rope_args()
    raises_naming("style", lambda: dd.rope_absorb(**a, style="neox"))
    assert "bf16" in raises_naming("q_nope", lambda: dd.rope_absorb(**a))
    for name in ("q_pe", "k_pe", "positions", "cos_sin", "weight", "out", "k_pe_out"):
        bad = dict(a, **{name: np.zeros(a[name].shape, np.float64)})  # a dtype DLPack's conversion refuses
        raises_naming(name, lambda: dd.rope_absorb(**bad))
    raises_naming("error_count", lambda: dd.rope_absorb(**a, error_count=np.zeros(1, np.int32)))
    with pytest.raises(TypeError, match="argument 'stream'"):
        dd.rope_absorb(**a, stream=1.5)


def test_read_only_and_strided_arrays_are_refused_or_passed_on():
    a = v32_args()
    q = np.zeros((1, 16, 576), F32)
    q.setflags(write=False)
    with pytest.raises((dd.InvalidArgument, TypeError, ValueError, BufferError)):
        dd.sparse_mla_v32(**dict(a, q=q))
    # A negative stride is refused by the conversion, naming the argument.
    rev = np.zeros((2, 8), np.int32)[::-1]
    raises_naming("indices", lambda: dd.sparse_mla_v32(**dict(a, q=np.zeros((2, 16, 576), F32), indices=rev)))
