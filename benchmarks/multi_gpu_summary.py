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


AGREEMENTS = ("agree_fp32_8b", "agree_fp32_small", "agree_bf16_8b")
MOE_RUNS = ("dsv2_tp2", "dsv2_dpattn", "dsv2_tp2_ep", "dsv2_dpattn_ep", "qwen3moe_tp2", "qwen3moe_tp2_ep")


def derive(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ar = data.get("allreduce") or {}
    out["allreduce_us"] = {str(r["kib"]): {m: (r.get(m) or {}).get("graph_us") for m in
                                          ("nccl", "one_shot", "two_shot", "auto", "triton")}
                           for r in ar.get("rows", [])}
    out["allreduce_custom_enabled"] = ar.get("custom_enabled")
    for name in AGREEMENTS:
        tpa = data.get(name)
        if tpa and "results" in tpa:
            r2 = tpa["results"].get("2", {})
            out[name] = {"pass": tpa.get("pass"), "dtype": (tpa.get("args") or {}).get("dtype"),
                         "free_equal_frac": r2.get("free_equal_frac"), "tf_agreement": r2.get("tf_agreement"),
                         "tf_exact_frac": r2.get("tf_exact_frac"), "tokens": r2.get("tokens"),
                         "tp1_floor_tf_agreement": tpa["results"].get("1", {}).get("tf_agreement")}
    scaling = {}
    for bs in (1, 32):
        one, two = _one_batch(data.get("one_batch_8b_tp1"), bs), _one_batch(data.get("one_batch_8b_tp2"), bs)
        nccl = _one_batch(data.get("one_batch_8b_tp2_nccl"), bs)
        t1, t2, tn = (one or {}).get("decode_tok_s"), (two or {}).get("decode_tok_s"), (nccl or {}).get("decode_tok_s")
        scaling[f"bs{bs}"] = {"tp1_decode_tok_s": t1, "tp2_decode_tok_s": t2, "speedup": _ratio(t2, t1),
                              "tp2_nccl_decode_tok_s": tn, "nccl_speedup": _ratio(tn, t1)}
        for variant in ("push", "push_pf"):  # the push one-shot, and it with the L2 prefetch of the next weight
            tv = (_one_batch(data.get(f"one_batch_8b_tp2_{variant}"), bs) or {}).get("decode_tok_s")
            scaling[f"bs{bs}"].update({f"tp2_{variant}_decode_tok_s": tv, f"{variant}_speedup": _ratio(tv, t1)})
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
    moe = {name: offline(name).get("output_tok_s") for name in MOE_RUNS}
    moe["dsv2_dpattn_over_tp2"] = _ratio(moe["dsv2_dpattn"], moe["dsv2_tp2"])
    moe["dsv2_dpattn_ep_over_tp2"] = _ratio(moe["dsv2_dpattn_ep"], moe["dsv2_tp2"])
    moe["dsv2_ep_over_tp2"] = _ratio(moe["dsv2_tp2_ep"], moe["dsv2_tp2"])
    moe["qwen3moe_ep_over_tp2"] = _ratio(moe["qwen3moe_tp2_ep"], moe["qwen3moe_tp2"])
    out["moe_offline_output_tok_s"] = moe
    return out


def print_table(d: dict[str, Any], steps: list[str]) -> None:
    print("\n================ multi-GPU summary")
    for line in steps:
        print("  step", line)
    print(f"\n0. all-reduce, us per call inside a CUDA graph (custom enabled: {d.get('allreduce_custom_enabled')}):")
    methods = ("nccl", "one_shot", "two_shot", "triton", "auto")
    print(f"   {'KiB':>6} " + " ".join(f"{m:>9}" for m in methods))
    for kib, r in d.get("allreduce_us", {}).items():
        print(f"   {kib:>6} " + " ".join(f"{_fmt(r.get(m), '.2f'):>9}" for m in methods))
    print("\n1. TP=2 vs TP=1 greedy (dummy weights, graphs + overlap): free-running = tokens equal up to each "
          "request's first divergence; TF = teacher-forced top-1 (+ near-ties)")
    for name in AGREEMENTS:
        a = d.get(name)
        if not a:
            print(f"   {name}: missing")
            continue
        print(f"   {name:<17} ({a['dtype']}, {a['tokens']} tokens): free-running {_fmt(a['free_equal_frac'], '.2%')}, "
              f"TF {_fmt(a['tf_agreement'], '.2%')} (exact {_fmt(a['tf_exact_frac'], '.2%')}, TP=1 floor "
              f"{_fmt(a['tp1_floor_tf_agreement'], '.2%')}) -> {'PASS' if a['pass'] else 'FAIL'}")
    s = d["decode_scaling_8b"]
    print("\n2. 8B decode (bench_one_batch, input 512):")
    print(f"   {'batch':>5} {'TP1 tok/s':>10} {'TP2 tok/s':>10} {'speedup':>8} {'TP2 NCCL':>9} {'speedup':>8}")
    for bs in (1, 32):
        r = s[f"bs{bs}"]
        print(f"   {bs:>5} {_fmt(r['tp1_decode_tok_s']):>10} {_fmt(r['tp2_decode_tok_s']):>10} "
              f"{_fmt(r['speedup'], '.2f'):>7}x {_fmt(r['tp2_nccl_decode_tok_s']):>9} "
              f"{_fmt(r['nccl_speedup'], '.2f'):>7}x")
    print(f"   batch-1 target >= 1.7x: {'met' if s['bs1_target_1_7x_met'] else 'NOT met'}")
    o = d["offline_8b"]
    print(f"   offline 8B (prompts in/out 512-1024): TP1xDP2 {_fmt(o['tp1_dp2_output_tok_s'])} out tok/s, "
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
    m = d["moe_offline_output_tok_s"]
    print("\n4. MoE / MLA offline, output tok/s:")
    print(f"   DeepSeek-V2-Lite: TP2 {_fmt(m['dsv2_tp2'])}, DP attention {_fmt(m['dsv2_dpattn'])} "
          f"({_fmt(m['dsv2_dpattn_over_tp2'], '.2f')}x; target >= 1.3x), TP2+EP2 {_fmt(m['dsv2_tp2_ep'])} "
          f"({_fmt(m['dsv2_ep_over_tp2'], '.2f')}x), DP attention+EP2 {_fmt(m['dsv2_dpattn_ep'])} "
          f"({_fmt(m['dsv2_dpattn_ep_over_tp2'], '.2f')}x)")
    print(f"   Qwen3-30B-A3B: TP2 {_fmt(m['qwen3moe_tp2'])}, TP2+EP2 {_fmt(m['qwen3moe_tp2_ep'])} "
          f"({_fmt(m['qwen3moe_ep_over_tp2'], '.2f')}x)")


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
