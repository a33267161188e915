"""Where a decode step's GPU time goes, side by side for several `bench_one_batch --profile` result files (e.g. TP1
against TP2): the kernels grouped into GEMMs (cuBLAS and their split-K reduces), collectives (all-reduce /
all-gather kernels, fused or not), attention, and everything else, in microseconds per step.

    python benchmarks/decode_profile_breakdown.py tp1.json tp2.json --batch-size 1

Run bench_one_batch with a large --profile-top (e.g. 40) so that every kernel is listed.
"""

from __future__ import annotations

import argparse
import json
import re

GROUPS = [("gemm", re.compile(r"nvjet|gemm|cutlass|splitK|sm90_xmma|cublas", re.I)),
          ("collective", re.compile(r"one_shot|two_shot|all_reduce|allreduce|allgather|reducescatter|push_", re.I)),
          ("attention", re.compile(r"decode_stage|attention|attn|flash", re.I))]


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def breakdown(path: str, batch_size: int) -> dict[str, float]:
    with open(path) as f:
        data = json.load(f)
    prof = next(p for p in data.get("profiles", []) if p["batch_size"] == batch_size)
    out = {g: 0.0 for g, _ in GROUPS} | {"other": 0.0}
    for k in prof["top_kernels"]:
        out[group_of(k["kernel"])] += k["us_per_step"]
    listed = sum(out.values())
    out["unlisted"] = prof["gpu_busy_ms_per_step"] * 1e3 - listed
    out["gpu_busy"] = prof["gpu_busy_ms_per_step"] * 1e3
    out["graph_floor"] = (prof.get("graph_floor_ms") or 0.0) * 1e3
    out["step"] = prof["unprofiled_wall_ms_per_step"] * 1e3
    out["kernels"] = prof["kernels_per_step"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    rows = {p: breakdown(p, args.batch_size) for p in args.files}
    keys = ["gemm", "collective", "attention", "other", "unlisted", "gpu_busy", "graph_floor", "step", "kernels"]
    names = [p.rsplit("/", 1)[-1].removesuffix(".json") for p in args.files]
    print(f"batch {args.batch_size}, us per decode step")
    print(f"{'':>12}" + "".join(f"{n[:16]:>18}" for n in names))
    for k in keys:
        print(f"{k:>12}" + "".join(f"{rows[p][k]:>18.1f}" for p in args.files))


if __name__ == "__main__":
    main()
