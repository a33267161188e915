"""Micro-benchmark of the Triton attention kernels (CUDA only).

Decode: time of both stages vs batch size and sequence length, and the KV bandwidth achieved (bytes of K and V read,
plus the req_to_token entries, over the kernel time). Extend: time and TFLOP/s of a few prefill shapes.
Each case is captured in a CUDA graph and replayed, so launch overhead is left out.

    python benchmarks/bench_attention_kernels.py --out results.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable

import torch
from layer_timing import capture_graph, replay_seconds


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def time_graph(fn: Callable[[], object], iters: int) -> float:
    """Mean seconds of one call of fn, replayed from a CUDA graph."""
    return replay_ms(capture_graph(fn, warmup=3), iters) / 1e3


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    """Mean milliseconds of one replay of a captured graph, replayed `iters` times back-to-back (after 3 untimed
    replays), timed with CUDA events."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return replay_seconds(graph, 1, iters)[0] * 1e3 / iters


def make_kv(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seq_lens: list[int],
            shuffled: bool, context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k_buf = torch.randn(num_tokens + 1, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    v_buf = torch.randn(num_tokens + 1, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    slots = torch.arange(1, num_tokens + 1, device="cuda", dtype=torch.int32)
    if shuffled:
        slots = slots[torch.randperm(num_tokens, device="cuda")]
    req_to_token = torch.zeros(len(seq_lens), context, dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(seq_lens):
        req_to_token[i, :n] = slots[start:start + n]
        start += n
    return k_buf, v_buf, req_to_token


def bench_decode(args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    from radixserve.layers.attention.triton_ops.decode_attention import (
        ONE_LAUNCH,
        PROGRAMS_PER_SM,
        decode_attention_fwd,
        decode_partial_shapes,
        kv_split_cap,
        new_decode_counters,
        one_launch_pays,
    )

    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # with counters a split batch merges in stage 1's launch (no stage 2); None: where the backend would
    one_launch = [bool(x) for x in parse_ints(args.one_launch)] if args.one_launch else [None]
    rows = []
    for bs in parse_ints(args.batch_sizes):
        for seq_len in parse_ints(args.seq_lens):
            if bs * seq_len > args.max_tokens:
                continue
            seq_lens = [seq_len] * bs
            k_buf, v_buf, req_to_token = make_kv(bs * seq_len, hkv, d, dtype, seq_lens, not args.contiguous,
                                                 seq_len)
            if args.kv_dtype != "auto":
                kv_dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[args.kv_dtype]
                k_buf, v_buf = k_buf.to(kv_dtype), v_buf.to(kv_dtype)
            q = torch.randn(bs, h, d, device="cuda", dtype=dtype)
            o = torch.empty_like(q)
            rpi = torch.arange(bs, device="cuda", dtype=torch.int64)
            sl = torch.tensor(seq_lens, device="cuda", dtype=torch.int64)
            caps = sorted({kv_split_cap(bs, h, hkv, sms, m, pps) for m in parse_ints(args.max_kv_splits)
                           for pps in parse_ints(args.programs_per_sm) or [PROGRAMS_PER_SM]})
            tiles = [{}]
            if args.block_n or args.num_stages or args.num_warps or args.heads_first or args.fp8_v_pairs:
                tiles = [{"block_n": bn, "num_stages": st, "num_warps": nw, "heads_first": bool(hf),
                          "fp8_v_pairs": bool(vp)}
                         for bn in parse_ints(args.block_n or "64") for st in parse_ints(args.num_stages or "2")
                         for nw in parse_ints(args.num_warps or "4") for hf in parse_ints(args.heads_first or "1")
                         for vp in parse_ints(args.fp8_v_pairs or "0")]
            for cap, tile, one in ((c, t, ol) for c in caps for t in tiles for ol in one_launch):
                if one is None:
                    one = ONE_LAUNCH and one_launch_pays(h // hkv, cap)
                shape_o, shape_lse = decode_partial_shapes(bs, h, d, cap)
                mid_o = torch.empty(shape_o, device="cuda", dtype=torch.float32)
                mid_lse = torch.empty(shape_lse, device="cuda", dtype=torch.float32)
                counters = new_decode_counters(bs, h, "cuda") if one else None

                run = functools.partial(decode_attention_fwd, q, k_buf, v_buf, o, req_to_token, rpi, sl, mid_o,
                                        mid_lse, d ** -0.5, min_split_len=args.min_split_len,
                                        use_dot={"auto": None, "on": True, "off": False}[args.decode_dot],
                                        num_kv_splits=cap, counters=counters, **tile)
                secs = time_graph(run, args.iters)
                kv_bytes = bs * seq_len * hkv * d * 2 * k_buf.element_size() + bs * seq_len * 4
                row = {"kernel": "decode", "batch_size": bs, "seq_len": seq_len, "heads": h, "kv_heads": hkv,
                       "head_dim": d, "dtype": str(k_buf.dtype).removeprefix("torch."), "kv_splits": cap, **tile,
                       "one_launch": one, "time_us": secs * 1e6, "kv_read_gb_per_s": kv_bytes / secs / 1e9}
                rows.append(row)
                print(f"decode  bs={bs:4d} seq={seq_len:6d} splits={cap:3d} {str(k_buf.dtype)[6:]:>13} "
                      f"{' '.join(f'{a}={b}' for a, b in tile.items()):<22} one_launch={int(one)} "
                      f"{row['time_us']:9.1f} us  {row['kv_read_gb_per_s']:8.0f} GB/s", flush=True)
            del k_buf, v_buf, req_to_token
            torch.cuda.empty_cache()
    return rows


def bench_extend(args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    from radixserve.layers.attention.triton_ops.extend_attention import extend_attention_fwd

    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    configs: list[tuple[int, ...] | None] = [None]
    if args.extend_configs:
        configs = [tuple(parse_ints(c)) for c in args.extend_configs.split(";")]
    rows = []
    for bs, prefix_len, extend_len in ((1, 0, 4096), (1, 0, 16384), (4, 3072, 1024), (16, 0, 1024),
                                       (8, 8000, 128)):
        seq_lens = [prefix_len + extend_len] * bs
        k_buf, v_buf, req_to_token = make_kv(bs * seq_lens[0], hkv, d, dtype, seq_lens, not args.contiguous,
                                             seq_lens[0])
        t = bs * extend_len
        q = torch.randn(t, h, d, device="cuda", dtype=dtype)
        k = torch.randn(t, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(t, hkv, d, device="cuda", dtype=dtype)
        o = torch.empty_like(q)
        dev = dict(device="cuda", dtype=torch.int64)
        rpi = torch.arange(bs, **dev)
        pre = torch.full((bs,), prefix_len, **dev)
        ext = torch.full((bs,), extend_len, **dev)
        start = torch.arange(bs, **dev) * extend_len

        pairs = bs * (extend_len * prefix_len + extend_len * (extend_len + 1) // 2)
        flops = 4 * pairs * h * d
        for config in configs:
            tiles = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), config, strict=True)) if config else {}
            run = functools.partial(extend_attention_fwd, q, k, v, o, k_buf, v_buf, req_to_token, rpi, pre, ext,
                                    start, extend_len, d ** -0.5, **tiles)
            secs = time_graph(run, max(3, args.iters // 10))
            row = {"kernel": "extend", "batch_size": bs, "prefix_len": prefix_len, "extend_len": extend_len,
                   "heads": h, "kv_heads": hkv, "head_dim": d, "dtype": str(dtype).removeprefix("torch."),
                   "tiles": tiles or "default", "time_us": secs * 1e6, "tflops": flops / secs / 1e12}
            rows.append(row)
            print(f"extend  bs={bs:3d} prefix={prefix_len:5d} extend={extend_len:5d} tiles={config or 'default'}  "
                  f"{row['time_us']:10.1f} us  {row['tflops']:6.1f} TFLOP/s", flush=True)
        del k_buf, v_buf, req_to_token
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    p.add_argument("--seq-lens", default="512,2048,8192,32768")
    p.add_argument("--max-tokens", type=int, default=4_000_000, help="skip decode cases with more KV tokens")
    p.add_argument("--max-kv-splits", default="64", help="comma-separated ceilings on the splits to compare")
    p.add_argument("--programs-per-sm", default="", help="comma-separated split targets to compare (default: the "
                   "engine's, decode_attention.PROGRAMS_PER_SM)")
    p.add_argument("--extend-configs", default="", help="'BLOCK_M,BLOCK_N,WARPS,STAGES;...' to compare "
                                                        "(default: the kernel's own choice)")
    p.add_argument("--min-split-len", type=int, default=64)
    p.add_argument("--decode-dot", choices=["auto", "on", "off"], default="auto",
                   help="force the tl.dot (on) or elementwise (off, MHA only) decode path")
    p.add_argument("--contiguous", action="store_true", help="lay each request's KV out contiguously "
                                                              "(default: slots shuffled, as after many frees)")
    p.add_argument("--kv-dtype", choices=["auto", "fp8_e4m3", "fp8_e5m2"], default="auto",
                   help="decode: the KV pool's dtype (auto: --dtype); q stays in --dtype")
    p.add_argument("--block-n", default="", help="decode: comma-separated tokens per loop step to compare")
    p.add_argument("--num-stages", default="", help="decode: comma-separated pipeline depths to compare")
    p.add_argument("--num-warps", default="", help="decode: comma-separated warps per program to compare")
    p.add_argument("--heads-first", default="", help="decode: '0,1' compares the two grid orders of stage 1")
    p.add_argument("--fp8-v-pairs", default="", help="decode over an fp8 pool: '0,1' compares V's tile read byte-wise "
                   "and as words widened in token pairs")
    p.add_argument("--one-launch", default="", help="decode: '0,1' compares stage 2 as a second launch with the "
                   "splits merged in stage 1's launch (default: where the backend would, one_launch_pays)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--skip-extend", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention_kernels.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    t0 = time.time()
    rows = bench_decode(args, dtype)
    if not args.skip_extend:
        rows += bench_extend(args, dtype)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "args": vars(args), "results": rows,
              "wall_s": time.time() - t0}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
