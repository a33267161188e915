"""What LoRA adds to a decode or prefill step's projections, without the rest of the model: the four LoRA-carrying
linear layers of every layer (qkv, o, gate_up, down) at a model's shapes, replayed as one CUDA graph per mode, for
several batch sizes (rows spread evenly over the adapter slots; batch 1 uses one):

  base      the four base GEMMs a layer
  separate  base GEMMs + a shrink and an expand kernel per layer (8 LoRA kernels a layer)
  stacked   GEMMs over [W; every slot's A] + one expand kernel per layer (4 LoRA kernels a layer)
  sep-only / exp-only   the LoRA kernels alone (their own time, without the GEMMs)

    python benchmarks/bench_lora_kernels.py --model-path radixserve/configs/shapes/llama-3.1-8b \
        --batch-size 1 32 128 2048 --result-file lora_kernels.json

Every layer has its own weights (the GEMMs read HBM, not L2). Before timing, the stacked and separate paths are
checked against a float32 torch reference at these shapes. Prints a table (ms per step of all layers); writes
JSON. CUDA only."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from layer_timing import capture_graph, replay_seconds

from radixserve.lora import triton_ops
from radixserve.lora.batch_info import LoRABatchInfo, group_rows
from radixserve.lora.ops import lora_delta_torch
from radixserve.lora.triton_ops import lora_expand_stacked, lora_shrink_expand

DEV = "cuda"


def shapes(model_path: str) -> tuple[list[tuple[str, int, list[tuple[int, int]]]], int]:
    """(name, input size, output slices) of the four LoRA groups of one layer, and the number of layers."""
    import transformers as tf

    c = tf.AutoConfig.from_pretrained(model_path)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, i = c.num_attention_heads * hd, c.num_key_value_heads * hd, c.intermediate_size
    return [("qkv", c.hidden_size, [(0, q), (q, kv), (q + kv, kv)]), ("o", q, [(0, c.hidden_size)]),
            ("gate_up", c.hidden_size, [(0, i), (i, i)]), ("down", i, [(0, c.hidden_size)])], c.num_hidden_layers


def graph_time(fn, iters: int) -> float:
    """Median ms of one replay of a CUDA graph of `fn` (on the CPU, of one call: a dry run of this script)."""
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    g = capture_graph(fn, warmup=2)
    times = replay_seconds(g, iters)
    del g
    return statistics.median(times) * 1e3


def check(layer_shapes, S: int, R: int) -> list[str]:
    """The stacked and separate paths against float32 torch at these shapes (bf16, mixed slots and base rows)."""
    lines = []
    mismatches: list[str] = []
    for name, K, sl in layer_shapes:
        N, n_sub = sum(n for _, n in sl), len(sl)
        for rows in (1, 37, 300):
            g = torch.Generator(device=DEV).manual_seed(rows)
            w = (torch.randn(N, K, device=DEV, generator=g) / K ** 0.5).bfloat16()
            a = (torch.randn(S, n_sub * R, K, device=DEV, generator=g) / K ** 0.5).bfloat16()
            b = (torch.randn(S, N, R, device=DEV, generator=g) * 0.05).bfloat16()
            x = torch.randn(rows, K, device=DEV, generator=g).bfloat16()
            slots = torch.randint(-1, S, (rows,), generator=torch.Generator().manual_seed(rows)).tolist()
            packed, groups, max_len = group_rows(slots, None, S)
            info = LoRABatchInfo(S, num_groups=len(groups), max_group_len=max_len, packed=packed.to(DEV))
            scal = torch.full((S,), 2.0, device=DEV)
            ref = x.float() @ w.float().T
            lora_delta_torch(x.float(), ref, a.float(), b.float(), sl,
                             [(s, r.to(DEV) if isinstance(r, torch.Tensor) else r) for s, r in groups], [R] * S,
                             [2.0] * S)
            y = x @ torch.cat([w, a.reshape(-1, K)]).T
            stacked = lora_expand_stacked(y, b, scal, sl, *info.views()[3:], info.num_rows)
            sep = x @ w.T
            lora_shrink_expand(x, sep, a, b, scal, sl, info.views(), info.num_groups, info.max_group_len)
            e1 = (stacked.float() - ref).abs().max().item()
            e2 = (sep.float() - ref).abs().max().item()
            scale = ref.abs().max().item()
            ok = e1 <= 2e-2 * scale and e2 <= 2e-2 * scale
            if not ok:
                mismatches.append(name)
            lines.append(f"check {name:8s} rows={rows:4d}: max |err| stacked {e1:.3g} separate {e2:.3g} "
                         f"(|ref| max {scale:.3g}) {'ok' if ok else 'MISMATCH'}")
    if mismatches:
        lines.append(f"CHECK FAILED for {sorted(set(mismatches))}")
    return lines


_UNSPEC = None


def _unspecialized():
    """The stacked expand compiled as before 2026-11-30 evening: sizes and strides not specialised (Triton then
    cannot prove 16-byte alignment of a row and loads and stores one element at a time) - for comparison."""
    global _UNSPEC
    if _UNSPEC is None:
        import triton

        _UNSPEC = triton.jit(do_not_specialize=["num_rows", "N", "stride_y", "stride_out", "shrink_col", "slot_cols",
                                                "off1", "off2"])(triton_ops._expand_stacked_kernel.fn)
    return _UNSPEC


def time_batch(bs: int, layers: list[dict], layer_shapes: list, scal: torch.Tensor, args: argparse.Namespace
               ) -> dict[str, float]:
    """ms of one graph replay per mode at batch `bs`."""
    S, dt = args.slots, torch.bfloat16
    slots = [0] if bs == 1 else [i % S for i in range(bs)]
    packed, groups, max_len = group_rows(slots, None, S)
    info = LoRABatchInfo(S, num_groups=len(groups), max_group_len=max_len, packed=packed.to(DEV))
    views = info.views()
    xs = {K: torch.randn(bs, K, dtype=dt, device=DEV) for K in {k for _, k, _ in layer_shapes}}
    ys = {name: xs[K] @ layers[0][name][0].T for name, K, _ in layer_shapes}
    outs = {name: torch.empty(bs, sum(n for _, n in sl), dtype=dt, device=DEV) for name, _, sl in layer_shapes}

    def base():
        for d in layers:
            for name, K, _ in layer_shapes:
                F.linear(xs[K], d[name][1])

    def separate():
        for d in layers:
            for name, K, sl in layer_shapes:
                _, w, a, b, _ = d[name]
                out = F.linear(xs[K], w)
                lora_shrink_expand(xs[K], out, a, b, scal, sl, views, info.num_groups, info.max_group_len)

    def stacked():
        for d in layers:
            for name, K, sl in layer_shapes:
                ext, _, _, b, _ = d[name]
                lora_expand_stacked(F.linear(xs[K], ext), b, scal, sl, views[3], views[4], info.num_rows)

    def sep_only():
        for d in layers:
            for name, K, sl in layer_shapes:
                _, _, a, b, _ = d[name]
                lora_shrink_expand(xs[K], outs[name], a, b, scal, sl, views, info.num_groups, info.max_group_len)

    def exp_only():
        for d in layers:
            for name, _, sl in layer_shapes:
                lora_expand_stacked(ys[name], d[name][3], scal, sl, views[3], views[4], info.num_rows)

    fns = {"base": base, "separate": separate, "stacked": stacked, "sep-only": sep_only, "exp-only": exp_only}
    for cfg in args.expand_configs or ():
        bm, bn, w, mixed = (int(v) for v in cfg.rstrip("u").split("x"))
        kernel = _unspecialized() if cfg.endswith("u") else triton_ops._expand_stacked_kernel

        for group, _, sl in layer_shapes:  # each projection on its own: the best configuration may differ
            def exp_cfg(c=(bm, bn, w, bool(mixed)), kernel=kernel, group=group, sl=sl):
                own, triton_ops._expand_stacked_kernel = triton_ops._expand_stacked_kernel, kernel
                try:
                    for d in layers:
                        lora_expand_stacked(ys[group], d[group][3], scal, sl, views[3], views[4], info.num_rows,
                                            config=c)
                finally:
                    triton_ops._expand_stacked_kernel = own

            fns[f"exp-{cfg}:{group}"] = exp_cfg
    row = {}
    for m in [*args.modes, *(f"exp-{c}:{g}" for c in args.expand_configs or () for g, _, _ in layer_shapes)]:
        try:
            row[m] = graph_time(fns[m], args.iters)
        except Exception as e:  # noqa: BLE001 - report and go on with the other modes
            print(f"  {m} at batch {bs} failed: {type(e).__name__}: {e}", flush=True)
            row[m] = float("nan")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 32, 128, 2048])
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=None, help="layers to replay (default: the model's)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--modes", nargs="+", default=["base", "separate", "stacked", "sep-only", "exp-only"])
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--expand-configs", nargs="*", default=None, metavar="BMxBNxWARPSxMIXED",
                   help="also time the stacked expand alone with these configurations, e.g. 16x64x4x1 (a trailing "
                        "u: the kernel without its size and stride specialisation)")
    p.add_argument("--groups", nargs="*", default=None, help="only these projections (qkv, o, gate_up, down)")
    p.add_argument("--result-file", default="bench_lora_kernels.json")
    p.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1 (tiny shapes)")
    args = p.parse_args()
    global DEV
    DEV = args.device
    layer_shapes, num_layers = shapes(args.model_path)
    if args.groups:
        layer_shapes = [x for x in layer_shapes if x[0] in args.groups]
    L = args.layers or num_layers
    S, R = args.slots, args.rank
    if not args.skip_check:
        for line in check(layer_shapes, S, R):
            print(line, flush=True)
    dt = torch.bfloat16
    # per layer and group: the stacked buffer [W; A] (the base weight is a view of it), the separate A, and B
    layers = []
    for _ in range(L):
        d = {}
        for name, K, sl in layer_shapes:
            N, n_sub = sum(n for _, n in sl), len(sl)
            ext = torch.empty(N + S * n_sub * R, K, dtype=dt, device=DEV)
            ext[N:].normal_(0, K ** -0.5)
            a = ext[N:].view(S, n_sub * R, K).clone()
            b = torch.randn(S, N, R, dtype=dt, device=DEV) * 0.05
            d[name] = (ext, ext[:N], a, b, sl)
        layers.append(d)
    scal = torch.full((S,), 2.0, device=DEV)
    results: dict = {"args": vars(args), "ms_per_step": {}}
    print(f"\n{L} layers, {S} slots of rank {R}: ms per step (all layers' four LoRA projections)", flush=True)
    print(f"{'batch':>6}" + "".join(f"{m:>11}" for m in args.modes) + f"{'sep/base':>10}{'stk/base':>10}")
    for bs in args.batch_size:
        row = time_batch(bs, layers, layer_shapes, scal, args)
        results["ms_per_step"][str(bs)] = row
        ratios = "".join(f"{row[m] / row['base']:>10.3f}" for m in ("separate", "stacked")
                         if "base" in row and m in row)
        print(f"{bs:>6}" + "".join(f"{row[m]:>11.3f}" for m in args.modes) + ratios, flush=True)
        for cfg in args.expand_configs or ():  # ms of the stacked expand alone, per projection, all layers
            print(f"{'':>6}  expand {cfg:<14}" + "".join(f" {g}={row[f'exp-{cfg}:{g}']:.3f}"
                                                         for g, _, _ in layer_shapes), flush=True)
    with open(args.result_file, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
