"""One MoE layer's expert computation on its own, at real shapes, in CUDA graphs: the sorted grouped-GEMM path
(`fused_moe`) against the two-launch small-batch path (`small_batch_moe`), and block-config sweeps of both.

Weights of `--layers` distinct layers (so that a replay reads HBM, not L2) are cycled through inside one graph; the
time per layer is graph time / layers. Bandwidth is counted on the bytes that must be read: the distinct experts
the tokens chose (+ the shared MLP) — for large batches also the TFLOP/s of the routed GEMMs.

    python benchmarks/bench_moe_kernels.py --shape qwen3-30b-a3b --tokens 1 8 16 --sweep-small
    python benchmarks/bench_moe_kernels.py --shape qwen3-30b-a3b --tokens 256 4096 --sweep-large
    python benchmarks/bench_moe_kernels.py --shape qwen3-30b-a3b --tokens 1 8 --sweep-small --fp8 channel

`--fp8 channel|block` quantises the experts (per output row, or 128 x 128 blocks) and runs the kernels' fp8 (W8A16)
form; a shared MLP is then added by torch in both paths.

Prints a table and writes JSON (`--result-file`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layer_timing import seconds_per_layer  # noqa: E402

from radixserve.layers.moe.fused_moe import MoEConfig, fp8_activations, fused_moe, moe_config  # noqa: E402
from radixserve.layers.moe.methods import ExpertScales  # noqa: E402
from radixserve.layers.moe.small_batch import (  # noqa: E402
    DEFAULT,
    INTERPRETED,
    SmallMoEConfig,
    default_config,
    small_batch_moe,
)

# experts, hidden, intermediate per expert, top-k, shared intermediate (0: none)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8, 0), "deepseek-v2-lite": (64, 2048, 1408, 6, 2816),
          "mixtral-8x7b": (8, 4096, 14336, 2, 0), "tiny": (8, 32, 16, 2, 32)}  # tiny: a CPU check of the script

SMALL_SWEEP = [SmallMoEConfig(32, 128, 64, 128, 4, 4), SmallMoEConfig(16, 256, 32, 256, 4, 3),
               SmallMoEConfig(64, 128, 128, 128, 4, 4), SmallMoEConfig(32, 256, 64, 256, 8, 3),
               SmallMoEConfig(16, 128, 32, 128, 4, 6), SmallMoEConfig(32, 64, 64, 64, 4, 8),
               # the down projection varied alone (gate/up as DEFAULT)
               SmallMoEConfig(32, 128, 32, 128, 4, 4), SmallMoEConfig(32, 128, 32, 256, 4, 3),
               SmallMoEConfig(32, 128, 128, 64, 4, 4), SmallMoEConfig(32, 128, 64, 256, 4, 3),
               SmallMoEConfig(32, 128, 64, 128, 2, 4)]
# fp8 weights (the small path multiplies them on the CUDA cores, `small_batch._fp8_rows`): rows x K columns a step
SMALL_SWEEP_FP8 = [SmallMoEConfig(bn, bk, dn, dk, w, 2) for bn, bk, dn, dk in
                   [(8, 512, 16, 512), (16, 256, 32, 256), (16, 512, 32, 256), (32, 128, 64, 128),
                    (8, 1024, 16, 512), (16, 256, 16, 512), (32, 256, 32, 256), (4, 1024, 8, 1024),
                    (64, 128, 128, 128), (16, 128, 32, 128),
                    # whole rows a step, which the runs-of-8 accumulator (`small_batch._fp8_rows`) has room for
                    (4, 2048, 8, 1024), (8, 2048, 16, 1024), (16, 1024, 32, 512), (8, 1024, 16, 1024)]
                   for w in (2, 4)]
LARGE_SWEEP = [MoEConfig(16, 32, 64, 128, 4, 4), MoEConfig(32, 64, 64, 64, 4, 4), MoEConfig(32, 32, 64, 128, 4, 4),
               MoEConfig(64, 64, 128, 64, 4, 3), MoEConfig(64, 32, 64, 128, 4, 4), MoEConfig(64, 128, 128, 64, 4, 4),
               MoEConfig(128, 128, 128, 64, 8, 3), MoEConfig(128, 64, 128, 64, 4, 3),
               # 32-64 tokens an expert (DeepSeek-V2-Lite at batch 256-512: 64 experts, top-6)
               MoEConfig(32, 128, 128, 64, 4, 3), MoEConfig(64, 128, 128, 64, 8, 3), MoEConfig(32, 64, 128, 128, 4, 3),
               MoEConfig(64, 64, 64, 128, 4, 4),
               # prefill chunks (hundreds to thousands of rows an expert): wider and deeper tiles
               MoEConfig(128, 128, 128, 64, 8, 4), MoEConfig(128, 64, 128, 64, 8, 4),
               MoEConfig(128, 128, 256, 64, 8, 3), MoEConfig(128, 64, 256, 64, 8, 3),
               MoEConfig(128, 128, 128, 32, 8, 5), MoEConfig(64, 128, 256, 64, 8, 3),
               MoEConfig(128, 128, 128, 128, 8, 2)]


def cfg_name(c: Any) -> str:
    return "/".join(str(int(v) if isinstance(v, bool) else v) for v in dataclasses.astuple(c))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sweep-small", action="store_true", help="time every small-path config of SMALL_SWEEP")
    parser.add_argument("--sweep-large", action="store_true", help="time every grouped-GEMM config of LARGE_SWEEP")
    parser.add_argument("--fp8", choices=["none", "channel", "block"], default="none",
                        help="the experts in fp8 with per-row or 128 x 128 block scales")
    parser.add_argument("--fp8-act", choices=["auto", "16"], default="auto",
                        help="fp8 experts, grouped path: activations as fused_moe picks (fp8 for bf16), or 16-bit")
    parser.add_argument("--one-order", action="store_true", help="--sweep-large in the default grid order only")
    parser.add_argument("--copy-bw", type=float, default=4.275e12, help="bytes/s the roofline is counted at")
    parser.add_argument("--result-file", default="bench_moe_kernels.json")
    args = parser.parse_args(argv)
    num_e, hidden, inter, top_k, shared = SHAPES[args.shape]
    cuda = torch.cuda.is_available()
    if not cuda and args.shape != "tiny":
        raise SystemExit("bench_moe_kernels needs a CUDA device (or --shape tiny under TRITON_INTERPRET=1)")
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = [torch.randn(num_e, 2 * inter, hidden, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(args.layers)]
    w2 = [torch.randn(num_e, hidden, inter, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(args.layers)]
    sw13 = [torch.randn(2 * shared, hidden, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(args.layers)] \
        if shared else None
    sw2 = [torch.randn(hidden, shared, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(args.layers)] \
        if shared else None
    scales: list[ExpertScales | None] = [None] * args.layers
    if args.fp8 != "none":
        from radixserve.layers.quantization.fp8 import quantize_blocks, quantize_rows

        def quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if args.fp8 == "channel":
                parts = [quantize_rows(w[e]) for e in range(w.shape[0])]
                return torch.stack([q for q, _ in parts]), torch.stack([sc[:, None] for _, sc in parts])
            parts = [quantize_blocks(w[e], 128, 128) for e in range(w.shape[0])]
            return torch.stack([q for q, _ in parts]), torch.stack([sc for _, sc in parts])

        for layer in range(args.layers):
            (w13[layer], s13), (w2[layer], s2) = quant(w13[layer]), quant(w2[layer])
            scales[layer] = ExpertScales(s13, s2, *((1, hidden, inter) if args.fp8 == "channel" else (128, 128, 128)))
    expert_bytes = 3 * hidden * inter * w13[0].element_size()
    counters = torch.zeros(64 * hidden, dtype=torch.int32, device=dev)  # the small path's, at any block size
    rows: list[dict[str, Any]] = []
    print(f"{args.shape}: {num_e} experts, hidden {hidden}, intermediate {inter}, top-{top_k}, shared {shared}; "
          f"{args.layers} layers cycled; roofline at {args.copy_bw / 1e9:.0f} GB/s")
    print(f"{'tokens':>6} {'path':>6} {'config':<44} {'us/layer':>9} {'experts':>7} {'GB/s':>7} {'roofline':>8} "
          f"{'TFLOP/s':>8} {'max err':>8}")
    for t in args.tokens:
        x = torch.randn(t, hidden, device=dev, dtype=dt, generator=g)
        ids = torch.rand(t, num_e, device=dev, generator=g).topk(top_k, dim=1).indices.to(torch.int32)
        weights = torch.rand(t, top_k, device=dev, generator=g).softmax(dim=1)
        distinct = int(ids.unique().numel())
        nbytes = distinct * expert_bytes + (3 * hidden * shared * 2 if shared else 0)
        flops = 2 * t * (top_k * 3 * hidden * inter + 3 * hidden * shared)

        def shared_torch(layer: int, x: torch.Tensor = x) -> torch.Tensor:
            gu = F.linear(x, sw13[layer])
            return F.linear(F.silu(gu[:, :shared]) * gu[:, shared:], sw2[layer])

        def grouped(layer: int, cfg: MoEConfig | None = None, x: torch.Tensor = x, ids: torch.Tensor = ids,
                    weights: torch.Tensor = weights) -> torch.Tensor:
            out = fused_moe(x, w13[layer], w2[layer], weights, ids, config=cfg, scales=scales[layer],
                            act_fp8=False if args.fp8_act == "16" else None)
            return out + shared_torch(layer) if shared else out

        def small(layer: int, cfg: SmallMoEConfig | None = None, x: torch.Tensor = x, ids: torch.Tensor = ids,
                  weights: torch.Tensor = weights) -> torch.Tensor:
            if scales[layer] is not None:
                out = small_batch_moe(x, w13[layer], w2[layer], weights, ids, 0, config=cfg, counters=counters,
                                      scales=scales[layer])
                return out + shared_torch(layer) if shared else out
            return small_batch_moe(x, w13[layer], w2[layer], weights, ids, 0, sw13[layer] if shared else None,
                                   sw2[layer] if shared else None, config=cfg, counters=counters)

        ref = grouped(0).float()
        a8 = args.fp8_act == "auto" and fp8_activations(scales[0], dt, hidden, inter)
        variants: list[tuple[str, str, Any]] = [("grouped", cfg_name(moe_config(t, top_k, num_e, inter, hidden,
                                                                                     not cuda, fp8=a8)),
                                                 lambda layer: grouped(layer))]
        if args.sweep_large:  # each tile with the grid in both orders (MoEConfig.n_first)
            sweep = [dataclasses.replace(c, n_first=o) for c in LARGE_SWEEP
                     for o in ((True,) if args.one_order else (True, False))]
            variants += [("grouped", cfg_name(c), lambda layer, c=c: grouped(layer, c)) for c in sweep]
        if t <= 64:
            small_default = default_config(scales[0]) if cuda else INTERPRETED
            variants.append(("small", cfg_name(small_default), lambda layer: small(layer)))
            if args.sweep_small:
                sweep = SMALL_SWEEP_FP8 if args.fp8 != "none" else SMALL_SWEEP
                variants += [("small", cfg_name(c), lambda layer, c=c: small(layer, c))
                             for c in sweep if c != DEFAULT]
        for path, name, fn in variants:
            try:
                err = float((fn(0).float() - ref).abs().max())
                sec = seconds_per_layer(fn, args.layers, args.reps)
            except Exception as e:  # a config the compiler rejects (shared memory) is reported, not fatal
                print(f"{t:>6} {path:>6} {name[:44]:<44} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            r = {"tokens": t, "path": path, "config": name, "us_per_layer": sec * 1e6, "distinct_experts": distinct,
                 "gb_s": nbytes / sec / 1e9, "roofline": nbytes / args.copy_bw / sec, "tflops": flops / sec / 1e12,
                 "max_err": err}
            rows.append(r)
            print(f"{t:>6} {path:>6} {name[:44]:<44} {r['us_per_layer']:>9.1f} {distinct:>7} {r['gb_s']:>7.0f} "
                  f"{r['roofline']:>8.1%} {r['tflops']:>8.1f} {err:>8.4f}")
    with open(args.result_file, "w") as f:
        json.dump({"shape": args.shape, "layers": args.layers, "copy_bw": args.copy_bw, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
