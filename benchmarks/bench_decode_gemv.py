"""The one-row GEMV (`layers/triton_ops/gemv.py`, `gemv_row_norm`) against what it replaces, at the MoE / MLA models'
attention shapes, in CUDA graphs, with a block-config sweep.

Baselines: cuBLAS `F.linear` (o_proj), and for the fused shapes the add + RMSNorm kernel followed by cuBLAS
(Qwen3-30B-A3B's q/k/v; DeepSeek-V2-Lite's q_proj and kv_a_proj_with_mqa, two products). `--layers` distinct
weights are cycled inside one graph so a replay reads HBM, not L2; time per layer = graph time / layers.

    python benchmarks/bench_decode_gemv.py --sweep --picks picks.json

Prints a table (us per layer, GB/s, % of the copy bandwidth measured in the same run) and with --picks writes the
best config per shape as a `gemv_configs` table (load it with RADIXSERVE_GEMV_CONFIGS=picks.json)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layer_timing import seconds_per_layer  # noqa: E402

from radixserve.bench_one_batch import measure_copy_bandwidth  # noqa: E402
from radixserve.layers.quantization.gemv_configs import GemvConfig, key  # noqa: E402
from radixserve.layers.triton_ops.gemv import gemv_row_norm  # noqa: E402
from radixserve.layers.triton_ops.norm import fused_add_rmsnorm  # noqa: E402

# name: (N1, N2, K, norm before it)
SHAPES = {"qwen3-30b-a3b qkv+norm": (5120, 0, 2048, True), "qwen3-30b-a3b o_proj": (2048, 0, 4096, False),
          "dsv2-lite q+kv_a+norm": (3072, 576, 2048, True), "dsv2-lite o_proj": (2048, 0, 2048, False)}
TINY = {"tiny norm": (40, 8, 64, True), "tiny": (48, 0, 96, False)}  # a CPU check of the script
SWEEP = [(4, 1024, 4, 2), (2, 1024, 4, 2), (8, 512, 4, 2), (4, 512, 4, 3), (2, 2048, 4, 2), (8, 1024, 8, 2),
         (16, 256, 4, 3), (1, 2048, 4, 2), (4, 2048, 4, 2), (4, 2048, 8, 2), (8, 2048, 8, 2), (2, 4096, 4, 2),
         (4, 4096, 8, 2)]


def copy_bandwidth(device: str) -> float:
    return measure_copy_bandwidth(device, nbytes=1 << 30, iters=10) if device == "cuda" else float("nan")


def bench_shape(name: str, n1: int, n2: int, k: int, norm: bool, *, sweep: list | None, layers: int, reps: int,
                device: str, dtype: torch.dtype, bw: float, results: list[dict[str, Any]]
                ) -> tuple[float, tuple[int, int, int, int]] | None:
    """Time the baseline and each config at one shape; returns (seconds, config) of the fastest config."""
    g = torch.Generator(device=device).manual_seed(n1 + k)
    ws = [torch.randn(n1, k, generator=g, device=device, dtype=dtype) / k ** 0.5 for _ in range(layers)]
    w2s = [torch.randn(n2, k, generator=g, device=device, dtype=dtype) / k ** 0.5 if n2 else None
           for _ in range(layers)]
    x = torch.randn(1, k, generator=g, device=device, dtype=dtype)
    res = torch.randn(1, k, generator=g, device=device, dtype=dtype)
    nw = torch.rand(k, generator=g, device=device, dtype=dtype) + 0.5
    nbytes = (n1 + n2) * k * x.element_size()

    def base(layer: int) -> list[torch.Tensor]:  # as the model runs it unfused: q and kv_a stay two tensors
        h = fused_add_rmsnorm(x, res, nw, 1e-6)[0] if norm else x
        return [F.linear(h, ws[layer])] + ([F.linear(h, w2s[layer])] if n2 else [])

    def ours(layer: int, cfg: tuple[int, int, int, int] | None) -> torch.Tensor:
        tiles = GemvConfig("ew", *cfg) if cfg is not None else None
        return gemv_row_norm(x, ws[layer], None, w2s[layer], norm=(res, nw, 1e-6) if norm else None,
                             config=tiles)[0]

    ref = torch.cat(base(0), dim=1).float()
    rows: list[tuple[str, Any]] = [("cuBLAS" + (" + norm" if norm else "") + (" x2" if n2 else ""), None)]
    rows += [(f"gemv {c[0]}/{c[1]}/{c[2]}/{c[3]}", c) for c in sweep] if sweep else [("gemv (table)", None)]
    best = None
    for i, (label, cfg) in enumerate(rows):
        if i == 0:
            fn, err = base, 0.0
        else:
            def fn(layer: int, cfg: Any = cfg) -> torch.Tensor:
                return ours(layer, cfg)
            try:
                err = (ours(0, cfg).float() - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects: skip it
                print(f"{name:<24} {label:<22} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
        s = seconds_per_layer(fn, layers, reps, cuda=device == "cuda")
        gbs = nbytes / s / 1e9
        print(f"{name:<24} {label:<22} {s * 1e6:>9.2f} {gbs:>7.0f} {nbytes / s / bw:>8.1%} {err:>8.4f}", flush=True)
        results.append({"shape": name, "path": label, "us": s * 1e6, "gbs": gbs, "max_err": err})
        if cfg is not None and (best is None or s < best[0]):
            best = (s, cfg)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="time every config of SWEEP (else the table's own)")
    p.add_argument("--picks", help="write the fastest config per shape here (a gemv_configs table)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script only)")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = SHAPES if cuda else TINY
    sweep = SWEEP if cuda else [(4, 32, 4, 2), (2, 64, 4, 2)]
    bw = copy_bandwidth(device)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'shape':<24} {'path':<22} {'us/layer':>9} {'GB/s':>7} {'of copy':>8} {'max err':>8}")
    picks: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    for name, shape in shapes.items():
        best = bench_shape(name, *shape, sweep=sweep if args.sweep else None, layers=args.layers, reps=args.reps,
                           device=device, dtype=dtype, bw=bw, results=results)
        if best is not None:
            n1, n2, k, norm = shape
            bn, bk, warps, stages = best[1]
            family = "row16_norm" if norm else "row16"
            picks[key(family, 1, n1 + n2, k)] = GemvConfig("ew", bn, bk, warps, stages).to_dict()
            print(f"{name:<24} best {bn}/{bk}/{warps}/{stages}: {best[0] * 1e6:.2f} us")
    if args.picks:
        Path(args.picks).write_text(json.dumps({"source": "benchmarks/bench_decode_gemv.py --sweep",
                                                "copy_bw_gbs": bw / 1e9, "configs": picks}, indent=1))
        print(f"wrote {args.picks}")
    print(json.dumps({"copy_bw_gbs": bw / 1e9, "results": results}))


if __name__ == "__main__":
    main()
