"""The LM head's product by batch rows: the 16-bit head as the LogitsProcessor runs it (the one-row GEMV or cuBLAS,
float32 logits) against the int8 rows of `--quantize-lm-head` (`lm_head_int8.int8_head_logits`), each timed inside a
CUDA graph over enough copies of the weight that every call reads HBM. Prints a table and writes JSON.
`--device cpu` times the CPU paths instead (the median of single calls; `--dtype` the activations' and the 16-bit
head's dtype), e.g. on the embedded model's head: `--device cpu --vocab 49152 --hidden 576 --rows 1 8 32`.
--mid also times the W8A16 kernel of `fp8_mid` (tensor cores, the weight's rows on the MMA's long side) on the int8
rows at 17..256 rows, with each of a few tiles (block_n x block_m x block_k, warps, stages).

    python benchmarks/bench_lm_head.py [--vocab 128256 --hidden 4096] [--rows 1 8 16 32 64 160 256 512 1024] [--mid]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


# fp8_mid W8A16 tiles tried with --mid: (block_n, block_m, block_k, num_warps, num_stages)
MID_TILES = [(64, 16, 256, 4, 3), (64, 32, 256, 4, 3), (128, 32, 128, 4, 4), (64, 64, 128, 4, 4),
             (128, 64, 128, 4, 4), (128, 64, 64, 8, 4), (128, 128, 64, 8, 3), (256, 64, 64, 8, 3)]


def time_loop(fn, copies: int, reps: int = 30) -> float:  # noqa: ANN001
    """Seconds per call of fn(i): the median of single timed calls after a few untimed ones (the CPU)."""
    for i in range(max(3, copies)):
        fn(i % copies)
    times = []
    for r in range(reps):
        t = time.perf_counter()
        fn(r % copies)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16, 32, 64, 160, 256, 512, 1024])
    p.add_argument("--min-mb", type=int, default=2048, help="weight copies of each form: at least this many MB")
    p.add_argument("--mid", action="store_true", help="also the fp8_mid W8A16 kernel's tiles at 17..256 rows")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json", default="bench_lm_head.json")
    args = p.parse_args(argv)
    dev, dtype = args.device, getattr(torch, args.dtype)
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_lm_head --device cuda needs CUDA")
    if dev == "cuda":  # fn(i) over every weight copy in one CUDA graph, best of 5 runs of 20 replays
        from layer_timing import seconds_per_layer

        def timer(fn, copies: int) -> float:  # noqa: ANN001
            return seconds_per_layer(fn, copies, 20, cuda=True)
    else:
        timer = time_loop

    from radixserve.bench_one_batch import measure_copy_bandwidth
    from radixserve.layers.logits_processor import LogitsProcessor
    from radixserve.layers.quantization.fp8_mid import MAX_M, fp8_mid_mm
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.quantization.lm_head_int8 import int8_head_logits, quantize_rows_int8
    from radixserve.layers.vocab_parallel_embedding import ParallelLMHead

    copy_bw = measure_copy_bandwidth(dev) if dev == "cuda" else float("nan")
    n, k = args.vocab, args.hidden
    bf16_bytes = n * k * 2
    copies = max(2, -(-(args.min_mb << 20) // bf16_bytes)) if dev == "cuda" else 1
    heads = []
    for i in range(copies):
        with torch.device(dev):
            head = ParallelLMHead(n, k).to(dtype)
        head.weight.data.normal_(0, 0.02, generator=torch.Generator(device=dev).manual_seed(i))
        heads.append(head)
    int8 = [quantize_rows_int8(h.weight.data) for h in heads]
    processor = LogitsProcessor(n)
    rows = []
    name = torch.cuda.get_device_name() if dev == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    bw = f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; " if dev == "cuda" else ""
    print(f"# {name}: {bw}head {n} x {k} ({args.dtype}), {copies} copies")
    print(f"{'rows':>6} {'plain us':>10} {'int8 us':>9} {'speed-up':>9} {'int8 GB/s':>10} {'max rel err':>12}")
    for m in args.rows:
        x = (torch.randn(m, k, device=dev) * 2).to(dtype)
        t16 = timer(lambda i: processor._logits(x, heads[i]), copies)  # noqa: B023
        t8 = timer(lambda i: int8_head_logits(x, *int8[i]), copies)  # noqa: B023
        want = processor._logits(x, heads[0])
        got = int8_head_logits(x, *int8[0])
        err = float(((got - want).abs().amax(-1) / want.abs().amax(-1)).max())
        rows.append({"rows": m, "w16_us": t16 * 1e6, "int8_us": t8 * 1e6, "int8_gbs": n * k / t8 / 1e9,
                     "max_rel_err": err, "mid": {}})
        r = rows[-1]
        mid = ""
        for tile in MID_TILES if args.mid and dev == "cuda" and 16 < m <= MAX_M else []:
            cfg = GemvConfig("w8a16", tile[0], tile[2], tile[3], tile[4], block_m=tile[1])
            try:
                t = timer(lambda i: fp8_mid_mm(x, *int8[i], torch.float32, cfg), copies)  # noqa: B023
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit is reported, not fatal
                print(f"  tile {tile}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            r["mid"]["x".join(map(str, tile))] = t * 1e6
        if r["mid"]:
            best = min(r["mid"], key=r["mid"].get)
            mid = f"  mid best {best}: {r['mid'][best]:.1f} us"
        print(f"{m:>6} {r['w16_us']:>10.1f} {r['int8_us']:>9.1f} {t16 / t8:>8.2f}x {r['int8_gbs']:>10.0f} "
              f"{err:>12.2e}{mid}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"device": name, "dtype": args.dtype, "copy_bw_gbs": copy_bw / 1e9, "vocab": n, "hidden": k,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
