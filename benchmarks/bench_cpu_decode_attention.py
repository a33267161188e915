"""The CPU paged decode attention alone, over as many layers as a model has (each layer its own pool, so that the
K/V come from memory as in a real step, not from a cache that one repeated layer would stay in).

    python benchmarks/bench_cpu_decode_attention.py --contexts 64 6000 --kv-dtype bfloat16 float32 fp8_e4m3

Prints, per KV dtype, context and thread count, the ms of one step's attention (every layer once, best of
--repeats) and the K/V bytes read per second; writes the rows as JSON with --out. The default shape is the
embedded SmolLM2-135M's (30 layers, 9 query / 3 KV heads of 64).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from radixserve.layers import cpu_ops

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def make_layers(layers: int, ctx: int, batch: int, hkv: int, d: int, dtype: torch.dtype, scattered: bool
                ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    slots = batch * ctx
    gen = torch.Generator().manual_seed(0)
    pools = []
    for _ in range(layers):
        k = torch.randn(slots + 1, hkv, d, generator=gen) * 0.5
        v = torch.randn(slots + 1, hkv, d, generator=gen)
        pools.append((k.to(dtype), v.to(dtype)))
    order = torch.randperm(slots, generator=gen) if scattered else torch.arange(slots)
    table = (order + 1).to(torch.int32).view(batch, ctx).contiguous()  # slot 0 stays unused, as in the pool
    return pools, table


def time_step(pools: list, table: torch.Tensor, q: torch.Tensor, scale: float, kv_scales: tuple[float, float] | None,
              repeats: int) -> tuple[float, float]:
    """(best wall ms, best process CPU ms) of one pass over every layer."""
    b = q.shape[0]
    rows = torch.arange(b, dtype=torch.int64)
    starts = torch.zeros(b, dtype=torch.int64)
    ends = torch.full((b,), table.shape[1], dtype=torch.int64)
    out = torch.empty_like(q)
    extra = {} if kv_scales is None else {"k_scale": kv_scales[0], "v_scale": kv_scales[1]}
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        for k, v in pools:
            cpu_ops.paged_decode_attention(q, k, v, table, rows, starts, ends, scale, out=out, **extra)
        best_wall = min(best_wall, (time.perf_counter() - w0) * 1e3)
        best_cpu = min(best_cpu, (time.process_time() - c0) * 1e3)
    return best_wall, best_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 1000, 3000, 6000])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--kv-dtype", nargs="+", default=["bfloat16", "float32", "fp8_e4m3"], choices=KV_DTYPES)
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and every core")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--scattered", action="store_true", help="a random permutation of slots (default: in order)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if cpu_ops.load() is None:
        raise SystemExit("the CPU kernels could not be built")
    threads = args.threads or sorted({1, torch.get_num_threads()})
    rows = []
    print(f"{'kv dtype':<10} {'context':>7} {'threads':>7} {'wall ms':>8} {'cpu ms':>8} {'GB/s':>6}")
    for name in args.kv_dtype:
        dtype = KV_DTYPES[name]
        for ctx in args.contexts:
            pools, table = make_layers(args.layers, ctx, args.batch_size, args.kv_heads, args.head_dim, dtype,
                                       args.scattered)
            q = torch.randn(args.batch_size, args.heads, args.head_dim)
            scales = (0.9, 1.1) if name.startswith("fp8") else None
            kv_bytes = 2 * args.layers * args.batch_size * ctx * args.kv_heads * args.head_dim * dtype.itemsize
            for t in threads:
                torch.set_num_threads(t)
                time_step(pools, table, q, args.head_dim ** -0.5, scales, 1)  # warm-up
                wall, cpu = time_step(pools, table, q, args.head_dim ** -0.5, scales, args.repeats)
                gbs = kv_bytes / wall / 1e6
                rows.append({"kv_dtype": name, "context": ctx, "batch": args.batch_size, "threads": t,
                             "wall_ms": wall, "cpu_ms": cpu, "kv_bytes": kv_bytes, "gb_s": gbs})
                print(f"{name:<10} {ctx:>7} {t:>7} {wall:>8.2f} {cpu:>8.2f} {gbs:>6.1f}", flush=True)
            del pools
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
