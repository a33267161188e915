"""fp8 linear products at 64-1024 rows (decode of a large batch, prefill chunks) on the 8B shapes: which cuBLASLt
path beats bf16, with the activation quantisation each needs.

- bf16: `F.linear` (the unquantised model's product);
- row: per-token quantisation of x + `torch._scaled_mm` with per-token / per-channel scales (what an fp8 layer
  runs above the swept table's rows), and the product alone ("row mm");
- rowT: the same product transposed, out.T = W @ x.T (the weight's rows as the long side), alone and with the
  transpose copied back;
- tensor: per-tensor scales for x and W (the weight quantised with one scale), the product alone, and with a
  per-tensor quantisation of x in torch ops (amax, divide, cast);
- unit: x quantised per token, the tensor-wise product with scales of 1 and both scales applied after it in one
  pass (`fp8_mid.scaled_mm_unit`, the whole product as an fp8 layer runs it);
- mid: the `fp8_mid` kernel the table names for this batch and shape (where it has one).

Each call is checked against the float32 product of its own quantised operands, then timed inside a CUDA graph
over enough weight copies (>= --min-mb) that every call reads HBM. Prints µs per call and the sum over the four
linears of 32 layers per M.

    python benchmarks/bench_fp8_scaled_mm.py --m 64 160 256 512 1024
    python benchmarks/bench_fp8_scaled_mm.py --device cpu --m 16 --shapes 64x128   # a dry run of the logic
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES_8B = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]  # the largest first
FP8_MAX = 448.0


def timed(fn, reps: int, cuda: bool) -> float:  # noqa: ANN001
    """Seconds per call of fn(i), i over the weight copies."""
    if cuda:
        from benchmarks.sweep_gemv import time_calls

        return time_calls(fn, reps)
    t = time.perf_counter()
    for i in range(reps):
        fn(i)
    return (time.perf_counter() - t) / reps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[64, 160, 256, 512, 1024])
    p.add_argument("--shapes", nargs="*", default=None, help="NxK, default the 8B's four linears")
    p.add_argument("--device", default="cuda")
    p.add_argument("--min-mb", type=int, default=256)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    dev = args.device
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES_8B
    rows = []
    for n, k in shapes:
        rows += bench_shape(n, k, args.m, args.min_mb, dev)
    totals: dict[tuple[int, str], float] = {}
    for r in rows:
        totals[(r["m"], r["path"])] = totals.get((r["m"], r["path"]), 0.0) + r["us"]
    names = ["bf16", "row", "row mm", "rowT mm", "rowT+copy", "tensor mm", "tensor+q", "unit", "mid"]
    print(f"\n{'M':>5} {'N x K':>11} " + " ".join(f"{h:>9}" for h in names) + "   (µs per call; err > 3% marked !)")
    for m in args.m:
        for shape in shapes + [None]:
            n, k = shape if shape else (None, None)
            cells = []
            for h in names:
                if n is None:
                    v = totals.get((m, h))
                    cells.append(f"{v * 32 / 1e3:>8.3f}m" if v is not None else f"{'-':>9}")
                    continue
                r = [r for r in rows if (r["m"], r["n"], r["k"], r["path"]) == (m, n, k, h)]
                cells.append(f"{r[0]['us']:>8.1f}{'!' if r[0]['rel_err'] > 3e-2 else ' '}" if r else f"{'-':>9}")
            label = "32 layers" if n is None else f"{n}x{k}"
            print(f"{m:>5} {label:>11} " + " ".join(cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


def bench_shape(n: int, k: int, ms: list[int], min_mb: int, dev: str) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from radixserve.layers.quantization import gemv_configs
    from radixserve.layers.quantization.fp8 import FP8, quantize_rows
    from radixserve.layers.quantization.fp8_kernels import per_token_group_quant_fp8

    cuda = dev == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(n + k)
    w = torch.randn(n, k, device=dev, generator=g) * 0.02
    wq, ws = quantize_rows(w)  # per channel
    wt_scale = (w.abs().amax() / FP8_MAX).float().reshape(())
    wt = (w / wt_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # per tensor
    w16 = w.to(dt)
    del w
    per = n * k  # fp8 bytes
    ncopy = max(1, -(-(min_mb << 20) // per))
    c8 = [wq] + [wq.clone() for _ in range(ncopy - 1)]
    ct = [wt] + [wt.clone() for _ in range(ncopy - 1)]
    c16 = [w16] + [w16.clone() for _ in range(max(1, -(-(min_mb << 20) // (2 * per))) - 1)]
    reps = max(ncopy, 24)

    def quant(x):  # noqa: ANN001, ANN202
        return per_token_group_quant_fp8(x, k) if cuda else _quant_rows_ref(x)

    rows = []
    for m in ms:
        x = (torch.randn(m, k, device=dev, generator=g) * 0.5).to(dt)
        xq, xs = quant(x)
        xt_scale = (x.float().abs().amax() / FP8_MAX).reshape(())
        xtq = (x.float() / xt_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        ref_row = (xq.float() * xs.view(-1, 1)) @ (wq.float() * ws.view(-1, 1)).t()
        ref_t = (xtq.float() * xt_scale) @ (wt.float() * wt_scale).t()
        mid_cfg = gemv_configs.get_mid(m, n, k) if cuda else None
        calls = {
            "bf16": (lambda i, x=x: F.linear(x, c16[i % len(c16)]), x.float() @ w16.float().t()),
            "row": (lambda i, x=x: torch._scaled_mm(*_row_args(quant(x), c8[i % len(c8)], ws), out_dtype=dt),
                    ref_row),
            "row mm": (lambda i, xq=xq, xs=xs: torch._scaled_mm(*_row_args((xq, xs), c8[i % len(c8)], ws),
                                                                out_dtype=dt), ref_row),
            "rowT mm": (lambda i, xq=xq, xs=xs: torch._scaled_mm(
                c8[i % len(c8)], xq.t(), scale_a=ws.view(-1, 1), scale_b=xs.view(1, -1), out_dtype=dt).t(),
                ref_row),
            "rowT+copy": (lambda i, xq=xq, xs=xs: torch._scaled_mm(
                c8[i % len(c8)], xq.t(), scale_a=ws.view(-1, 1), scale_b=xs.view(1, -1),
                out_dtype=dt).t().contiguous(), ref_row),
            "tensor mm": (lambda i, xtq=xtq, s=xt_scale: torch._scaled_mm(
                xtq, ct[i % len(ct)].t(), scale_a=s, scale_b=wt_scale, out_dtype=dt), ref_t),
            "tensor+q": (lambda i, x=x: _tensor_mm(x, ct[i % len(ct)], wt_scale, dt), ref_t),
        }
        if cuda:
            from radixserve.layers.quantization.fp8_mid import scaled_mm_unit

            calls["unit"] = (lambda i, x=x: scaled_mm_unit(x, c8[i % len(c8)], ws, dt), ref_row)
        if mid_cfg is not None and mid_cfg.kernel != "scaled_mm":
            from radixserve.layers.quantization.fp8_mid import fp8_mid_mm

            calls["mid"] = (lambda i, x=x, cfg=mid_cfg: fp8_mid_mm(x, c8[i % len(c8)], ws, dt, cfg), ref_row)
        for name, (fn, ref) in calls.items():
            try:
                out = fn(0).float()
                err = float((out - ref).norm() / ref.norm())
                us = timed(fn, reps, cuda) * 1e6
            except Exception as e:  # noqa: BLE001 - a path this build lacks: reported, the rest still runs
                print(f"  {name} m={m} {n}x{k}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            rows.append({"m": m, "n": n, "k": k, "path": name, "us": us, "rel_err": err})
        print(f"  M={m} {n}x{k}: " + ", ".join(f"{r['path']} {r['us']:.1f}" for r in rows if r["m"] == m),
              flush=True)  # as it goes: a run cut short keeps what it measured
    c8.clear(), ct.clear(), c16.clear()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def _row_args(q, w, ws):  # noqa: ANN001, ANN202
    xq, xs = q
    return xq, w.t(), xs.view(-1, 1), ws.view(1, -1)


def _quant_rows_ref(x):  # noqa: ANN001, ANN202
    import torch

    s = x.float().abs().amax(dim=1).clamp(min=1e-10) / FP8_MAX
    return (x.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s.view(-1, 1)


def _tensor_mm(x, w, w_scale, dt):  # noqa: ANN001, ANN202
    import torch

    s = x.abs().amax().float().clamp(min=1e-10) / FP8_MAX
    xq = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, w.t(), scale_a=s, scale_b=w_scale, out_dtype=dt)


if __name__ == "__main__":
    main()
