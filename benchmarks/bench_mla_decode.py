"""Micro-benchmark of the Triton MLA decode kernel over a latent pool (CUDA only): stage 1's tile / warps / stages and
how many programs per SM the split count aims for, at DeepSeek-V2-Lite's shape (16 heads, latent 512, rotary 64).
Each case is a CUDA graph replayed back to back; bandwidth counts the latent pool bytes read.

    python benchmarks/bench_mla_decode.py --out mla.json --best-env best.env

Every configuration's output is checked against the first one's (a kernel that is fast but wrong is not a
candidate). `--best-env` writes the configuration with the smallest sum over the shapes of (time / that shape's
best time) as RADIXSERVE_MLA_DECODE_CFG and RADIXSERVE_MLA_PROGRAMS_PER_SM lines for a shell to export.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch
from bench_attention_kernels import parse_ints, time_graph


def shapes(text: str) -> list[tuple[int, int]]:
    """'1x1024,512x640' -> [(1, 1024), (512, 640)] (batch x context)."""
    out = []
    for item in text.split(","):
        bs, seq = item.lower().split("x")
        out.append((int(bs), int(seq)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--rank", type=int, default=512, help="kv_lora_rank: the latent, also the value dim")
    p.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim")
    p.add_argument("--shapes", default="1x1024,8x1024,32x1024,128x1024,512x640,512x1300")
    p.add_argument("--block-n", default="32,64")
    p.add_argument("--num-warps", default="4,8")
    p.add_argument("--num-stages", default="1,2,3")
    p.add_argument("--programs-per-sm", default="1,2,4,8")
    p.add_argument("--min-split-len", type=int, default=64)
    p.add_argument("--max-kv-splits", type=int, default=64)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--best-env", help="write the best configuration as shell assignments here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_mla_decode needs a CUDA GPU")

    from radixserve.layers.attention.triton_ops.decode_attention import kv_split_cap, split_capacity
    from radixserve.layers.attention.triton_ops.mla_attention import mla_decode_fwd

    h, c, r = args.heads, args.rank, args.rope
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = list(itertools.product(parse_ints(args.block_n), parse_ints(args.num_warps),
                                     parse_ints(args.num_stages)))
    rows: list[dict] = []
    print(f"{'batch':>5} {'ctx':>5} {'N':>3} {'warps':>5} {'stages':>6} {'pps':>3} {'splits':>6} {'us':>9} "
          f"{'GB/s':>7}")
    for bs, seq in shapes(args.shapes):
        n = bs * seq
        kv = torch.randn(n + 1, 1, c + r, device="cuda", dtype=torch.bfloat16)
        slots = 1 + torch.randperm(n, device="cuda").to(torch.int32)  # scattered, as a pool in use has them
        req_to_token = slots.view(bs, seq).contiguous()
        q = torch.randn(bs, h, c + r, device="cuda", dtype=torch.bfloat16)
        rows_idx = torch.arange(bs, device="cuda")
        lens = torch.full((bs,), seq, device="cuda", dtype=torch.int64)
        scale = (c // 4 + r) ** -0.5
        nbytes = n * (c + r) * kv.element_size()
        reference = None
        for pps in parse_ints(args.programs_per_sm):
            splits = kv_split_cap(bs, h, 1, sms, args.max_kv_splits, pps)
            cap = split_capacity(splits)
            mid_o = torch.empty(bs, h, cap, c, device="cuda")
            mid_lse = torch.empty(bs, h, cap, device="cuda")
            for block_n, warps, stages in configs:
                o = torch.empty(bs, h, c, device="cuda", dtype=torch.bfloat16)

                call = functools.partial(
                    mla_decode_fwd, q, kv, o, req_to_token, rows_idx, lens, mid_o, mid_lse, scale, c, splits,
                    min_split_len=args.min_split_len, block_n=block_n, num_warps=warps, num_stages=stages)
                row = {"batch_size": bs, "seq_len": seq, "block_n": block_n, "num_warps": warps,
                       "num_stages": stages, "programs_per_sm": pps, "splits": splits}
                try:
                    call()
                    torch.cuda.synchronize()
                    if reference is None:
                        reference = o.float().clone()
                    err = (o.float() - reference).abs().max().item()
                    if err > 3e-2:
                        raise RuntimeError(f"differs from the first configuration by {err:.3g}")
                    row["time_us"] = time_graph(call, args.iters) * 1e6
                    row["gb_per_s"] = nbytes / row["time_us"] / 1e3
                except Exception as exc:  # a tile that does not fit shared memory, or a wrong result
                    row["error"] = str(exc).splitlines()[0][:160]
                rows.append(row)
                shown = (f"{row['time_us']:9.1f} {row['gb_per_s']:7.0f}" if "time_us" in row
                         else f"  failed: {row['error'][:60]}")
                print(f"{bs:5d} {seq:5d} {block_n:3d} {warps:5d} {stages:6d} {pps:3d} {splits:6d} {shown}",
                      flush=True)

    ok = [x for x in rows if "time_us" in x]
    best_of_shape = {}
    for x in ok:
        key = (x["batch_size"], x["seq_len"])
        best_of_shape[key] = min(best_of_shape.get(key, float("inf")), x["time_us"])
    score: dict[tuple, float] = {}
    count: dict[tuple, int] = {}
    for x in ok:
        key = (x["block_n"], x["num_warps"], x["num_stages"], x["programs_per_sm"])
        score[key] = score.get(key, 0.0) + x["time_us"] / best_of_shape[(x["batch_size"], x["seq_len"])]
        count[key] = count.get(key, 0) + 1
    complete = {k: v for k, v in score.items() if count[k] == len(best_of_shape)}
    best = min(complete, key=complete.get) if complete else None
    summary = {"best": best, "best_score": complete.get(best) if best else None,
               "shapes": len(best_of_shape)}
    if best:
        print(f"\nbest over {len(best_of_shape)} shapes: BLOCK_N {best[0]}, {best[1]} warps, {best[2]} stages, "
              f"{best[3]} programs per SM (mean {complete[best] / len(best_of_shape):.3f} x each shape's best)")
        for (bs, seq), t in sorted(best_of_shape.items()):
            mine = next(x for x in ok if (x["batch_size"], x["seq_len"]) == (bs, seq)
                        and (x["block_n"], x["num_warps"], x["num_stages"], x["programs_per_sm"]) == best)
            print(f"  {bs:4d} x {seq:5d}: {mine['time_us']:8.1f} us ({mine['gb_per_s']:.0f} GB/s), shape's best "
                  f"{t:8.1f}")
        if args.best_env:
            with open(args.best_env, "w") as f:
                f.write(f"export RADIXSERVE_MLA_DECODE_CFG={best[0]},{best[1]},{best[2]}\n"
                        f"export RADIXSERVE_MLA_PROGRAMS_PER_SM={best[3]}\n")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "args": vars(args), "results": rows,
                       "summary": summary}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
