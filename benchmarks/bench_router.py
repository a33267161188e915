"""The one-launch router (`topk_kernel.fused_gate_topk`: residual add + RMSNorm + float32 router GEMV + top-k) for
one token at the MoE models' shapes, in CUDA graphs, per (expert rows per program, warps), against the launches it
replaces (add + norm, the float32 linear, the top-k kernel). With `--tokens`: the router of many tokens on the
tensor cores (`gate_gemm.gate_topk_blocks`, a bf16 gate) at its heuristic and at each (BLOCK_T, BLOCK_K, chunks,
warps) of a sweep, against the float32 linear layer + the top-k kernel.

    python benchmarks/bench_router.py
    python benchmarks/bench_router.py --tokens 8 64 256 512 2048 --layers 8

Prints us per layer (`--layers` distinct router weights cycled in one graph) and writes JSON (`--result-file`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layer_timing import seconds_per_layer  # noqa: E402

from radixserve.layers.moe.gate_gemm import gate_topk_blocks  # noqa: E402
from radixserve.layers.moe.topk_kernel import fused_gate_topk, fused_topk  # noqa: E402
from radixserve.layers.triton_ops.norm import fused_add_rmsnorm  # noqa: E402

# name: (experts, hidden, top-k, renormalise)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 8, True), "deepseek-v2-lite": (64, 2048, 6, False)}
CONFIGS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 4), (8, 8)]
# (BLOCK_T, BLOCK_K, hidden-dim chunks, warps) of the many-token router's first launch
MANY_CONFIGS = [(16, 128, 1, 4), (16, 128, 4, 4), (16, 128, 8, 4), (16, 64, 8, 4), (16, 64, 16, 4), (32, 128, 4, 4),
                (32, 64, 8, 4), (64, 64, 4, 4), (16, 128, 8, 2)]


def _shapes(dev: str, layers: int) -> Iterator[tuple]:
    """(name, hidden, top-k, renormalise, generator, `layers` float32 [experts, hidden] router weights) of each
    shape; small stand-ins on the CPU (the interpreter)."""
    for name, (e, h, k, renorm) in SHAPES.items():
        if dev == "cpu":
            e, h = 16, 64
        g = torch.Generator(device=dev).manual_seed(e)
        yield name, h, k, renorm, g, [torch.randn(e, h, generator=g, device=dev) / h ** 0.5 for _ in range(layers)]


def many_tokens(tokens: list[int], layers: int, reps: int) -> list[dict]:
    """The router of T tokens: the float32 path against the tensor-core one at its heuristic and the sweep."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    rows = []
    print(f"{'shape':<18} {'tokens':>6} {'path':<34} {'us/layer':>9} {'same ids':>9}")
    for name, h, k, renorm, g, ws in _shapes(dev, layers):
        ws = [w.bfloat16() for w in ws]
        ws32 = [w.float() for w in ws]
        for t in tokens:
            x = torch.randn(t, h, generator=g, device=dev).bfloat16()

            def float32(layer: int, x: torch.Tensor = x, k: int = k, renorm: bool = renorm, ws32: list = ws32
                        ) -> tuple[torch.Tensor, torch.Tensor]:
                return fused_topk(F.linear(x.float(), ws32[layer]), k, False, renorm, 1.0)

            ref = float32(0)[1].long().sort(dim=1).values
            us = seconds_per_layer(float32, layers, reps) * 1e6
            rows.append({"shape": name, "tokens": t, "path": "float32 linear, top-k", "us": us})
            print(f"{name:<18} {t:>6} {'float32 linear, top-k':<34} {us:>9.2f} {'-':>9}", flush=True)
            for cfg in [None] + (MANY_CONFIGS if cuda else []):
                def half(layer: int, x: torch.Tensor = x, k: int = k, renorm: bool = renorm,
                         cfg: tuple | None = cfg, ws: list = ws) -> tuple[torch.Tensor, torch.Tensor]:
                    return gate_topk_blocks(x, ws[layer], k, False, renorm, 1.0, None, not cuda, cfg)

                try:
                    ids = half(0)[1].long().sort(dim=1).values
                    same = float((ids == ref).all(dim=1).float().mean())
                    us = seconds_per_layer(half, layers, reps) * 1e6
                except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is reported, not fatal
                    print(f"{name:<18} {t:>6} tensor cores {cfg}: failed {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                label = "tensor cores, heuristic" if cfg is None else f"tensor cores {cfg}"
                rows.append({"shape": name, "tokens": t, "path": label, "config": cfg, "us": us,
                             "same_ids": same})
                print(f"{name:<18} {t:>6} {label:<34} {us:>9.2f} {same:>9.3f}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--result-file", default="bench_router.json")
    p.add_argument("--tokens", type=int, nargs="*", default=None,
                   help="time the many-token router (tensor cores against float32) at these batch sizes instead")
    args = p.parse_args()
    if args.tokens:
        if min(args.tokens) < 2:
            raise ValueError("--tokens: the many-token router takes 2 tokens or more")
        rows = many_tokens(args.tokens, args.layers, args.reps)
        with open(args.result_file, "w") as f:
            json.dump(rows, f, indent=2)
        return
    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    configs = CONFIGS if cuda else [(4, 4)]
    rows = []
    print(f"{'shape':<18} {'path':<26} {'us/layer':>9} {'same ids':>9}")
    for name, h, k, renorm, g, ws in _shapes(dev, args.layers):
        x = torch.randn(1, h, generator=g, device=dev, dtype=dt)
        res = torch.randn(1, h, generator=g, device=dev, dtype=dt)
        nw = torch.rand(h, generator=g, device=dev, dtype=dt) + 0.5
        done = torch.zeros(1, dtype=torch.int32, device=dev)

        def unfused(layer: int, ws: list = ws, x: torch.Tensor = x, res: torch.Tensor = res, nw: torch.Tensor = nw,
                    k: int = k, renorm: bool = renorm) -> tuple[torch.Tensor, torch.Tensor]:
            y, _ = fused_add_rmsnorm(x, res, nw, 1e-6)
            return fused_topk(F.linear(y.float(), ws[layer]), k, False, renorm, 1.0)

        ref_ids = unfused(0)[1]
        us = seconds_per_layer(unfused, args.layers, args.reps) * 1e6
        rows.append({"shape": name, "path": "add+norm, linear, top-k", "us": us})
        print(f"{name:<18} {'add+norm, linear, top-k':<26} {us:>9.2f} {'-':>9}", flush=True)
        for cfg in configs:
            def fused(layer: int, cfg: tuple[int, int] = cfg, ws: list = ws, x: torch.Tensor = x,
                      res: torch.Tensor = res, nw: torch.Tensor = nw, k: int = k, renorm: bool = renorm,
                      done: torch.Tensor = done) -> tuple[torch.Tensor, ...]:
                return fused_gate_topk(x, ws[layer], done, k, False, renorm, 1.0, None, not cuda,
                                       (res, nw, 1e-6), config=cfg)

            try:
                same = bool(torch.equal(fused(0)[1], ref_ids))
                us = seconds_per_layer(fused, args.layers, args.reps) * 1e6
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is reported, not fatal
                print(f"{name:<18} one launch {cfg}: failed {type(exc).__name__}: {str(exc)[:80]}")
                continue
            label = f"one launch, {cfg[0]} rows/{cfg[1]} warps"
            rows.append({"shape": name, "path": label, "rows": cfg[0], "warps": cfg[1], "us": us, "same_ids": same})
            print(f"{name:<18} {label:<26} {us:>9.2f} {str(same):>9}", flush=True)
    with open(args.result_file, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
