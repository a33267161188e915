"""q/k/v at one row with the rotary embedding and the KV store: the one-row GEMV (where the table has tiles for the
shape, else cuBLAS) then the rotary kernel (two launches, what a Llama layer runs without the fusion) against the
fused kernel (`triton_ops/gemv_rope.py`) over a range of tiles. Each layer runs its input RMSNorm first, as in
decode; 32 layers, each with its own weight (the set several times the L2), are captured in one CUDA graph with the
launches as the decode graphs make them (programmatic dependent launch where it is on), and the graph is replayed back
to back. Prints µs per layer and writes JSON; `--picks-out` writes a table entry only where a fused tile beats the
baseline.

    python benchmarks/bench_gemv_rope.py --shape 8b --out gemv_rope.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# heads, KV heads, head_dim, hidden size, q/k/v bias
SHAPES = {"8b": (32, 8, 128, 4096, False), "qwen2.5-7b": (28, 4, 128, 3584, True)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--out", default=None)
    p.add_argument("--picks-out", default=None, help="a gemv_configs JSON with the best fused tiles (family "
                   "row16_rope) if they beat the two kernels, else none (RADIXSERVE_GEMV_CONFIGS=that file)")
    args = p.parse_args()

    import torch
    from layer_timing import capture_graph, replay_seconds

    from radixserve.layers.layernorm import RMSNorm
    from radixserve.layers.quantization.gemv_configs import GemvConfig, key
    from radixserve.layers.triton_ops import gemv_rope
    from radixserve.layers.triton_ops.gemv import gemv_config, gemv_row
    from radixserve.layers.triton_ops.rotary import KVWrite, apply_rotary_inplace

    hq, hk, d, k, has_bias = SHAPES[args.shape]
    n = (hq + 2 * hk) * d
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16() for _ in range(args.layers)]
    bias = torch.randn(n, device="cuda", generator=g).bfloat16() if has_bias else None
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    norm = RMSNorm(k, 1e-5).cuda().bfloat16()
    ang = torch.rand(8192, d // 2, device="cuda", generator=g) * 6.0
    cos, sin = ang.cos(), ang.sin()
    pos, loc = torch.tensor([777], device="cuda"), torch.tensor([3], device="cuda")
    k_buf, v_buf = (torch.zeros(16, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = gemv_config(ws[0])
    plain_cfg = table or GemvConfig("ew", 4, 1024)

    def rotate(out: torch.Tensor) -> torch.Tensor:
        q, kk, v = out.split([hq * d, hk * d, hk * d], dim=-1)
        apply_rotary_inplace(pos, q, kk, cos, sin, d, KVWrite(k_buf, v_buf, loc, v))
        return out

    def two_kernels(w: torch.Tensor) -> torch.Tensor:
        return rotate(gemv_row(norm(x), w, bias, plain_cfg))

    def cublas_two(w: torch.Tensor) -> torch.Tensor:
        return rotate(torch.nn.functional.linear(norm(x), w, bias))

    def gemv_only(w: torch.Tensor) -> torch.Tensor:
        return gemv_row(norm(x), w, bias, plain_cfg)

    def fused(cfg: GemvConfig):  # noqa: ANN202
        dest = gemv_rope.KVDest(k_buf, v_buf, loc)
        return lambda w: gemv_rope.gemv_qkv_rope(norm(x), w, bias, hq, hk, d, pos, cos, sin, dest, cfg)

    # the baseline is what a layer runs without the fusion: the one-row GEMV where the table has tiles for the shape,
    # else cuBLAS; then the rotary kernel
    gemv_two = ("gemv + rotary (table tiles)" if table else "gemv + rotary (default tiles)", two_kernels, None)
    cublas = ("cuBLAS + rotary", cublas_two, None)
    variants = [gemv_two, cublas] if table else [cublas, gemv_two]
    variants.append(("gemv alone (no rotary)", gemv_only, None))
    table_rope = gemv_rope.gemv_rope_config(ws[0], d)  # the table's pick, if any
    for bn in (1, 2, 4, 8):
        for bk in (1024, 2048, 4096):
            for warps in (4, 8):
                if 2 * bn * bk <= 16384 and (d // 2) % bn == 0:
                    cfg = GemvConfig("ew", bn, bk, warps, 2)
                    name = f"fused bn={bn} bk={bk} w={warps}" + (" (table)" if cfg == table_rope else "")
                    variants.append((name, fused(cfg), cfg))
    ref = cublas_two(ws[0]).float()
    rows = []
    for name, fn, cfg in variants:
        try:
            out = fn(ws[0]).float()
            err = float((out - ref).norm() / ref.norm())
            graph = capture_graph(lambda f=fn: [f(w) for w in ws])
            t = sorted(replay_seconds(graph, args.samples))
            us = t[len(t) // 2] / args.layers * 1e6
        except Exception as e:  # noqa: BLE001 - reported, the rest go on
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        rows.append({"variant": name, "cfg": cfg.to_dict() if cfg else None, "us_per_layer": us, "rel_err": err})
        print(f"{name:40s} {us:8.2f} µs/layer  rel err vs cuBLAS + rotary {err:.1e}", flush=True)
    weight_bytes = n * k * 2
    base = rows[0]["us_per_layer"] if rows else float("nan")
    print(f"\n## {args.shape}: q/k/v {n}x{k} bf16 ({weight_bytes / 1e6:.1f} MB a layer) after its RMSNorm, "
          f"{args.layers} layers in one graph; table tiles {table}; baseline: {rows[0]['variant'] if rows else '-'}")
    print(f"{'variant':40s} {'µs/layer':>9s} {'vs baseline':>15s} {'weight GB/s':>12s}")
    for r in sorted(rows, key=lambda r: r["us_per_layer"]):
        print(f"{r['variant']:40s} {r['us_per_layer']:9.2f} {r['us_per_layer'] - base:+15.2f} "
              f"{weight_bytes / r['us_per_layer'] / 1e3:12.0f}")
    fused_rows = [r for r in rows if r["cfg"] is not None]
    if args.picks_out and fused_rows:
        best = min(fused_rows, key=lambda r: r["us_per_layer"])
        wins = best["us_per_layer"] < base and best["rel_err"] < 1e-2
        picks = {"configs": {key("row16_rope", 1, n, k): best["cfg"]} if wins else {}}
        with open(args.picks_out, "w") as f:
            json.dump(picks, f, indent=1)
        print(f"best fused: {best['variant']} ({best['us_per_layer'] - base:+.2f} µs a layer against "
              f"{rows[0]['variant']}): {'written to' if wins else 'no win, nothing in'} {args.picks_out}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "n": n, "k": k, "layers": args.layers, "device":
                       torch.cuda.get_device_name(), "table_cfg": table.to_dict() if table else None,
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
