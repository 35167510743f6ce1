"""CPU tests of the V3.2 indexer rows' harness (bench/peers/indexer_v32.py) with stand-ins for
the GPU parts: our ops (a torch model of the pool-1 cache write, q quant and select, in the
library's layouts), DeepGEMM's paged MQA logits (its SM90 call convention asserted, the cache
read through its own derivation of codes and scales from the fused view), vLLM's
cooperative_topk and the timer. Run with any Python that has PyTorch:

    python -m pytest -q bench/peers/test_indexer_v32.py
"""

import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the peers harness runs over PyTorch, not installed here")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import indexer_v32 as iv  # noqa: E402

FP8 = torch.float8_e4m3fn


def pow2_scale(amax):
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-4) / 448.0)))


class Plan:
    """dsa_decode.IndexerPlan.dsv32's shape and workspace layout (offsets 256-byte aligned)."""

    def __init__(self, max_tokens, max_context):
        self.max_tokens, self.max_context = max_tokens, max_context
        self.page_bytes, self.row_width, self.block_size = iv.PAGE_BYTES, iv.TOPK, iv.BLOCK

    def workspace_layout(self):
        up = lambda x: (x + 255) // 256 * 256  # noqa: E731
        w = up(self.max_tokens * 64 * 128)
        lg = up(w + self.max_tokens * 64 * 4)
        return {"q_fp8": 0, "head_weights": w, "logits": lg, "logits_stride": self.max_context,
                "bytes": up(lg + self.max_tokens * self.max_context * 4)}


class OursStandIn:
    """The pool-1 ops the harness calls, on the CPU: keys quantized per token into the page layout
    (codes at 128 e, scales at 64 x 128 + 4 e), q per head with a power-of-two scale folded into
    the weights, select = float32 logits, top-2048 (ties to the lower position), increasing
    positions, remap through the block table."""

    def __init__(self):
        self.selects = []
        self.prefilled = 0

    class IndexerPlan:
        @staticmethod
        def dsv32(max_tokens=16, max_context=131072):
            return Plan(max_tokens, max_context)

    @staticmethod
    def IndexerState(block_table, ring, k_cache):
        assert ring is None  # pool 1 keeps no ring
        return types.SimpleNamespace(block_table=block_table, ring=ring, k_cache=k_cache)

    @staticmethod
    def rope_preset_config(preset, target):
        assert (preset, target) == ("dsv32", "indexer")
        return "dsv32-indexer"

    @staticmethod
    def rope_cos_sin_table(config, first, rows):
        import numpy as np

        return np.ones((rows, 64), dtype=np.float32)

    @staticmethod
    def write_keys(state, request, positions, k):
        amax = k.float().abs().amax(dim=1)
        scale = pow2_scale(amax)
        codes = (k.float() / scale[:, None]).clamp(-448, 448).to(FP8).view(torch.uint8)
        for p, c, s in zip(positions.tolist(), codes, scale):
            page = state.k_cache[int(state.block_table[request, p // 64])]
            e = p % 64
            page[128 * e : 128 * e + 128] = c
            page[64 * 128 + 4 * e : 64 * 128 + 4 * e + 4] = s.reshape(1).view(torch.uint8)

    def indexer_prefill(self, plan, index_k, gate, w, b, ape, request, state, cos_sin=None, error_count=None):
        assert gate is None and ape is None and cos_sin is not None
        self.prefilled += 1
        self.write_keys(state, request, torch.arange(index_k.shape[0]), index_k)

    def indexer_prepare(self, plan, index_q, index_k, weights, gate, w, b, ape, positions, requests, state, ws,
                        cos_sin=None, error_count=None):
        assert cos_sin is not None
        m = index_q.shape[0]
        for t in range(m):
            self.write_keys(state, int(requests[t]), positions[t : t + 1], index_k[t : t + 1])
        lay = plan.workspace_layout()
        scale = pow2_scale(index_q.float().abs().amax(dim=2))  # [m, 64]
        codes = (index_q.float() / scale[..., None]).clamp(-448, 448).to(FP8)
        ws[: m * 64 * 128] = codes.view(torch.uint8).reshape(-1)
        folded = weights * scale * (128 * 64) ** -0.5
        ws[lay["head_weights"] : lay["head_weights"] + m * 256] = folded.reshape(-1).view(torch.uint8)

    def indexer_select(self, plan, positions, requests, state, ws, slots, topk_positions=None):
        lay = plan.workspace_layout()
        m = positions.shape[0]
        self.selects.append(int(requests[0]) // m)  # the rotation read
        q = ws[: m * 64 * 128].view(FP8).float().view(m, 64, 128)
        w = ws[lay["head_weights"] : lay["head_weights"] + m * 256].view(torch.float32).view(m, 64)
        for t in range(m):
            L = int(positions[t]) + 1
            r = int(requests[t])
            pages = state.k_cache[state.block_table[r, : (L + 63) // 64].long()]
            codes = pages[:, : 64 * 128].contiguous().view(FP8).float().view(-1, 128)[:L]
            sc = pages[:, 64 * 128 :].contiguous().view(torch.float32).reshape(-1)[:L]
            logits = sc * (w[t][:, None] * (q[t] @ codes.T).clamp_min(0)).sum(0)
            start = lay["logits"] + t * lay["logits_stride"] * 4
            ws[start : start + L * 4] = logits.view(torch.uint8)
            order = sorted(range(L), key=lambda p: (-float(logits[p]), p))[: iv.TOPK]
            rows = torch.tensor(sorted(order), dtype=torch.int64)
            got = state.block_table[r].long()[rows // 64] * 64 + rows % 64
            slots[t] = got.to(torch.int32)
            if topk_positions is not None:
                topk_positions[t] = rows.to(torch.int32)


def deepgemm_stand_in(num_heads=64):
    calls = []

    def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
        assert context_lens.dim() == 2 and context_lens.dtype == torch.int32 and block_kv == 64
        return torch.zeros((num_sms + 1, 2), dtype=torch.int32)

    def fp8_paged_mqa_logits(q, kv, weights, context_lens, block_table, sched, max_context_len, clean_logits):
        b, next_n, h, d = q.shape
        assert next_n == 1 and h == num_heads and d == 128 and q.dtype == FP8 and q.is_contiguous()
        blocks, block_kv, kv_heads, with_sf = kv.shape
        assert (block_kv, kv_heads, with_sf) == (64, 1, 132) and kv.dtype == torch.uint8
        assert kv.stride(1) == 132 and kv.stride(3) == 1 and kv.stride(0) % 4 == 0
        assert weights.shape == (b, h) and weights.is_contiguous() and weights.dtype == torch.float32
        assert block_table.dtype == torch.int32 and block_table.stride(1) == 1 and block_table.shape[0] == b
        assert not clean_logits
        calls.append(int(block_table[0, 0]))
        # DeepGEMM's own derivation from the fused view: codes [blocks, 64, 128] at stride(0),
        # scales [blocks, 64] f32 at byte 64 x 128 of each page.
        flat = kv.as_strided((blocks * kv.stride(0),), (1,))
        codes = flat.as_strided((blocks, 64, 128), (kv.stride(0), 128, 1)).view(FP8).float()
        sf_bytes = flat[64 * 128 :].as_strided((blocks, 64, 4), (kv.stride(0), 4, 1)).contiguous()
        sf = sf_bytes.view(torch.float32).view(blocks, 64)
        aligned = (max_context_len + 255) // 256 * 256
        logits = torch.full((b, aligned), float("nan"))[:, :max_context_len]
        for t in range(b):
            L = int(context_lens[t, 0])
            blk = block_table[t, : (L + 63) // 64].long()
            k = (codes[blk] * sf[blk][..., None]).reshape(-1, 128)[:L]
            logits[t, :L] = (weights[t][:, None] * (q[t, 0].float() @ k.T).clamp_min(0)).sum(0)
        return logits

    return types.SimpleNamespace(get_paged_mqa_logits_metadata=get_paged_mqa_logits_metadata,
                                 fp8_paged_mqa_logits=fp8_paged_mqa_logits, calls=calls)


def topk_stand_in(wrong=False):
    def cooperative_topk(logits, lengths, output, workspace, k, max_seq_len):
        assert workspace.dtype == torch.uint8 and workspace.numel() >= logits.shape[0] * k * 8
        assert lengths.numel() == logits.shape[0] and k == 2048
        for t in range(logits.shape[0]):
            L = int(lengths.reshape(-1)[t])
            idx = torch.topk(logits[t, :L], k).indices
            output[t] = (idx.flip(0) if not wrong else (idx + 1) % L).to(torch.int32)  # any order

    return types.SimpleNamespace(cooperative_topk=cooperative_topk)


def timer(log):
    def time(enqueue, rotations, replays):
        for i in range(max(2, rotations)):
            enqueue(i)
        log.append(rotations)
        return 10.0 if len(log) % 2 else 20.0
    return time


def env(ops=None, dg=None, vt=None, rotations=2, log=None):
    return iv.Env(device="cpu", time=timer(log if log is not None else []), rotations_for=lambda b: rotations,
                  ops=ops, deepgemm=dg, topk=vt, peer_error="" if dg else "not built",
                  commits={"deepgemm": "54e22612409371d6", "vllm": "0.34.0"}, replays=3, num_sms=4)


def run(e, contexts=(2100,), tokens=(1, 2)):
    rows = []
    iv.run(e, list(contexts), list(tokens), rows, log=lambda row: None, max_context=2304)
    return rows


def test_rows_check_and_time_both_sides():
    ours, dg = OursStandIn(), deepgemm_stand_in()
    rows = run(env(ours, dg, topk_stand_in()))
    assert [(r["params"]["context"], r["params"]["m"]) for r in rows] == [(2100, 1), (2100, 2)]
    for r in rows:
        assert r["name"] == "indexer dsv32 vs DeepGEMM + vLLM top-k" and r["params"]["H"] == 64, r
        assert "error" not in r and "baseline_error" not in r, r
        assert r["check_ours"]["non_tie_diffs"] == 0 and r["check_baseline"]["non_tie_diffs"] == 0
        assert r["check_ours"]["outside_bound"] == 0 and r["check_baseline"]["outside_bound"] == 0
        assert r["check_ours_vs_baseline"]["non_tie_diffs"] == 0
        assert r["speedup"] == r["baseline_us"] / r["us"] and r["meets_target"] == (r["speedup"] >= 1.5)
        assert "written by ours" in r["note"] and "2 copies" in r["note"]
        assert "DeepGEMM fp8_paged_mqa_logits @54e226124093" in r["baseline"] and "vLLM 0.34.0" in r["baseline"]
    # Every request prefilled (2 rotations x m), launch i reading rotation i % 2 on both sides.
    assert ours.prefilled == 2 + 4
    assert set(ours.selects) == {0, 1} and ours.selects[:3] == [0, 0, 1]
    assert len(set(dg.calls)) >= 2  # the two rotations' block tables


def test_a_wrong_peer_top_k_is_not_timed():
    (r,) = run(env(OursStandIn(), deepgemm_stand_in(), topk_stand_in(wrong=True)), tokens=(1,))
    assert "peer:" in r["baseline_error"] and "baseline_us" not in r and "speedup" not in r
    assert "us" in r and r["check_ours_vs_baseline"]["non_tie_diffs"] > 0


def test_our_rows_and_slots_are_checked():
    class WrongSlots(OursStandIn):
        def indexer_select(self, plan, positions, requests, state, ws, slots, topk_positions=None):
            super().indexer_select(plan, positions, requests, state, ws, slots, topk_positions)
            slots += 1

    (r,) = run(env(WrongSlots(), deepgemm_stand_in(), topk_stand_in()), tokens=(1,))
    assert "slots are not" in r["error"] and "us" not in r

    class WrongSet(OursStandIn):
        def indexer_select(self, plan, positions, requests, state, ws, slots, topk_positions=None):
            super().indexer_select(plan, positions, requests, state, ws, slots, topk_positions)
            if topk_positions is not None:  # the lowest-scored key instead of the best one
                topk_positions[:, :] = torch.arange(52, 2100, dtype=torch.int32)[None, :]
                slots.copy_(state.block_table[:1].long().gather(1, topk_positions.long() // 64).int() * 64
                            + topk_positions % 64)

    (r,) = run(env(WrongSet(), deepgemm_stand_in(), topk_stand_in()), tokens=(1,))
    assert "ours:" in r["error"] and "beyond near-ties" in r["error"] and "us" not in r
    assert "baseline_us" in r  # the peer still timed


def test_peers_alone_and_missing_peer():
    (alone,) = run(env(None, deepgemm_stand_in(), topk_stand_in()), tokens=(2,))
    assert "us" not in alone and "baseline_us" in alone and "random codes" in alone["note"]
    assert "ours not run" in alone["note"]
    (missing,) = run(env(OursStandIn(), None, None), tokens=(1,))
    assert missing["baseline_error"] == "not built" and "us" in missing


def test_key_view_is_deepgemms_fused_layout_of_our_pages():
    k_cache = torch.arange(3 * iv.PAGE_BYTES, dtype=torch.int64).remainder(251).to(torch.uint8).view(3, iv.PAGE_BYTES)
    kv = iv.key_view(k_cache)
    assert kv.shape == (3, 64, 1, 132) and kv.stride() == (iv.PAGE_BYTES, 132, 132, 1)
    assert kv.data_ptr() == k_cache.data_ptr()


def test_compare_sets_allows_near_ties_only():
    ref = torch.tensor([[5.0, 4.0, 3.0, 2.9999, 1.0]], dtype=torch.float64)
    bound = torch.full_like(ref, 1e-3)
    a, b = torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, 3]])
    assert iv.compare_sets(ref, bound, a, b, k=3)[:2] == (2, 0)
    assert iv.compare_sets(ref, bound, a, torch.tensor([[0, 1, 4]]), k=3)[1] == 1
    assert iv.compare_sets(ref, bound, a, torch.tensor([[0, 1, 9]]), k=3)[1] == 1  # out of range
    with pytest.raises(RuntimeError):
        iv.compare_sets(ref, bound, a, torch.tensor([[0, 1, 1]]), k=3)


def test_bench_cli_runs_and_skips_the_rows():
    import bench

    assert set(bench.peers_wanted({"indexer", "attention", "v32"}, False)) == {"deepgemm", "vllm_topk"}
    assert bench.peers_wanted({"indexer", "indexer_v32", "attention", "v32"}, False) == []
    assert set(bench.peers_wanted({"indexer_v32"}, False)) == {"flashmla", "deepgemm", "vllm_topk"}
    text = bench.one_line({"name": iv.NAME, "params": {"m": 4, "context": 131072, "H": 64, "K": 2048},
                           "us": 5.0, "baseline_us": 10.0, "speedup": 2.0})
    assert "indexer dsv32 vs DeepGEMM + vLLM top-k (m=4, context=131072, H=64, K=2048)" in text and "x2.00" in text
