"""Host time per kernel launch: Triton's own `kernel[grid]` path vs radixserve's cached launch path, next to a torch
op, on tiny tensors so that the host, not the GPU, sets the pace (CUDA only).

    python benchmarks/bench_launch_overhead.py --iters 2000 --result-file launch_overhead.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from radixserve.layers.triton_ops import launch as launch_mod
from radixserve.layers.triton_ops.activation import silu_and_mul
from radixserve.layers.triton_ops.norm import fused_add_rmsnorm


def host_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--result-file", default="launch_overhead.json")
    args = parser.parse_args()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(1, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    cases = {"add + RMSNorm (Triton)": lambda: fused_add_rmsnorm(x, r, w, 1e-5),
             "SiLU·mul (Triton)": lambda: silu_and_mul(gu)}
    rows = []
    for name, fn in cases.items():
        launch_mod.set_fast_launch(False)
        slow = host_us(fn, args.iters)
        launch_mod.set_fast_launch(True)
        fast = host_us(fn, args.iters)
        rows.append({"op": name, "triton_path_us": slow, "cached_path_us": fast})
    torch_us = host_us(lambda: torch.add(x, r, out=y), args.iters)
    rows.append({"op": "torch.add (reference)", "triton_path_us": None, "cached_path_us": torch_us})
    print(f"\n{'op':<26} {'kernel[grid] us':>16} {'cached us':>10}")
    for row in rows:
        slow = f"{row['triton_path_us']:.1f}" if row["triton_path_us"] is not None else "-"
        print(f"{row['op']:<26} {slow:>16} {row['cached_path_us']:>10.1f}")
    with open(args.result_file, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "iters": args.iters, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
