"""Merge the JSON files of benchmarks/multi_gpu_suite.sh into one, derive the scaling ratios, print a table.

    python benchmarks/multi_gpu_summary.py --json-dir /tmp/radixserve-multi/json --steps /tmp/.../steps.txt \\
        --out out/multi_gpu_results.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Any


def _load(json_dir: str) -> dict[str, Any]:
    data = {}
    for path in sorted(glob.glob(os.path.join(json_dir, "*.json"))):
        try:
            with open(path) as f:
                data[os.path.splitext(os.path.basename(path))[0]] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            data[os.path.splitext(os.path.basename(path))[0]] = {"error": repr(e)}
    return data


def _one_batch(d: dict[str, Any] | None, bs: int) -> dict[str, Any] | None:
    for r in (d or {}).get("results", []):
        if r.get("batch_size") == bs:
            return r
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def derive(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tpa = data.get("tp_agreement")
    if tpa and "results" in tpa:
        r2 = tpa["results"].get("2", {})
        out["tp_agreement"] = {"pass": tpa.get("pass"), "tf_agreement": r2.get("tf_agreement"),
                               "tf_exact_frac": r2.get("tf_exact_frac"), "free_equal_frac": r2.get("free_equal_frac"),
                               "tp1_floor_tf_agreement": tpa["results"].get("1", {}).get("tf_agreement")}
    scaling = {}
    for bs in (1, 32):
        one, two = _one_batch(data.get("one_batch_8b_tp1"), bs), _one_batch(data.get("one_batch_8b_tp2"), bs)
        t1, t2 = (one or {}).get("decode_tok_s"), (two or {}).get("decode_tok_s")
        scaling[f"bs{bs}"] = {"tp1_decode_tok_s": t1, "tp2_decode_tok_s": t2, "speedup": _ratio(t2, t1)}
    scaling["bs1_target_1_7x_met"] = (scaling["bs1"]["speedup"] or 0) >= 1.7
    out["decode_scaling_8b"] = scaling
    b70 = data.get("one_batch_70b_tp2")
    out["llama70b_tp2"] = {f"bs{bs}": {k: (_one_batch(b70, bs) or {}).get(k) for k in
                                       ("decode_tok_s", "median_decode_s", "prefill_tok_s", "bandwidth_util")}
                           for bs in (1, 32)}

    def offline(name: str) -> dict[str, Any]:
        rs = (data.get(name) or {}).get("results") or [{}]
        return rs[0]

    dp2, tp2 = offline("offline_tp1_dp2"), offline("offline_tp2")
    out["offline_8b"] = {"tp1_dp2_output_tok_s": dp2.get("output_tok_s"), "tp2_output_tok_s": tp2.get("output_tok_s"),
                         "dp2_over_tp2": _ratio(dp2.get("output_tok_s"), tp2.get("output_tok_s"))}
    rr, ca = offline("dp_prefix_round_robin"), offline("dp_prefix_cache_aware")
    out["dp_shared_prefix"] = {
        m: {k: r.get(k) for k in ("output_tok_s", "input_tok_s", "elapsed_s", "cache_hit_rate", "dp_routed",
                                  "dp_cache_routed", "dp_cache_hit_rate")} for m, r in (("round_robin", rr),
                                                                                      ("cache_aware", ca))}
    out["dp_shared_prefix"]["cache_aware_speedup"] = _ratio(ca.get("output_tok_s"), rr.get("output_tok_s"))
    return out


def print_table(d: dict[str, Any], steps: list[str]) -> None:
    print("\n================ multi-GPU summary")
    for line in steps:
        print("  step", line)
    a = d.get("tp_agreement", {})
    print(f"\n1. TP=2 vs TP=1 greedy (8B dummy, bf16, graphs + overlap): teacher-forced agreement "
          f"{_fmt(a.get('tf_agreement'), '.2%')} (exact {_fmt(a.get('tf_exact_frac'), '.2%')}; TP=1's own floor "
          f"{_fmt(a.get('tp1_floor_tf_agreement'), '.2%')}), free-running equal {_fmt(a.get('free_equal_frac'), '.2%')}"
          f" -> {'PASS' if a.get('pass') else 'FAIL/missing'} (>= 99%)")
    s = d["decode_scaling_8b"]
    print("\n2. 8B decode (bench_one_batch, input 512):")
    print(f"   {'batch':>5} {'TP1 tok/s':>10} {'TP2 tok/s':>10} {'speedup':>8}")
    for bs in (1, 32):
        r = s[f"bs{bs}"]
        print(f"   {bs:>5} {_fmt(r['tp1_decode_tok_s']):>10} {_fmt(r['tp2_decode_tok_s']):>10} "
              f"{_fmt(r['speedup'], '.2f'):>7}x")
    print(f"   batch-1 target >= 1.7x: {'met' if s['bs1_target_1_7x_met'] else 'NOT met'}")
    o = d["offline_8b"]
    print(f"   offline 8B (400 prompts <=1024 in / <=512 out): TP1xDP2 {_fmt(o['tp1_dp2_output_tok_s'])} out tok/s, "
          f"TP2 {_fmt(o['tp2_output_tok_s'])} out tok/s, DP2/TP2 {_fmt(o['dp2_over_tp2'], '.2f')}x")
    print("   70B TP2:", ", ".join(
        f"batch {bs}: {_fmt(r['decode_tok_s'])} tok/s "
        f"({_fmt(r['median_decode_s'] and r['median_decode_s'] * 1e3, '.2f')} ms/step, "
        f"BW util {_fmt(r['bandwidth_util'], '.0%')})" for bs, r in ((1, d['llama70b_tp2']['bs1']),
                                                                     (32, d['llama70b_tp2']['bs32']))))
    p = d["dp_shared_prefix"]
    print("\n3. DP=2 shared-prefix (8B):")
    print(f"   {'routing':<12} {'out tok/s':>10} {'in tok/s':>10} {'elapsed s':>9} {'hit rate':>9}  routed")
    for m in ("round_robin", "cache_aware"):
        r = p[m]
        print(f"   {m:<12} {_fmt(r['output_tok_s']):>10} {_fmt(r['input_tok_s']):>10} {_fmt(r['elapsed_s'], '.2f'):>9} "
              f"{_fmt(r['cache_hit_rate'], '.3f'):>9}  {r['dp_routed']} ({r['dp_cache_routed']} by prefix)")
    print(f"   cache_aware / round_robin throughput: {_fmt(p['cache_aware_speedup'], '.2f')}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-dir", required=True)
    parser.add_argument("--steps", default=None, help="steps.txt of the suite (name rc seconds)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    data = _load(args.json_dir)
    steps = []
    if args.steps and os.path.exists(args.steps):
        with open(args.steps) as f:
            steps = [line.rstrip() for line in f if line.strip()]
    derived = derive(data)
    print_table(derived, steps)
    with open(args.out, "w") as f:
        json.dump({"summary": derived, "steps": steps, "raw": data}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
