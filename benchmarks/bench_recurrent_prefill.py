"""The recurrent layers' prefill: for Mamba2, the torch chunked scan (`mamba2.ssd_chunked`) against the Triton
kernel (`triton_ops/ssd_scan.py`); for the gated delta rule (Qwen3.5 / Qwen3-Next), `delta_rule_chunked` with its
chunk loop in torch against it in one launch (`triton_ops/delta_chunks.py`). Each at its default config and each
config of a sweep, at one layer of a model's shape (Nemotron-H-8B: 128 heads of 64 x 128 in 8 groups; Qwen3.5-9B:
32 value heads of 128 x 128), for batches of (sequences, tokens).

    python benchmarks/bench_recurrent_prefill.py
    python benchmarks/bench_recurrent_prefill.py --layer mamba2 --batches 1x8192 64x512 --sweep --result-file r.json

Prints ms a layer (best of `--reps` CUDA-event timings) and the largest error against the torch form (relative to
its largest value), and writes JSON. On the CPU it runs a small stand-in once under the interpreter (a check of the
script, not a measurement)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.layers.linear_attention import delta_rule_chunked, l2_normalize  # noqa: E402
from radixserve.layers.mamba2 import ssd_chunked  # noqa: E402
from radixserve.layers.triton_ops import delta_chunks as dc  # noqa: E402
from radixserve.layers.triton_ops import set_fused_kernels  # noqa: E402
from radixserve.layers.triton_ops.ssd_scan import CONFIG, ssd_scan  # noqa: E402

SHAPES = {"nemotron-h-8b": (128, 64, 8, 128), "granite-4.0-h-small": (128, 64, 1, 128)}  # heads, P, groups, N
DELTA_SHAPE = (32, 128, 128)  # Qwen3.5-9B: value heads, Dk, Dv
DELTA_SWEEP = [(16, 4, 1), (32, 8, 1), (64, 4, 1), (16, 4, 2), (32, 4, 2)]
SWEEP = [(16, 64, 4, 2), (32, 32, 4, 2), (32, 64, 4, 1), (32, 64, 4, 3), (32, 64, 8, 2), (64, 32, 4, 2),
         (64, 64, 4, 1), (64, 64, 8, 2)]


def _ms(fn: Callable[[], object], reps: int) -> float:
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def run_batch(shape: str, seqs: int, length: int, sweep: bool, reps: int) -> list[dict]:
    """One (sequences, tokens) batch: the torch form, then the kernel at each config; prints a row each."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    heads, p, groups, n = SHAPES[shape] if cuda else (4, 16, 2, 16)
    if not cuda:
        seqs, length = min(seqs, 2), min(length, 40)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(seqs, length, heads, p, generator=g, device=dev).bfloat16().float()
    b = torch.randn(seqs, length, groups, n, generator=g, device=dev).bfloat16().float()
    c = torch.randn(seqs, length, groups, n, generator=g, device=dev).bfloat16().float()
    dt = torch.rand(seqs, length, heads, generator=g, device=dev) * 0.1
    a = -torch.rand(heads, generator=g, device=dev) * 4
    s0 = torch.randn(seqs, heads, p, n, generator=g, device=dev) * 0.1
    lens = torch.full((seqs,), length, device=dev)
    want, want_state = ssd_chunked(s0.clone(), x, dt, a, b, c)
    scale = float(want.abs().max())
    paths: list[tuple[str, tuple | None, bool | None]] = [("torch chunked", None, None)]
    for exact in (False, True):
        for cfg in [None] + (SWEEP if sweep and cuda else []):
            paths.append((f"triton {'tf32x3' if exact else 'tf32'} {cfg or CONFIG}", cfg, exact))
    rows, batch = [], f"{seqs}x{length}"
    for name, cfg, exact in paths:
        if exact is None:
            err, t = 0.0, _ms(lambda: ssd_chunked(s0.clone(), x, dt, a, b, c), reps)
        else:
            def scan(state: torch.Tensor, cfg: tuple | None = cfg, exact: bool = exact) -> torch.Tensor:
                return ssd_scan(state, x, dt, a, b, c, lens, exact=exact, config=cfg)

            try:
                state = s0.clone()
                got = scan(state)
                err = max(float((got - want).abs().max()), float((state - want_state).abs().max())) / scale
                t = _ms(lambda scan=scan: scan(s0.clone()), reps)
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is reported, not fatal
                print(f"{batch:>9} {name:<34} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
        rows.append(_row(shape, batch, name, t, seqs * length, err))
    return rows


def run_delta(seqs: int, length: int, sweep: bool, reps: int) -> list[dict]:
    """The gated delta rule over one batch: the torch chunk loop, then the kernel at each config."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    heads, dk, dv = DELTA_SHAPE if cuda else (2, 16, 16)
    if not cuda:
        seqs, length = min(seqs, 2), min(length, 40)
    g = torch.Generator(device=dev).manual_seed(0)
    hs = seqs * heads
    q = l2_normalize(torch.randn(hs, length, dk, generator=g, device=dev)) * dk ** -0.5
    k = l2_normalize(torch.randn(hs, length, dk, generator=g, device=dev))
    v = torch.randn(hs, length, dv, generator=g, device=dev)
    gate, beta = -torch.rand(hs, length, generator=g, device=dev) * 0.1, torch.rand(hs, length, generator=g,
                                                                                      device=dev)
    s0 = torch.randn(hs, dk, dv, generator=g, device=dev) * 0.1
    set_fused_kernels(False)
    try:
        want, want_state = delta_rule_chunked(s0, q, k, v, gate, beta)
        t = _ms(lambda: delta_rule_chunked(s0, q, k, v, gate, beta), reps)
    finally:
        set_fused_kernels(None)
    scale, batch = float(want.abs().max()), f"{seqs}x{length}"
    rows = [_row("qwen3.5-9b", batch, "torch chunk loop", t, seqs * length, 0.0)]
    real = dc.CONFIG
    try:
        for cfg in [None] + (DELTA_SWEEP if sweep and cuda else []):
            dc.CONFIG = cfg or real
            name = f"triton {dc.CONFIG}"
            set_fused_kernels(True)
            try:
                got, state = delta_rule_chunked(s0, q, k, v, gate, beta)
                err = max(float((got - want).abs().max()), float((state - want_state).abs().max())) / scale
                t = _ms(lambda: delta_rule_chunked(s0, q, k, v, gate, beta), reps)
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is reported, not fatal
                print(f"{batch:>9} {name:<34} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            finally:
                set_fused_kernels(None)
            rows.append(_row("qwen3.5-9b", batch, name, t, seqs * length, err))
    finally:
        dc.CONFIG = real
    return rows


def _row(shape: str, batch: str, name: str, t: float, tokens: int, err: float) -> dict:
    rate = tokens / t / 1e3 if t == t else float("nan")
    print(f"{batch:>9} {name:<34} {t:>9.3f} {rate:>10.2f} {err:>9.1e}", flush=True)
    return {"shape": shape, "batch": batch, "path": name, "ms": t, "mtok_s": rate, "rel_err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", choices=["mamba2", "deltanet", "both"], default="both")
    ap.add_argument("--shape", choices=list(SHAPES), default="nemotron-h-8b", help="the Mamba2 shape")
    ap.add_argument("--batches", nargs="+", default=["1x8192", "8x1024", "64x512"], help="SEQUENCESxTOKENS")
    ap.add_argument("--sweep", action="store_true", help="also each config of the sweeps")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    print(f"{'batch':>9} {'path':<34} {'ms/layer':>9} {'tok/s (M)':>10} {'max err':>9}")
    rows = []
    for batch in args.batches:
        seqs, length = (int(v) for v in batch.split("x"))
        if args.layer in ("mamba2", "both"):
            rows += run_batch(args.shape, seqs, length, args.sweep, args.reps)
        if args.layer in ("deltanet", "both"):
            rows += run_delta(seqs, length, args.sweep, args.reps)
    if args.result_file:
        cuda = torch.cuda.is_available()
        Path(args.result_file).write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
