"""One MLA layer's prefill attention at DeepSeek-V2-Lite's shape (16 heads, latent 512, rotary 64, heads of 128):
the latent form (`mla_extend_fwd`: queries absorbed through W_UK before it, the output through W_UV after it) against
the expanded form (the keys through kv_b_proj, then `mla_expanded_extend`), each with its projections, in CUDA graphs.
`--sweep` also times the expanded kernel's tiles. Prints a table (µs a layer, TFLOP/s of the attention's own
multiply-adds) and writes JSON.

    python benchmarks/bench_mla_prefill.py --cases 16x1024 4x4096 8x512+1024 --sweep

A case BxN[+P]: B requests of N new tokens on P cached tokens each. On the CPU (Triton's interpreter) `--tiny` checks
the script."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layer_timing import seconds_per_layer  # noqa: E402

from radixserve.layers.attention.triton_ops.mla_attention import mla_extend_fwd  # noqa: E402
from radixserve.layers.attention.triton_ops.mla_expanded import mla_expanded_extend  # noqa: E402

TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 2), (128, 32, 8, 2),
         (64, 128, 8, 2), (32, 64, 4, 2)]


def parse_case(text: str) -> tuple[int, int, int]:
    b, rest = text.split("x")
    n, _, p = rest.partition("+")
    return int(b), int(n), int(p or 0)


def time_case(case: str, b: int, n: int, p: int, w_kvb: torch.Tensor, dims: tuple[int, int, int, int, int],
              sweep: bool, reps: int, g: torch.Generator) -> list[dict[str, Any]]:
    heads, latent, rope, nope, dv = dims
    dev, dt = w_kvb.device, w_kvb.dtype
    scale = (nope + rope) ** -0.5
    w_kc, w_vc = w_kvb.view(heads, nope + dv, latent).split([nope, dv], dim=1)
    rows: list[dict[str, Any]] = []
    t, s = b * n, b * (n + p)
    q = torch.randn(t, heads, nope + rope, device=dev, dtype=dt, generator=g)
    pool = torch.randn(s + 1, 1, latent + rope, device=dev, dtype=dt, generator=g)  # slot s: padding
    req_to_token = torch.arange(s, device=dev, dtype=torch.int32).view(b, n + p)
    idx = torch.arange(b, device=dev, dtype=torch.int32)
    ext = torch.full((b,), n, device=dev, dtype=torch.int32)
    pre = torch.full((b,), p, device=dev, dtype=torch.int32)
    kv_lens = ext + pre
    q_start = idx * n
    kv_start = idx * (n + p)
    pairs = b * n * (p + (n + 1) / 2)

    def latent_form(_: int) -> torch.Tensor:
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_kc).transpose(0, 1)
        q_full = torch.cat([q_lat, q[..., nope:]], dim=-1)
        o = torch.empty(t, heads, latent, device=dev, dtype=dt)
        mla_extend_fwd(q_full, pool, o, req_to_token, idx, pre, ext, q_start, n, scale, latent)
        return torch.bmm(o.transpose(0, 1), w_vc.transpose(1, 2)).transpose(0, 1)

    def expanded_form(_: int, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        keys = pool[:s, 0]
        kv = torch.nn.functional.linear(keys[:, :latent], w_kvb).view(s, heads, nope + dv)
        o = torch.empty(t, heads, dv, device=dev, dtype=dt)
        mla_expanded_extend(q, kv[..., :nope], kv[..., nope:], keys[:, latent:], o, q_start, kv_start, ext,
                            kv_lens, n, scale, blocks=tiles)
        return o

    ref = latent_form(0).float()
    variants: list[tuple[str, str, Any]] = [("latent", "-", latent_form), ("expanded", "default", expanded_form)]
    if sweep:
        variants += [("expanded", "/".join(map(str, c)), lambda layer, c=c: expanded_form(layer, c))
                     for c in TILES]
    for form, tiles, fn in variants:
        try:
            err = float((fn(0).float() - ref).abs().max())
            sec = seconds_per_layer(fn, 1, reps)
        except Exception as e:  # a tile the compiler rejects is reported, not fatal
            print(f"{case:>12} {form:>9} {tiles:>14} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        per_pair = 2 * (2 * latent + rope) if form == "latent" else 2 * (nope + rope + dv)
        r = {"case": case, "form": form, "tiles": tiles, "us_per_layer": sec * 1e6,
             "attention_tflops": pairs * heads * per_pair / sec / 1e12, "max_err": err}
        rows.append(r)
        print(f"{case:>12} {form:>9} {tiles:>14} {r['us_per_layer']:>10.1f} {r['attention_tflops']:>12.1f}"
              f"  (max err {err:.3g})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["16x1024", "4x4096", "8x512+1024"])
    parser.add_argument("--sweep", action="store_true", help="time the expanded kernel's tiles too")
    parser.add_argument("--tiny", action="store_true", help="small dimensions (a CPU check of the script)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--result-file", default="bench_mla_prefill.json")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    heads, latent, rope, nope, dv = (2, 32, 16, 16, 16) if args.tiny else (16, 512, 64, 128, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    w_kvb = torch.randn(heads * (nope + dv), latent, device=dev, dtype=dt, generator=g) * 0.03
    rows: list[dict[str, Any]] = []
    print(f"{'case':>12} {'form':>9} {'tiles':>14} {'us/layer':>10} {'attn TFLOP/s':>12}")
    for case in args.cases:
        b, n, p = parse_case(case)
        if args.tiny:
            b, n, p = min(b, 2), min(n, 24), min(p, 8)
        rows += time_case(case, b, n, p, w_kvb, (heads, latent, rope, nope, dv), args.sweep and cuda, args.reps, g)
    with open(args.result_file, "w") as f:
        json.dump({"heads": heads, "latent": latent, "rope": rope, "nope": nope, "v": dv, "results": rows}, f,
                  indent=2)


if __name__ == "__main__":
    main()
