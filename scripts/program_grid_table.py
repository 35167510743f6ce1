#!/usr/bin/env python3
"""Merges dsa-decode --json reports (one per run of the grid in scripts/gpu-check)
into one JSON list and prints the fused-vs-stock table of issue 6's benchmark:
per (TP, context, m) the attention half (chain norm .. value_up) and the whole
stage (qkv_a_proj .. o_proj; reports from before dsa-decode ran the stage have
none) of both paths, their speedups, the opt-ins the run used (head_gemv sums,
indexer logits) and whether every check passed.

usage: program_grid_table.py OUT_JSON REPORT.json...
"""
import json
import sys


def main() -> int:
    out_path, paths = sys.argv[1], sys.argv[2:]
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    reports.sort(key=lambda r: (r["tp"], r["params"]["context"], r["params"]["m"], r.get("head_gemv_sums", ""),
                                r.get("indexer_logits", "")))
    with open(out_path, "w") as f:
        json.dump(reports, f, indent=1)
    print(f"{'TP':>3} {'H':>4} {'context':>8} {'m':>3} {'head_gemv':>12} {'logits':>17} {'fused us':>9} "
          f"{'stock us':>9} {'speedup':>8} {'stage us':>9} {'stock us':>9} {'speedup':>8}  checks")
    nan = float("nan")
    for r in reports:
        rows = {row["name"]: row for row in r["rows"]}
        fused, stock = rows.get("chain"), rows.get("stock_chain")
        whole, stock_whole = rows.get("whole_stage"), rows.get("stock_whole_stage")
        failed = [c["name"] for c in r["checks"] if c["result"] == "FAIL"]
        p = r["params"]
        print(f"{r['tp']:>3} {p['H']:>4} {p['context']:>8} {p['m']:>3} "
              f"{r.get('head_gemv_sums', 'seed_order'):>12} {r.get('indexer_logits', 'exact'):>17} "
              f"{fused['us'] if fused else nan:>9.2f} {stock['us'] if stock else nan:>9.2f} "
              f"{fused['speedup'] if fused else nan:>7.2f}x "
              f"{whole['us'] if whole else nan:>9.2f} {stock_whole['us'] if stock_whole else nan:>9.2f} "
              f"{whole['speedup'] if whole else nan:>7.2f}x  {'FAIL: ' + ', '.join(failed) if failed else 'all pass'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
