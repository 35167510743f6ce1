"""CPU tests of the dsv32 rows' harness (bench/peers/v32.py) with stand-ins for the GPU parts:
our ops (a float32 torch attention over the same bytes), FlashMLA's interface (the call
convention of flash_mla_with_kvcache for the V3.2 format, asserted, with FlashMLA's BF16 scale
rounding) and the timer. Run with any Python that has PyTorch:

    python -m pytest -q bench/peers/test_v32.py
"""

import math
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the peers harness runs over PyTorch, not installed here")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import v32  # noqa: E402


class OursStandIn:
    """dsa_decode.ops' two V3.2 calls on the CPU: the model of vLLM's write, attention in float32."""

    def __init__(self):
        self.attention_calls = []

    def sparse_mla_v32_cache_write(self, kv_c, k_pe, slot_mapping, kv_cache):
        flat = kv_cache.view(-1, v32.ENTRY)
        flat[slot_mapping] = v32.write_cache_model(kv_c, k_pe)

    def sparse_mla_v32(self, q, kv_cache, indices, softmax_scale, latent, lse):
        self.attention_calls.append(int(indices.min()) // indices.numel())  # the rotation read
        keys = v32.dequantize(kv_cache.view(-1, v32.ENTRY)[indices.long()]).float()  # [m, K, 576]
        s = torch.einsum("mhd,mkd->mhk", q.float(), keys) * softmax_scale
        l = torch.logsumexp(s, dim=-1)
        latent.copy_(torch.einsum("mhk,mkd->mhd", torch.exp(s - l[..., None]), keys[..., : v32.LATENT]))
        lse.copy_(l)


def flashmla_stand_in(lse_base2=False, bf16_scales=True):
    """FlashMLA's Python interface for its sparse FP8 V3.2 decode, as the harness calls it."""
    calls = []

    def get_mla_metadata(*args, **kwargs):
        return types.SimpleNamespace(initialized=False), None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, num_splits,
                               softmax_scale, causal, is_fp8_kvcache, indices):
        b, s_q, h_q, d_qk = q.shape
        assert (s_q, d_qk, head_dim_v) == (1, 576, 512) and h_q in (64, 128)
        assert q.dtype == torch.bfloat16 and q.is_contiguous()
        assert k_cache.dim() == 4 and k_cache.shape[2:] == (1, 656) and k_cache.stride(1) == 656
        assert k_cache.dtype == torch.uint8
        assert indices.shape == (b, 1, indices.shape[-1]) and indices.dtype == torch.int32
        assert block_table is None and cache_seqlens is None and num_splits is None
        assert is_fp8_kvcache and not causal
        sched.initialized = True
        calls.append(int(indices.min()) // indices.numel())  # the rotation read
        entries = k_cache.view(-1, 656)[indices.view(b, -1).long()]
        keys = v32.dequantize(entries)
        if bf16_scales:  # FlashMLA multiplies the codes by the scale rounded to BF16
            scales = entries[..., 512:528].contiguous().view(torch.float32).to(torch.bfloat16).double()
            codes = entries[..., :512].contiguous().view(torch.float8_e4m3fn).double().view(*entries.shape[:2], 4, 128)
            keys[..., :512] = (codes * scales[..., None]).view(*entries.shape[:2], 512)
        s = torch.einsum("bhd,bkd->bhk", q.view(b, h_q, d_qk).double(), keys) * softmax_scale
        lse = torch.logsumexp(s, dim=-1)
        out = torch.einsum("bhk,bkd->bhd", torch.exp(s - lse[..., None]), keys[..., :512])
        if lse_base2:
            lse = lse / math.log(2.0)
        return out.to(torch.bfloat16).view(b, 1, h_q, 512), lse.float().view(b, 1, h_q)

    return types.SimpleNamespace(get_mla_metadata=get_mla_metadata, flash_mla_with_kvcache=flash_mla_with_kvcache,
                                 calls=calls)


def timer(log):
    def time(enqueue, rotations, replays):
        for i in range(max(2, rotations)):
            enqueue(i)
        log.append(rotations)
        return 10.0 if not log or len(log) % 2 else 20.0
    return time


def env(ops=None, flashmla=None, rotations=2, log=None):
    return v32.Env(device="cpu", time=timer(log if log is not None else []), rotations_for=lambda b: rotations,
                   ops=ops, flashmla=flashmla, flashmla_error="" if flashmla else "not built", commit="9241ae3ef9ba" * 2,
                   replays=3)


def run(e, heads=(16, 128), tokens=(1, 2)):
    rows = []
    v32.run(e, list(heads), list(tokens), rows, log=lambda row: None, top_k=64, min_slots=512)
    return rows


def test_write_model_is_vllms_layout():
    gen = torch.Generator().manual_seed(1)
    kv_c = (torch.randn((5, 512), generator=gen) * 3).to(torch.bfloat16)
    k_pe = torch.randn((5, 64), generator=gen).to(torch.bfloat16)
    kv_c[0, :128] = 0  # an all-zero group: scale FLT_MIN, codes 0
    e = v32.write_cache_model(kv_c, k_pe)
    assert e.shape == (5, 656) and e.dtype == torch.uint8
    scales = e[:, 512:528].contiguous().view(torch.float32)
    assert float(scales[0, 0]) == torch.finfo(torch.float32).tiny and bool((e[0, :128] == 0).all())
    groups = kv_c.float().view(5, 4, 128)
    torch.testing.assert_close(scales[1:], groups[1:].abs().amax(dim=2) / 448.0, rtol=0, atol=0)
    assert torch.equal(e[:, 528:].contiguous().view(torch.bfloat16), k_pe)
    keys = v32.dequantize(e)
    assert keys.shape == (5, 576)
    err = (keys[:, :512] - kv_c.double()).abs().view(5, 4, 128)
    assert bool((err <= groups.abs().amax(dim=2, keepdim=True).double() * 2.0**-4 + 1e-30).all())  # half an e4m3 step
    # The largest value of each group codes as 448 (0x7E or 0xFE).
    codes = e[1:, :512].view(4, 4, 128)
    assert bool(((codes & 0x7F) == 0x7E).any(dim=2).all())


def test_rows_check_and_time_both_sides():
    ours, peer, log = OursStandIn(), flashmla_stand_in(bf16_scales=False), []
    rows = run(env(ours, peer, log=log))
    assert [(r["params"]["H"], r["params"]["m"]) for r in rows] == [(16, 1), (16, 2), (128, 1), (128, 2)]
    for r in rows:
        assert r["name"] == "sparse_mla dsv32 vs FlashMLA V32" and r["params"]["K"] == 64
        assert "error" not in r and "baseline_error" not in r, r
        assert r["check_ours"]["latent_rel"] <= v32.LATENT_TOL and r["check_ours"]["lse_abs"] <= v32.LSE_TOL
        assert r["check_baseline"]["latent_rel"] <= v32.LATENT_TOL and r["check_baseline"]["lse_abs"] <= v32.LSE_TOL
        assert r["speedup"] == r["baseline_us"] / r["us"]
        assert "written by ours" in r["note"]
        assert r["baseline"].endswith("@9241ae3ef9ba")
    assert "16 heads padded to 64" in rows[0]["baseline"] and "padded call is timed" in rows[0]["note"]
    assert "padded" not in rows[2]["baseline"]
    # Launch i reads rotation i % R (region r of the cache): both sides read both regions.
    assert set(ours.attention_calls) == {0, 1} and set(peer.calls) == {0, 1}
    assert ours.attention_calls[:3] == [0, 0, 1]  # the check's call, then the timer's launches 0, 1
    # FlashMLA's work is counted at the heads it ran.
    r16 = rows[0]
    assert r16["baseline_tflops"] == pytest.approx(v32.flops(1, 64, 64) / (r16["baseline_us"] * 1e-6) / 1e12)


def test_a_peer_outside_the_contract_is_not_timed():
    rows = run(env(OursStandIn(), flashmla_stand_in(lse_base2=True)), heads=(128,), tokens=(1,))
    (r,) = rows
    assert "FlashMLA fails the contract" in r["baseline_error"] and "baseline_us" not in r and "speedup" not in r
    assert "us" in r  # ours still timed


def test_flashmlas_bf16_scales_are_judged_by_their_own_dequantization():
    # At K = 64 the BF16 rounding of the scales moves the stand-in's lse past 1e-3 of the FP32-scale
    # reference; against float64 of its own dequantization it is within the bounds: timed, and said.
    (r,) = run(env(OursStandIn(), flashmla_stand_in(bf16_scales=True)), heads=(128,), tokens=(2,))
    assert r["check_baseline"]["lse_abs"] > v32.LSE_TOL
    assert r["check_baseline_bf16_scales"]["lse_abs"] <= v32.LSE_TOL and "baseline_us" in r
    assert "own BF16-rounded scales" in r["note"]


def test_our_side_outside_the_contract_is_not_timed():
    class Wrong(OursStandIn):
        def sparse_mla_v32(self, q, kv_cache, indices, softmax_scale, latent, lse):
            super().sparse_mla_v32(q, kv_cache, indices, softmax_scale * 1.01, latent, lse)

    (r,) = run(env(Wrong(), flashmla_stand_in(bf16_scales=False)), heads=(16,), tokens=(2,))
    assert "ours fails the contract" in r["error"] and "us" not in r and "speedup" not in r
    assert "baseline_us" in r


def test_peers_alone_and_missing_peer():
    (alone,) = run(env(None, flashmla_stand_in(bf16_scales=False)), heads=(128,), tokens=(1,))
    assert "us" not in alone and "baseline_us" in alone and "torch model of vLLM's write" in alone["note"]
    (missing,) = run(env(OursStandIn(), None), heads=(16,), tokens=(1,))
    assert missing["baseline_error"] == "not built" and "us" in missing


def test_a_cache_write_that_departs_from_vllms_is_an_error():
    class Wrong(OursStandIn):
        def sparse_mla_v32_cache_write(self, kv_c, k_pe, slot_mapping, kv_cache):
            super().sparse_mla_v32_cache_write(kv_c, k_pe.neg(), slot_mapping, kv_cache)

    (r,) = run(env(Wrong(), flashmla_stand_in()), heads=(16,), tokens=(1,))
    assert "cache write differs" in r["error"]


def test_peer_heads_and_the_softmax_scale():
    assert [v32.peer_heads(h) for h in (1, 16, 64, 65, 128)] == [64, 64, 64, 128, 128]
    with pytest.raises(ValueError):
        v32.peer_heads(129)
    assert v32.SOFTMAX_SCALE == pytest.approx(0.1352338, abs=5e-8)


def test_bench_cli_knows_the_rows():
    import bench

    text = bench.one_line({"name": v32.NAME, "params": {"H": 16, "m": 1, "K": 2048}, "us": 5.0, "baseline_us": 10.0,
                           "speedup": 2.0})
    assert "sparse_mla dsv32 vs FlashMLA V32 (H=16, m=1, K=2048)" in text and "x2.00" in text
    table = bench.table({"rows": [{"name": v32.NAME, "params": {"H": 128, "m": 4, "K": 2048}, "us": 1.0,
                                   "baseline_us": 1.5, "speedup": 1.5, "baseline": "FlashMLA V32"}]})
    assert "| sparse_mla dsv32 vs FlashMLA V32 | H 128, m 4, K 2048 | 1.00 | 1.50 | 1.50x |" in table
