"""CPU serving against transformers, one command: the three CPU targets and the forward's thread count.

    python benchmarks/bench_cpu_suite.py --out cpu_suite           # the full measurement (quiet machine)
    python benchmarks/bench_cpu_suite.py --quick --out /tmp/suite  # minutes: proves every step runs
    python benchmarks/bench_cpu_suite.py --decode-only --kv-cache-dtype fp8_e4m3 --out cpu_decode_fp8kv

Runs, each in its own process, on the embedded SmolLM2-135M-Instruct (or --model-path) at --dtype:
1. `bench_offline_throughput --dataset chat --peer transformers`: 32 chat prompts, 64 new tokens each;
2. the same with 8-128 new tokens (transformers counts only the tokens each request asked for);
3. `bench_one_batch`: batch-1 decode ms/token at context 64 / 1,000 / 3,000 / 6,000;
4. workloads 1 and 3 (contexts 64 and 6,000) again with the forward on cores - 1 threads instead of every core.
Each writes its JSON under --out; the summary (targets, ratios, thread comparison) is printed as a table and
written to <out>/summary.json. --decode-only runs step 3 alone; --kv-cache-dtype is passed to every engine run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

TARGETS = {"chat64": 1.2, "chat8_128": 2.5, "decode_6000_vs_64": 1.5}


def run(cmd: list[str], log: str) -> None:
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    print(f"  {time.perf_counter() - t0:.0f} s, log {log}", flush=True)
    if proc.returncode:
        with open(log) as f:
            sys.stdout.write(f.read()[-3000:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="cpu_suite")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="float32",
                        help="the engine's, and transformers' unless --peer-dtype (default float32; auto: bfloat16 on "
                             "a CPU with AVX512-BF16 / AMX)")
    parser.add_argument("--peer-dtype", default=None, choices=["float32", "bfloat16"],
                        help="transformers' dtype (default: the engine's; float32 is its own default for the "
                             "embedded model, whose config says float32)")
    parser.add_argument("--quick", action="store_true", help="4 prompts, short outputs, contexts 64/300")
    parser.add_argument("--skip-threads", action="store_true", help="no cores-1 comparison")
    parser.add_argument("--decode-only", action="store_true", help="only the batch-1 decode contexts (step 3)")
    parser.add_argument("--kv-cache-dtype", default=None,
                        help="the engine's --kv-cache-dtype (default: its own, the model's dtype)")
    parser.add_argument("--threads", type=int, default=None,
                        help="--cpu-num-threads for every run (default: the engine's default, every core)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    py = sys.executable
    cores = os.cpu_count() or 1
    common = ["--dtype", args.dtype, "--log-level", "warning"] + (["--model-path", args.model_path]
                                                                  if args.model_path else [])
    threads = [] if args.threads is None else ["--cpu-num-threads", str(args.threads)]
    if args.kv_cache_dtype:
        common += ["--kv-cache-dtype", args.kv_cache_dtype]
    n = "4" if args.quick else "32"
    contexts = ["64", "300"] if args.quick else ["64", "1000", "3000", "6000"]
    out_len = "4" if args.quick else "32"
    offline = [py, "-m", "radixserve.bench_offline_throughput", "--dataset", "chat", "--num-prompts", n, *common]
    chat64 = ["--random-output-len", "8" if args.quick else "64", "--fixed-output"]
    chat8_128 = ["--random-output-len", "16" if args.quick else "128", "--random-range-ratio", "0.0625"]
    one_batch = [py, "-m", "radixserve.bench_one_batch", "--batch-size", "1", "--output-len", out_len, *common]
    f = {k: os.path.join(args.out, f"{k}.json") for k in
         ("chat64", "chat8_128", "decode", "chat64_fewer_threads", "decode_fewer_threads")}
    offline += threads
    peer_args = ["--peer", "transformers"] + (["--peer-dtype", args.peer_dtype] if args.peer_dtype else [])
    one_batch += threads
    if not args.decode_only:
        run(offline + chat64 + peer_args + ["--result-file", f["chat64"]], f["chat64"][:-5] + ".log")
        run(offline + chat8_128 + peer_args + ["--result-file", f["chat8_128"]], f["chat8_128"][:-5] + ".log")
    run(one_batch + ["--input-len", *contexts, "--result-file", f["decode"]], f["decode"][:-5] + ".log")
    fewer = max(1, cores - 1)
    do_threads = not args.skip_threads and not args.decode_only and fewer != cores and args.threads is None
    if do_threads:
        run(offline + chat64 + ["--cpu-num-threads", str(fewer), "--result-file", f["chat64_fewer_threads"]],
            f["chat64_fewer_threads"][:-5] + ".log")
        run(one_batch + ["--cpu-num-threads", str(fewer), "--input-len", contexts[0], contexts[-1],
                         "--result-file", f["decode_fewer_threads"]], f["decode_fewer_threads"][:-5] + ".log")

    def load(k: str) -> dict[str, Any]:
        with open(f[k]) as fh:
            return json.load(fh)

    rows: list[tuple[str, str, str, str]] = []
    summary: dict[str, Any] = {"cores": cores, "quick": args.quick, "dtype": args.dtype,
                               "peer_dtype": args.peer_dtype or args.dtype,
                               "kv_cache_dtype": args.kv_cache_dtype or "auto"}
    offline_runs = [("chat64", f"{n} chat prompts x {chat64[1]} new tokens"),
                    ("chat8_128", f"{n} chat prompts x {int(int(chat8_128[1]) * 0.0625)}-{chat8_128[1]} new")]
    for k, label in [] if args.decode_only else offline_runs:
        ours, peer = load(k)["results"]
        ratio = ours["output_tok_s"] / peer["output_tok_s"]
        summary[k] = {"radixserve_tok_s": ours["output_tok_s"], "transformers_tok_s": peer["output_tok_s"],
                      "ratio": ratio, "threads": ours.get("threads"), "radixserve_dtype": ours.get("dtype"),
                      "transformers_dtype": peer.get("dtype")}
        rows.append((label, f"{ours['output_tok_s']:.1f} vs {peer['output_tok_s']:.1f} tok/s",
                     f"{ratio:.2f}x", f">= {TARGETS[k]}x {'met' if ratio >= TARGETS[k] else 'MISSED'}"))
    dec = {r["input_len"]: r["median_decode_s"] * 1e3 for r in load("decode")["results"]}
    summary["decode_ms"] = dec
    for ctx in contexts:
        c = int(ctx)
        rows.append((f"batch-1 decode, context {c}", f"{dec[c]:.1f} ms/token", f"{dec[c] / dec[int(contexts[0])]:.2f}x",
                     ""))
    last = int(contexts[-1])
    ratio = dec[last] / dec[int(contexts[0])]
    summary["decode_last_vs_first"] = ratio
    rows[-1] = rows[-1][:3] + (f"<= {TARGETS['decode_6000_vs_64']}x "
                               f"{'met' if ratio <= TARGETS['decode_6000_vs_64'] else 'MISSED'}",)
    if do_threads:
        few = load("chat64_fewer_threads")["results"][0]
        all_ = load("chat64")["results"][0]
        fdec = {r["input_len"]: r["median_decode_s"] * 1e3 for r in load("decode_fewer_threads")["results"]}
        summary["threads"] = {"all": cores, "fewer": fewer, "chat64_tok_s": [all_["output_tok_s"], few["output_tok_s"]],
                              "decode_ms": {c: [dec[c], fdec[c]] for c in fdec}}
        rows.append((f"threads {cores} vs {fewer}: chat64", f"{all_['output_tok_s']:.1f} vs {few['output_tok_s']:.1f}"
                     " tok/s", f"{all_['output_tok_s'] / few['output_tok_s']:.2f}x", "higher is better for all"))
        for c in sorted(fdec):
            rows.append((f"threads {cores} vs {fewer}: decode ctx {c}", f"{dec[c]:.1f} vs {fdec[c]:.1f} ms",
                         f"{fdec[c] / dec[c]:.2f}x", "above 1: all cores faster"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    ran = "" if args.decode_only else (f" (engine ran {summary['chat64'].get('radixserve_dtype')}, transformers "
                                       f"{summary['chat64'].get('transformers_dtype')})")
    print(f"\ncores {cores}, dtype {args.dtype}{ran}, KV cache {summary['kv_cache_dtype']}"
          f"{' (quick: not the targets workload)' if args.quick else ''}")
    for r in rows:
        print("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)))
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    print(f"wrote {os.path.join(args.out, 'summary.json')}")


if __name__ == "__main__":
    main()
