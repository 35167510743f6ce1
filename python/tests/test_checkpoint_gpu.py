"""Stage.from_checkpoint on the GPU: a whole-model glm5next layer written as a
Hugging Face checkpoint (BF16 one file; FP8 128 x 128 blocks, two shards and
an index), loaded at TP8 on rank 5, runs the same bits (out, the KV cache,
the indexer's ring and pools) as the stage built directly from the source
arrays, split and dequantized here. Skips without PyTorch or a Hopper GPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests drive the package through PyTorch, not installed here")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the package's GPU tests skip", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the kernels are built for sm_90a (H100/H200) only", allow_module_level=True)

import dsa_decode as dd  # noqa: E402
from test_checkpoint import bf16_round, name, numpy_dequantize, write_safetensors, write_sharded  # noqa: E402
from test_gpu import caches_of, restore, stage_step  # noqa: E402

DEVICE = "cuda"
LAYER, TP, RANK = 3, 8, 5


def fp8_blocks(bits, rng):
    """BF16 values [rows, cols] as e4m3 codes and F32 128 x 128 block scales (amax / 448, varied)."""
    values = torch.from_numpy((bits.astype(np.uint32) << 16).view(np.float32))
    rows, cols = values.shape
    blocks = torch.nn.functional.pad(values.abs(), (0, -cols % 128, 0, -rows % 128))
    amax = blocks.view(blocks.shape[0] // 128, 128, blocks.shape[1] // 128, 128).amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    scales *= torch.from_numpy(rng.uniform(1.0, 1.5, size=scales.shape).astype(np.float32))  # not all at full range
    expanded = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    codes = (values / expanded).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return codes, scales.numpy()


def whole_layer(c, fp8, seed):
    """The checkpoint's tensors and the stage's rank-RANK weights from the same values, by hand."""
    rng = np.random.default_rng(seed)
    D, H, Q, L, P, V = (c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim)
    heads, HI, S = H * TP, 32, 4
    projections = {
        "q_a_proj.weight": (Q, D),
        "q_b_proj.weight": (heads * P, Q),
        "kv_a_proj_with_mqa.weight": (L, D),
        "kv_b_proj.weight": (heads * (P + V), L),
        "o_proj.weight": (D, heads * V),
        "indexer.wq_b.weight": (HI * 128, Q),
        "indexer.wk.weight": (128, D),
        "indexer.weights_proj.weight": (HI, D),
        "indexer.index_kpool_compress_gate": (128, D),
    }
    tensors, v = [], {}
    for suffix, shape in projections.items():
        bits = bf16_round(rng.standard_normal(shape, dtype=np.float32) * shape[1] ** -0.5)
        if fp8:
            codes, scales = fp8_blocks(bits, rng)
            tensors += [(name(suffix), "F8_E4M3", codes), (name(suffix) + "_scale_inv", "F32", scales)]
            v[suffix] = numpy_dequantize(codes, scales)
        else:
            tensors.append((name(suffix), "BF16", bits))
            v[suffix] = bits
    for suffix, shape, scale, shift in (
        ("q_a_layernorm.weight", (Q,), 0.1, 1),
        ("kv_a_layernorm.weight", (L,), 0.1, 1),
        ("indexer.k_norm.weight", (128,), 0.1, 1),
        ("indexer.k_norm.bias", (128,), 0.1, 0),
        ("indexer.index_kpool_compress_ape", (S, 128), 0.1, 0),
    ):
        bits = bf16_round(rng.standard_normal(shape, dtype=np.float32) * scale + shift)
        tensors.append((name(suffix), "BF16", bits))
        v[suffix] = bits
    kv_b = v["kv_b_proj.weight"][RANK * H * (P + V) : (RANK + 1) * H * (P + V)].reshape(H, P + V, L)
    f32 = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    direct = {
        "fused_qkv_a_proj": np.vstack([v["q_a_proj.weight"], v["kv_a_proj_with_mqa.weight"]]),
        "q_a_norm": v["q_a_layernorm.weight"],
        "kv_a_norm": v["kv_a_layernorm.weight"],
        "q_b_proj": v["q_b_proj.weight"][RANK * H * P : (RANK + 1) * H * P],
        "w_uk_t": kv_b[:, :P, :],
        "w_uv": kv_b[:, P:, :].transpose(0, 2, 1),
        "o_proj": v["o_proj.weight"][:, RANK * H * V : (RANK + 1) * H * V],
        "q_scale": np.array([6.0 / 448.0], np.float32),
        "k_scale": np.array([6.0 / 448.0], np.float32),
        "index_wq_b": v["indexer.wq_b.weight"],
        "index_wk": v["indexer.wk.weight"],
        "index_weights_proj": v["indexer.weights_proj.weight"],
        "index_compress_gate": v["indexer.index_kpool_compress_gate"],
        "index_k_norm_weight": f32(v["indexer.k_norm.weight"]),
        "index_k_norm_bias": f32(v["indexer.k_norm.bias"]),
        "index_ape": f32(v["indexer.index_kpool_compress_ape"]),
    }
    return tensors, {k: np.ascontiguousarray(a) for k, a in direct.items()}


def on_device(arrays):
    out = {}
    for k, a in arrays.items():
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == np.uint16 else torch.from_numpy(a)
        out[k] = t.to(DEVICE)
    return out


@pytest.mark.parametrize("fp8", [False, True])
def test_stage_from_a_checkpoint_runs_the_bits_of_the_stage_from_its_arrays(tmp_path, fp8):
    c = dd.layer_config("glm5next", tp=TP)
    tensors, direct = whole_layer(c, fp8, seed=17 + fp8)
    if fp8:
        path = write_sharded(tmp_path / "fp8", tensors)
    else:
        path = str(tmp_path / "model.safetensors")
        write_safetensors(path, tensors)
    plan = dd.StagePlan(max_tokens=4, max_context=8192)
    # The loader's arrays are the hand-made ones, bit for bit, at full size.
    loaded = dd.load_layer_weights(path, LAYER, "glm5next", plan, tp=TP, rank=RANK)
    for key in dd.WEIGHT_NAMES:
        assert loaded.weights[key].tobytes() == direct[key].tobytes(), key
    weights = on_device(direct)
    reference = dd.Stage(c, weights, plan)
    stage = dd.Stage.from_checkpoint(path, LAYER, "glm5next", plan, tp=TP, rank=RANK)
    assert stage.checkpoint.fp8_tensors == (9 if fp8 else 0) and stage.config == c
    generator = torch.Generator(device=DEVICE).manual_seed(5)
    args = stage_step(reference, c, weights, generator, m=4)
    initial = [t.clone() for t in caches_of(args)]
    for path_name in ("forward", "stock_forward"):
        results = []
        for s in (reference, stage):
            restore(args, initial)
            args.out.zero_()
            getattr(s, path_name)(args)
            torch.cuda.synchronize()
            results.append([args.out.clone()] + [t.clone() for t in caches_of(args)])
        assert int(args.error_count.item()) == 0
        assert bool(results[0][0].abs().float().sum() > 0), "the step wrote nothing"
        for what, a, b in zip(("out", "kv_cache", "ring", "k_cache"), *results):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{path_name}: {what} differs"
