"""dsa_decode.load_layer_weights (the Python reader of a Hugging Face
checkpoint's layer) on small checkpoints written here: the values against
the source arrays (FP8 blocks against a NumPy dequantization written here),
the TP split of every rank, the directory / index / file-list forms, every
error named, and the same bits as the C++ loader of `dsa-decode --weights`
(bound as dd._C.checkpoint_layer_weights). CPU only."""

import json
import os
from dataclasses import asdict

import numpy as np
import pytest

import dsa_decode as dd
from hf_configs import DSV32

LAYER = 3
# Scaled down, and off the 128 grid so that block scales and TP slices cut blocks.
D, Q, L, P, V, TP = 200, 136, 64, 40, 24, 3
H = 2  # per rank; the checkpoint holds H * TP
HEADS = H * TP
HI, S = 16, 4


def config(tp=TP):
    return dd.LayerConfig(
        hidden_size=D,
        num_heads=HEADS // tp,
        q_lora_rank=Q,
        kv_lora_rank=L,
        qk_nope_head_dim=P,
        qk_rope_head_dim=0,
        v_head_dim=V,
        softmax_scale=P**-0.5,
        rms_norm_eps=1e-6,
    )


PLAN = dd.StagePlan(indexer_heads=HI, indexer_pool=S)


# ---- writing checkpoints (the test's own writer) ----


def bf16_round(x):
    """float -> BF16 bits, round to nearest even (NaN: 0x7FFF)."""
    x = np.asarray(x, dtype=np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    out = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    out[np.isnan(x)] = 0x7FFF
    return out


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def e4m3_value(code):
    """An e4m3fn code's value from the format's definition, in float64."""
    code = int(code)
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 15 and mantissa == 7:
        return float("nan")
    if exponent == 0:
        return sign * 2.0**-6 * mantissa / 8
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


E4M3 = np.array([e4m3_value(c) for c in range(256)])


def numpy_dequantize(codes, scales):
    """bf16(e4m3 * scale_inv of the 128 x 128 block), the product in FP32."""
    rows, cols = codes.shape
    block_scale = np.repeat(np.repeat(scales, 128, axis=0), 128, axis=1)[:rows, :cols]
    return bf16_round(E4M3[codes].astype(np.float32) * block_scale.astype(np.float32))


def write_safetensors(path, tensors, pad=True):
    """tensors: [(name, dtype, array)], array raw (BF16 as uint16, F8 as uint8)."""
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, dtype, array in tensors:
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def name(suffix, layer=LAYER):
    return f"model.layers.{layer}.self_attn.{suffix}"


PROJECTIONS = {
    "q_a_proj.weight": (Q, D),
    "q_b_proj.weight": (HEADS * P, Q),
    "kv_a_proj_with_mqa.weight": (L, D),
    "kv_b_proj.weight": (HEADS * (P + V), L),
    "o_proj.weight": (D, HEADS * V),
    "indexer.wq_b.weight": (HI * 128, Q),
    "indexer.wk.weight": (128, D),
    "indexer.weights_proj.weight": (HI, D),
    "indexer.index_kpool_compress_gate": (128, D),
}
VECTORS = {
    "q_a_layernorm.weight": (Q,),
    "kv_a_layernorm.weight": (L,),
    "indexer.k_norm.weight": (128,),
    "indexer.k_norm.bias": (128,),
    "indexer.index_kpool_compress_ape": (S, 128),
}


def make_layer(seed, fp8, layer=LAYER):
    """The layer's tensors [(name, dtype, raw)] and each one's BF16 (or, for
    the FP32 ones, float32) value as the loader should give it."""
    rng = np.random.default_rng(seed)
    tensors, values = [], {}
    for suffix, shape in PROJECTIONS.items():
        if fp8:
            codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
            scales = (2.0 ** rng.uniform(-14, 3, size=(-(-shape[0] // 128), -(-shape[1] // 128)))).astype(np.float32)
            tensors += [(name(suffix, layer), "F8_E4M3", codes), (name(suffix, layer) + "_scale_inv", "F32", scales)]
            values[suffix] = numpy_dequantize(codes, scales)
        else:
            bits = bf16_round(rng.standard_normal(shape) * 0.5)
            tensors.append((name(suffix, layer), "BF16", bits))
            values[suffix] = bits
    for suffix, shape in VECTORS.items():
        bits = bf16_round(rng.standard_normal(shape) + 1)
        tensors.append((name(suffix, layer), "BF16", bits))
        values[suffix] = bf16_value(bits) if suffix.startswith("indexer.") else bits
    return tensors, values


def expected_rank(values, tp, rank):
    """The stage's weights of rank `rank` of `tp`, from the source values, by hand."""
    h = HEADS // tp
    kv_b = values["kv_b_proj.weight"]
    w_uk_t = np.zeros((h, P, L), np.uint16)
    w_uv = np.zeros((h, L, V), np.uint16)
    for local in range(h):
        head = rank * h + local
        rows = kv_b[head * (P + V) : (head + 1) * (P + V)]
        w_uk_t[local] = rows[:P]
        for v in range(V):
            w_uv[local, :, v] = rows[P + v]
    return {
        "fused_qkv_a_proj": np.vstack([values["q_a_proj.weight"], values["kv_a_proj_with_mqa.weight"]]),
        "q_a_norm": values["q_a_layernorm.weight"],
        "kv_a_norm": values["kv_a_layernorm.weight"],
        "q_b_proj": values["q_b_proj.weight"][rank * h * P : (rank + 1) * h * P],
        "w_uk_t": w_uk_t,
        "w_uv": w_uv,
        "o_proj": values["o_proj.weight"][:, rank * h * V : (rank + 1) * h * V],
        "q_scale": np.array([6.0 / 448.0], np.float32),
        "k_scale": np.array([6.0 / 448.0], np.float32),
        "index_wq_b": values["indexer.wq_b.weight"],
        "index_wk": values["indexer.wk.weight"],
        "index_weights_proj": values["indexer.weights_proj.weight"],
        "index_compress_gate": values["indexer.index_kpool_compress_gate"],
        "index_k_norm_weight": values["indexer.k_norm.weight"],
        "index_k_norm_bias": values["indexer.k_norm.bias"],
        "index_ape": values["indexer.index_kpool_compress_ape"],
    }


def assert_same_bits(got, want, what=""):
    assert sorted(got) == sorted(dd.WEIGHT_NAMES)
    for key in dd.WEIGHT_NAMES:
        g, w = got[key], np.asarray(want[key])
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}{key}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        assert g.tobytes() == w.tobytes(), f"{what}{key}: values differ"


def write_sharded(directory, tensors):
    """Two shards (the indexer apart) and model.safetensors.index.json."""
    os.makedirs(directory, exist_ok=True)
    shards = {"model-00001-of-00002.safetensors": [], "model-00002-of-00002.safetensors": []}
    weight_map = {}
    for t in tensors:
        file = "model-00002-of-00002.safetensors" if ".indexer." in t[0] else "model-00001-of-00002.safetensors"
        shards[file].append(t)
        weight_map[t[0]] = file
    for file, part in shards.items():
        write_safetensors(os.path.join(directory, file), part)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(directory)


@pytest.fixture
def bf16_file(tmp_path):
    tensors, values = make_layer(1, fp8=False)
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors)
    return str(path), tensors, values


@pytest.fixture
def fp8_directory(tmp_path):
    tensors, values = make_layer(2, fp8=True)
    return write_sharded(tmp_path / "fp8", tensors), tensors, values


# ---- values ----


def test_bf16_file_loads_the_source_values_at_tp1(bf16_file):
    path, _, values = bf16_file
    lw = dd.load_layer_weights(path, LAYER, config(1), PLAN)
    assert_same_bits(lw.weights, expected_rank(values, 1, 0))
    assert (lw.tp, lw.rank, lw.layer, lw.tensors, lw.fp8_tensors) == (1, 0, LAYER, 14, 0)
    assert lw.files == [path] and lw.bytes > 0 and lw.seconds > 0
    assert lw.config.num_heads == HEADS and lw.config.rms_norm_eps == 1e-6 and lw.eps_source == "the LayerConfig's"
    assert lw.plan is PLAN


@pytest.mark.parametrize("rank", range(TP))
def test_fp8_blocks_dequantize_as_numpy_and_split_per_rank(fp8_directory, rank):
    directory, _, values = fp8_directory
    lw = dd.load_layer_weights(directory, LAYER, config(), PLAN, tp=TP, rank=rank)
    assert_same_bits(lw.weights, expected_rank(values, TP, rank), f"rank {rank}: ")
    assert (lw.tensors, lw.fp8_tensors, len(lw.files)) == (14, 9, 2)


def test_the_ranks_partition_the_heads(fp8_directory):
    directory, _, _ = fp8_directory
    whole = dd.load_layer_weights(directory, LAYER, config(1), PLAN).weights
    ranks = [dd.load_layer_weights(directory, LAYER, config(), PLAN, tp=TP, rank=r).weights for r in range(TP)]
    assert np.array_equal(np.vstack([w["q_b_proj"] for w in ranks]), whole["q_b_proj"])
    assert np.array_equal(np.hstack([w["o_proj"] for w in ranks]), whole["o_proj"])
    assert np.array_equal(np.concatenate([w["w_uk_t"] for w in ranks]), whole["w_uk_t"])
    assert np.array_equal(np.concatenate([w["w_uv"] for w in ranks]), whole["w_uv"])
    for key in ("fused_qkv_a_proj", "index_wq_b", "index_ape"):
        assert all(np.array_equal(w[key], whole[key]) for w in ranks)


def test_special_codes_and_f32_tensors(tmp_path):
    """NaN codes give BF16's canonical NaN, -0 stays -0, subnormal codes and
    products are exact as FP32 then rounded; F32 weights the stage takes in
    BF16 round to nearest even, F32 ones it takes in F32 are kept."""
    tensors, values = make_layer(3, fp8=True)
    entries = {t[0]: t for t in tensors}
    codes = entries[name("q_a_proj.weight")][2]
    codes[0, :8] = [0x7F, 0xFF, 0x80, 0x00, 0x01, 0x81, 0x07, 0x7E]
    scales = entries[name("q_a_proj.weight") + "_scale_inv"][2]
    scales[0, 0] = np.float32(2.0**-120)  # products deep in FP32's subnormals, then to BF16
    values["q_a_proj.weight"] = numpy_dequantize(codes, scales)
    assert list(values["q_a_proj.weight"][0, :4]) == [0x7FFF, 0x7FFF, 0x8000, 0x0000]
    norm = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-9, np.nan] * (Q // 4), np.float32)
    entries[name("q_a_layernorm.weight")] = (name("q_a_layernorm.weight"), "F32", norm)
    ape = np.random.default_rng(5).standard_normal((S, 128)).astype(np.float32)
    entries[name("indexer.index_kpool_compress_ape")] = (name("indexer.index_kpool_compress_ape"), "F32", ape)
    values["q_a_layernorm.weight"] = np.array([0x3F80, 0x3F82, 0x3F80, 0x7FFF] * (Q // 4), np.uint16)
    values["indexer.index_kpool_compress_ape"] = ape
    path = tmp_path / "one.safetensors"
    write_safetensors(path, list(entries.values()), pad=False)  # unaligned data: read all the same
    lw = dd.load_layer_weights([path], LAYER, config(1), PLAN)
    assert_same_bits(lw.weights, expected_rank(values, 1, 0))


def test_a_preset_name_and_config_json(tmp_path):
    """config.json beside the files gives rms_norm_eps and the indexer's shape."""
    tensors, values = make_layer(4, fp8=False)
    write_safetensors(tmp_path / "a.safetensors", tensors[:7])
    write_safetensors(tmp_path / "b.safetensors", tensors[7:])  # no index: every file of the directory
    (tmp_path / "config.json").write_text(
        json.dumps({"rms_norm_eps": 3e-6, "index_n_heads": HI, "index_kpool": S, "index_topk": 1024, "index_head_dim": 128})
    )
    lw = dd.load_layer_weights(tmp_path, LAYER, config(1))
    assert lw.config.rms_norm_eps == 3e-6 and lw.eps_source == "config.json's rms_norm_eps"
    assert (lw.plan.indexer_heads, lw.plan.indexer_pool, lw.plan.indexer_topk) == (HI, S, 1024)
    assert_same_bits(lw.weights, expected_rank(values, 1, 0))
    # A preset: its shapes, which these tensors do not have (named, with the preset's).
    with pytest.raises(dd.InvalidArgument, match=r"q_b_proj.weight: shape \[240, 136\], expected \[16384, 1536\]"):
        dd.load_layer_weights(tmp_path, LAYER, "glm5next")
    # A RoPE preset with this config.json's pooled indexer: the plan is named.
    with pytest.raises(dd.InvalidArgument, match=r"argument 'plan': expected indexer_pool 1 for a RoPE layer"):
        dd.load_layer_weights(tmp_path, LAYER, "dsv32")


def test_q_scale_and_k_scale_are_the_callers(bf16_file):
    path, _, _ = bf16_file
    w = dd.load_layer_weights(path, LAYER, config(1), PLAN, q_scale=0.25, k_scale=0.5).weights
    assert w["q_scale"].tolist() == [0.25] and w["k_scale"].tolist() == [0.5]
    assert w["q_scale"].dtype == np.float32
    with pytest.raises(dd.InvalidArgument, match=r"argument 'k_scale': expected a finite scale > 0 or None, got -1"):
        dd.load_layer_weights(path, LAYER, config(1), PLAN, k_scale=-1.0)


# ---- RoPE layers (the Python loader only: the C++ loader takes NoPE layers) ----

R = 16  # rope dims of the scaled-down RoPE layer


def rope_config(tp=TP):
    return dd.LayerConfig(
        hidden_size=D,
        num_heads=HEADS // tp,
        q_lora_rank=Q,
        kv_lora_rank=L,
        qk_nope_head_dim=P,
        qk_rope_head_dim=R,
        v_head_dim=V,
        softmax_scale=(P + R) ** -0.5,
        rms_norm_eps=1e-6,
        rotary_embedding=True,
        kv_cache_dtype="fp8_ds_mla",
        rope=dd.RopeConfig(rope_dim=R),
        indexer_rope=dd.RopeConfig(rope_dim=R, style="half-split"),
    )


ROPE_PLAN = dd.StagePlan(indexer_heads=HI, indexer_pool=1, ring=1, block_size=64)


def make_rope_layer(seed, fp8):
    """A RoPE layer's tensors: q_b_proj with P + R rows a head, kv_a_proj_with_mqa
    with k_pe's R rows, no pool gate or positional term."""
    rng = np.random.default_rng(seed)
    shapes = dict(PROJECTIONS, **{"q_b_proj.weight": (HEADS * (P + R), Q), "kv_a_proj_with_mqa.weight": (L + R, D)})
    del shapes["indexer.index_kpool_compress_gate"]
    vectors = {k: v for k, v in VECTORS.items() if k != "indexer.index_kpool_compress_ape"}
    tensors, values = [], {}
    for suffix, shape in shapes.items():
        if fp8:
            codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
            scales = (2.0 ** rng.uniform(-10, 0, size=(-(-shape[0] // 128), -(-shape[1] // 128)))).astype(np.float32)
            tensors += [(name(suffix), "F8_E4M3", codes), (name(suffix) + "_scale_inv", "F32", scales)]
            values[suffix] = numpy_dequantize(codes, scales)
        else:
            bits = bf16_round(rng.standard_normal(shape) * 0.5)
            tensors.append((name(suffix), "BF16", bits))
            values[suffix] = bits
    for suffix, shape in vectors.items():
        if suffix.startswith("indexer."):
            floats = (rng.standard_normal(shape) + 1).astype(np.float32)
            tensors.append((name(suffix), "F32", floats))  # V3.2's LayerNorm parameters: F32
            values[suffix] = floats
        else:
            bits = bf16_round(rng.standard_normal(shape) + 1)
            tensors.append((name(suffix), "BF16", bits))
            values[suffix] = bits
    return tensors, values


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rank", [0, TP - 1])
def test_a_rope_layer_loads_with_its_rope_rows_and_no_pool_tensors(tmp_path, fp8, rank):
    tensors, values = make_rope_layer(9, fp8)
    write_safetensors(tmp_path / "rope.safetensors", tensors)
    lw = dd.load_layer_weights(tmp_path / "rope.safetensors", LAYER, rope_config(), ROPE_PLAN, tp=TP, rank=rank)
    w = lw.weights
    assert sorted(w) == sorted(set(dd.WEIGHT_NAMES) - set(dd.stage.ROPE_UNREAD_WEIGHTS))
    absent = {"indexer.index_kpool_compress_gate": None, "indexer.index_kpool_compress_ape": None}
    want = expected_rank(dict(values, **absent), TP, rank)  # the parts a RoPE layer shares with NoPE
    h = HEADS // TP
    assert w["fused_qkv_a_proj"].shape == (Q + L + R, D)
    assert np.array_equal(w["fused_qkv_a_proj"], np.vstack([values["q_a_proj.weight"], values["kv_a_proj_with_mqa.weight"]]))
    assert w["q_b_proj"].shape == (h * (P + R), Q)
    assert np.array_equal(w["q_b_proj"], values["q_b_proj.weight"][rank * h * (P + R) : (rank + 1) * h * (P + R)])
    for key in ("w_uk_t", "w_uv", "o_proj", "index_wq_b", "index_wk", "index_weights_proj"):
        assert np.array_equal(w[key], want[key]), key
    assert w["index_k_norm_weight"].dtype == np.float32
    assert np.array_equal(w["index_k_norm_weight"], values["indexer.k_norm.weight"])
    assert lw.fp8_tensors == (8 if fp8 else 0)


def test_a_rope_layers_arguments_and_missing_tensors_are_named(tmp_path):
    tensors, _ = make_rope_layer(10, fp8=False)
    short = [t for t in tensors if not t[0].endswith("kv_a_proj_with_mqa.weight")]
    short.append((name("kv_a_proj_with_mqa.weight"), "BF16", np.zeros((L, D), np.uint16)))  # NoPE's rows
    write_safetensors(tmp_path / "rope.safetensors", short)
    with pytest.raises(dd.InvalidArgument) as error:
        dd.load_layer_weights(tmp_path, LAYER, rope_config(1), ROPE_PLAN)
    message = str(error.value)
    assert "R=16" in message and f"kv_a_proj_with_mqa.weight: shape [{L}, {D}], expected [{L + R}, {D}]" in message
    with pytest.raises(dd.InvalidArgument, match=r"argument 'q_scale': expected None for a RoPE layer"):
        dd.load_layer_weights(tmp_path, LAYER, rope_config(1), ROPE_PLAN, q_scale=0.1)
    with pytest.raises(dd.InvalidArgument, match=r"argument 'plan': expected indexer_pool 1 for a RoPE layer"):
        dd.load_layer_weights(tmp_path, LAYER, rope_config(1), PLAN)


def test_a_rope_preset_and_its_config_json(tmp_path):
    """"dsv32" with a DeepSeek-V3.2 config.json beside the files: the plan is
    the unpooled indexer's, the shapes the preset's (named, as these small
    tensors are not)."""
    tensors, _ = make_rope_layer(11, fp8=False)
    write_safetensors(tmp_path / "rope.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps(dict(DSV32, rms_norm_eps=2e-6)))
    with pytest.raises(dd.InvalidArgument) as error:
        dd.load_layer_weights(tmp_path, LAYER, "dsv32", tp=8)
    message = str(error.value)
    assert "R=64" in message and "indexer 64 heads, pools of 1" in message, message
    assert "q_b_proj.weight: shape" in message and "expected [24576, 1536]" in message, message  # 128 x 192 rows
    assert "index_kpool_compress" not in message, message


# ---- the C++ loader's bits ----


def cpp_shape(c, tp, plan):
    shape = {k: v for k, v in asdict(c).items() if isinstance(v, int) and not isinstance(v, bool)}
    shape.update(tp=tp, indexer_heads=plan.indexer_heads, indexer_pool=plan.indexer_pool, indexer_topk=plan.indexer_topk)
    return shape


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tp", [1, TP])
def test_the_cpp_loader_gives_the_same_bits(tmp_path, fp8, tp):
    tensors, values = make_layer(6 + fp8, fp8=fp8)
    # Special codes and a subnormal block scale, which the C++ writer never makes.
    if fp8:
        entries = {t[0]: t for t in tensors}
        entries[name("o_proj.weight")][2][:2, :8] = [0x7F, 0xFF, 0x80, 0x00, 0x01, 0x81, 0x07, 0x7E]
        entries[name("o_proj.weight") + "_scale_inv"][2][0, 0] = np.float32(2.0**-130)
    directory = write_sharded(tmp_path / "c", tensors)
    (tmp_path / "c" / "config.json").write_text(json.dumps({"rms_norm_eps": 2e-6}))
    lw = dd.load_layer_weights(directory, LAYER, config(tp), PLAN, tp=tp)
    cpp = dd._C.checkpoint_layer_weights([directory], LAYER, cpp_shape(config(tp), tp, PLAN))
    assert_same_bits(lw.weights, {k: cpp[k] for k in dd.WEIGHT_NAMES})
    assert np.float32(lw.config.rms_norm_eps) == np.float32(cpp["eps"])
    assert (lw.tensors, lw.fp8_tensors, lw.bytes, len(lw.files)) == (
        cpp["tensors"], cpp["fp8_tensors"], cpp["bytes"], cpp["files"])


def test_the_cpp_loader_names_the_same_problems(fp8_directory, tmp_path):
    _, tensors, _ = fp8_directory
    broken = [t for t in tensors if t[0] not in (name("o_proj.weight"), name("kv_b_proj.weight") + "_scale_inv")]
    broken = [
        (n, "I32", np.zeros((128,), np.int32)) if n == name("indexer.k_norm.bias") else (n, d, a) for n, d, a in broken
    ]
    broken = [(n, d, a[:-1]) if n == name("q_a_layernorm.weight") else (n, d, a) for n, d, a in broken]
    directory = write_sharded(tmp_path / "broken", broken)
    with pytest.raises(dd.InvalidArgument) as python_error:
        dd.load_layer_weights(directory, LAYER, config(), PLAN, tp=TP)
    with pytest.raises(dd.InvalidArgument) as cpp_error:
        dd._C.checkpoint_layer_weights([directory], LAYER, cpp_shape(config(), TP, PLAN))
    lines = [line.strip() for line in str(python_error.value).splitlines()[1:-1]]
    assert len(lines) == 4, str(python_error.value)
    for line in lines:
        assert line in str(cpp_error.value), line
    assert "4 tensor problems" in str(python_error.value)


# ---- errors ----


def load_error(path, **kwargs):
    with pytest.raises(dd.InvalidArgument) as error:
        dd.load_layer_weights(path, LAYER, kwargs.pop("config", config()), PLAN, tp=kwargs.pop("tp", TP), **kwargs)
    return str(error.value)


def test_every_missing_tensor_is_named_with_the_layers_present(fp8_directory, tmp_path):
    _, tensors, _ = fp8_directory
    kept = [t for t in tensors if "indexer.wk." not in t[0] and "kv_a_layernorm" not in t[0]]
    message = load_error(write_sharded(tmp_path / "m", kept))
    assert "2 tensor problems" in message
    assert f"{name('indexer.wk.weight')}: missing (expected [128, {D}])" in message
    assert f"{name('kv_a_layernorm.weight')}: missing (expected [{L}])" in message
    assert message.endswith("(layers with attention tensors in the checkpoint: 3)")
    with pytest.raises(dd.InvalidArgument) as error:
        dd.load_layer_weights(write_sharded(tmp_path / "all", tensors), 5, config(), PLAN, tp=TP)
    assert "14 tensor problems" in str(error.value) and f"{name('q_a_proj.weight', 5)}: missing" in str(error.value)
    assert str(error.value).endswith("(layers with attention tensors in the checkpoint: 3)")


def replaced(tensors, suffix, dtype, array):
    return [(n, dtype, array) if n == name(suffix) else (n, d, a) for n, d, a in tensors]


def test_wrong_shapes_dtypes_and_block_scales_are_named(fp8_directory, tmp_path):
    _, tensors, _ = fp8_directory
    bad = replaced(tensors, "q_b_proj.weight", "F8_E4M3", np.zeros((HEADS * P, Q + 8), np.uint8))
    bad = replaced(bad, "indexer.k_norm.weight", "F8_E4M3", np.zeros((128,), np.uint8))  # FP8 only for projections
    bad = replaced(bad, "indexer.k_norm.bias", "F16", np.zeros((128,), np.float16))
    bad = replaced(bad, "kv_a_proj_with_mqa.weight_scale_inv", "F32", np.ones((1, 1), np.float32))
    bad = replaced(bad, "indexer.wk.weight_scale_inv", "BF16", np.ones((1, 2), np.uint16))
    bad = [t for t in bad if t[0] != name("o_proj.weight_scale_inv")]
    message = load_error(write_sharded(tmp_path / "bad", bad))
    assert "6 tensor problems" in message, message
    for line in (
        f"{name('q_b_proj.weight')}: shape [{HEADS * P}, {Q + 8}], expected [{HEADS * P}, {Q}]",
        f"{name('indexer.k_norm.weight')}: dtype F8_E4M3, expected BF16, F32\n",
        f"{name('indexer.k_norm.bias')}: dtype F16, expected BF16, F32\n",
        f"{name('kv_a_proj_with_mqa.weight_scale_inv')}: F32 [1, 1], expected F32 [1, 2] (the 128 x 128 block "
        f"scales of {name('kv_a_proj_with_mqa.weight')})",
        f"{name('indexer.wk.weight_scale_inv')}: BF16 [1, 2], expected F32 [1, 2]",
        f"{name('o_proj.weight_scale_inv')}: missing (the F32 [2, 2] block scales of F8_E4M3 {name('o_proj.weight')})",
    ):
        assert line in message + "\n", line
    # The whole model's heads: a config of other heads per rank names the shapes it expects.
    message = load_error(write_sharded(tmp_path / "good", tensors), tp=1)
    assert f"q_b_proj.weight: shape [{HEADS * P}, {Q}], expected [{H * P}, {Q}]" in message
    assert "the whole model's 2 heads" in message


def test_bad_headers_and_truncated_files_are_named(bf16_file, tmp_path):
    path, tensors, _ = bf16_file
    data = open(path, "rb").read()
    cases = {
        "short": (data[:5], "bad header (shorter than its 8-byte length)"),
        "length": ((10**9).to_bytes(8, "little") + data[8:], "bad header (length 1000000000 bytes, the file has"),
        "json": (data[:8] + b"!" + data[9:], "bad header (JSON:"),
        "array": ((2).to_bytes(8, "little") + b"[]", "bad header (not a JSON object)"),
        "truncated": (data[:-100], "runs past the end of the file's"),
    }
    for case, (content, expected) in cases.items():
        broken = tmp_path / f"{case}.safetensors"
        broken.write_bytes(content)
        message = load_error(str(broken), config=config(1), tp=1)
        assert f"checkpoint file {broken}: " in message and expected in message, (case, message)
    truncated = load_error(str(tmp_path / "truncated.safetensors"), config=config(1), tp=1)
    assert f"{name('indexer.index_kpool_compress_ape')}: data [" in truncated and "(truncated file)" in truncated
    # Entries that do not describe their bytes; every file's problems in one message.
    entry = tmp_path / "entry.safetensors"
    write_safetensors(entry, [("x", "BF16", np.zeros((4, 4), np.uint16)), ("y", "F32", np.zeros(3, np.float32))])
    raw = bytearray(entry.read_bytes())
    header = raw[8 : 8 + int.from_bytes(raw[:8], "little")].decode()
    header = header.replace('"shape": [4, 4]', '"shape": [4, 5]').replace('"dtype": "F32"', '"dtype": 7   ')
    entry.write_bytes(raw[:8] + header.encode() + raw[8 + len(header) :])
    message = load_error([str(entry), str(tmp_path / "json.safetensors")], config=config(1), tp=1)
    assert "3 bad headers or tensor entries" in message
    assert "x: data_offsets span 32 bytes, but BF16 [4, 5] is 40 bytes" in message
    assert "y: bad header entry" in message and "json.safetensors: bad header (JSON:" in message
    # The same tensor in two files.
    message = load_error([path, path], config=config(1), tp=1)
    assert f"{name('q_a_proj.weight')}: in two files, {path} and {path}" in message


def test_paths_and_indexes_are_checked(fp8_directory, tmp_path):
    directory, tensors, values = fp8_directory
    # The index opens only the files of the layer's tensors: a broken shard of other tensors is not read.
    (tmp_path / "fp8" / "model-00003-of-00003.safetensors").write_bytes(b"not safetensors")
    index_path = tmp_path / "fp8" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.4.mlp.gate.weight"] = "model-00003-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    assert_same_bits(dd.load_layer_weights(directory, LAYER, config(), PLAN, tp=TP).weights, expected_rank(values, TP, 0))
    index["weight_map"][name("o_proj.weight")] = "gone.safetensors"
    index["weight_map"][name("q_b_proj.weight")] = "../escape.safetensors"
    index_path.write_text(json.dumps(index))
    message = load_error(directory)
    assert "model.safetensors.index.json: 2 tensors not readable" in message
    assert f"{name('o_proj.weight')}: in gone.safetensors, which is not in {directory}" in message
    assert f"{name('q_b_proj.weight')}: the weight_map names no file in the directory" in message
    index_path.write_text("{}")
    assert 'no "weight_map" object' in load_error(directory)
    index_path.write_text("{")
    assert "model.safetensors.index.json: bad JSON" in load_error(directory)
    (tmp_path / "empty").mkdir()
    assert "holds neither model.safetensors.index.json nor any .safetensors file" in load_error(str(tmp_path / "empty"))
    assert "is a directory; give one directory or a list of files" in load_error([directory, directory])
    assert "(no such file)" in load_error(str(tmp_path / "nothing.safetensors"))
    assert "expected a directory or safetensors files, got none" in load_error([])


def test_arguments_are_checked(bf16_file):
    path, _, _ = bf16_file
    for kwargs, expected in (
        (dict(rank=3), r"argument 'rank': expected an int in \[0, 3\) \(tp = 3\), got 3"),
        (dict(tp=0), r"argument 'tp': expected an int >= 1, got 0"),
        (dict(config=7), r"argument 'config': expected a preset name or a LayerConfig, got int"),
    ):
        with pytest.raises(dd.InvalidArgument, match=expected):
            dd.load_layer_weights(path, LAYER, kwargs.pop("config", config()), PLAN, tp=kwargs.pop("tp", TP), **kwargs)
    with pytest.raises(dd.InvalidArgument, match=r"argument 'layer': expected an int >= 0, got -1"):
        dd.load_layer_weights(path, -1, config(), PLAN, tp=TP)
    with pytest.raises(dd.InvalidArgument, match=r"argument 'plan': expected a StagePlan or None, got dict"):
        dd.load_layer_weights(path, LAYER, config(), {}, tp=TP)


def test_torch_tensors_on_a_device():
    torch = pytest.importorskip("torch", reason="device= needs PyTorch, not installed here")
    tensors, values = make_layer(8, fp8=True)
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        write_safetensors(os.path.join(directory, "m.safetensors"), tensors)
        lw = dd.load_layer_weights(directory, LAYER, config(), PLAN, tp=TP, rank=1, device="cpu")
    want = expected_rank(values, TP, 1)
    for key, t in lw.weights.items():
        assert t.dtype == (torch.bfloat16 if want[key].dtype == np.uint16 else torch.float32)
        host = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
        assert np.array_equal(host, want[key], equal_nan=True) or host.tobytes() == want[key].tobytes(), key
