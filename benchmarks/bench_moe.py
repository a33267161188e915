"""Batch decode latency of an MoE / MLA model with bandwidth utilisation counted on the bytes a step actually reads:
the weights every token passes through (attention, dense and shared MLPs, router, norms, LM head; not the
embedding table, of which a step reads B rows), the routed experts the batch touches (distinct experts per layer,
counted from the router's choices in one eager decode step of the same batch), and the KV of every token attended.

    python benchmarks/bench_moe.py --model-path radixserve/configs/shapes/qwen3-30b-a3b --load-format dummy \\
        --batch-size 1 8 32 128 --input-len 512 --output-len 32 --result-file moe.json

Prints a table (step ms, tok/s, active GB per step, roofline ms at the measured copy bandwidth, utilisation) and
writes JSON."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.bench_one_batch import (  # noqa: E402
    latency_test,
    measure_copy_bandwidth,
    print_profile,
    profile_decode,
    profile_prefill,
)
from radixserve.model_executor.model_runner import ModelRunner  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402
from radixserve.step_bytes import distinct_experts, moe_step_bytes  # noqa: E402


def steps_recaptured(runner: ModelRunner, batch_sizes: list[int], input_len: int, output_len: int, seed: int,
                     switch: Callable[[bool], None]) -> dict[int, float]:
    """Decode step (seconds) at each batch size with `switch(False)`, the CUDA graphs captured again that way;
    `switch(True)` after. The graphs are left as captured here: run this last (a later comparison recaptures)."""
    from radixserve.model_executor.cuda_graph_runner import CudaGraphRunner

    switch(False)
    try:
        if runner.cuda_graph_runner is not None:
            runner.cuda_graph_runner = None
            torch.cuda.empty_cache()
            runner.cuda_graph_runner = CudaGraphRunner(runner)
        steps = {}
        for bs in batch_sizes:
            latency_test(runner, bs, input_len, 4, seed)
            steps[bs] = latency_test(runner, bs, input_len, output_len, seed)["median_decode_s"]
        return steps
    finally:
        switch(True)


def decode_gemv_switch(on: bool) -> None:
    """The one-row attention products through `decode_gemv` (on) or cuBLAS with the input norm on its own (off)."""
    from radixserve.layers.triton_ops import set_decode_gemv

    set_decode_gemv(on)


def mla_prep_switch(on: bool) -> None:
    """MLA's fused preparation at every batch size (on) or only up to 16 tokens, torch ops beyond (off)."""
    from radixserve.models import deepseek_v2

    deepseek_v2.FUSED_PREP_TOKENS = None if on else 16


COMPARISONS = {  # flag -> (switch, which batch sizes it changes)
    "decode_gemv": (decode_gemv_switch, lambda bs: bs == 1),
    "mla_prep": (mla_prep_switch, lambda bs: bs > 16),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--result-file", default="bench_moe.json")
    parser.add_argument("--profile", action="store_true",
                        help="also profile decode at each batch size (CUDA): kernels per step and the top kernels")
    parser.add_argument("--profile-top", type=int, default=30)
    parser.add_argument("--profile-prefill", type=int, nargs=2, default=None, metavar=("BATCH", "LEN"),
                        help="also profile one prefill of BATCH prompts of LEN tokens (CUDA)")
    parser.add_argument("--moe-small-batch-tokens", type=int, default=None,
                        help="tokens up to which the MoE layers take the two-launch small-batch path "
                             "(0: never; default: the layer's own bound)")
    parser.add_argument("--compare", nargs="+", default=[], choices=sorted(COMPARISONS),
                        help="after the table (and profiles), the batch sizes a switch changes again with it off "
                             "(CUDA graphs captured again): decode_gemv (batch 1: one-row attention products on "
                             "cuBLAS), mla_prep (batches over 16: MLA's preparation in torch ops); the same process "
                             "and weights, for the before/after")
    parser.add_argument("--no-decode-gemv", action="store_true",
                        help="one-row attention products through cuBLAS (and the input norm on its own), not the "
                             "decode GEMV kernel (for comparisons)")
    args = parser.parse_args(argv)
    if args.no_decode_gemv:
        from radixserve.layers.triton_ops import set_decode_gemv

        set_decode_gemv(False)
    if args.moe_small_batch_tokens is not None:
        from radixserve.layers.moe import small_batch

        small_batch.SMALL_BATCH_TOKENS = args.moe_small_batch_tokens
        small_batch.SMALL_BATCH_TOKENS_FP8 = small_batch.SMALL_BATCH_TOKENS_FP8_DOT = args.moe_small_batch_tokens
    server_args = ServerArgs.from_cli_args(args)
    if server_args.max_running_requests is None:
        server_args.max_running_requests = max(args.batch_size + (args.profile_prefill or [0])[:1])
    logging.basicConfig(level=server_args.log_level.upper())
    from radixserve.entrypoints.engine import resolve_model

    runner = ModelRunner(resolve_model(server_args), server_args)
    copy_bw = measure_copy_bandwidth(runner.device) if runner.is_cuda else float("nan")
    rows = []
    for bs in args.batch_size:
        latency_test(runner, bs, args.input_len, 4, server_args.random_seed)  # warm-up
        r = latency_test(runner, bs, args.input_len, args.output_len, server_args.random_seed)
        r.update(moe_step_bytes(runner, r, distinct_experts(runner, bs, args.input_len, server_args.random_seed)))
        r["roofline_s"] = r["step_bytes"] / copy_bw
        r["bandwidth_util"] = r["roofline_s"] / r["median_decode_s"]
        rows.append(r)
        print(f"batch {bs}: step {r['median_decode_s'] * 1e3:.3f} ms, roofline {r['roofline_s'] * 1e3:.3f} ms, "
              f"BW util {r['bandwidth_util']:.1%}", flush=True)  # as measured: survives a timeout later on
    name = Path(runner.model_config.model_path).name
    print(f"\n{name}: weights {runner.weight_bytes / 1e9:.2f} GB, copy bandwidth {copy_bw / 1e9:.0f} GB/s, "
          f"KV {runner.token_to_kv_pool.bytes_per_token()} B/token, pool {runner.max_total_num_tokens} tokens")
    print(f"{'batch':>5} {'prefill ms':>10} {'step ms':>8} {'tok/s':>8} {'experts/layer':>13} {'active GB':>9} "
          f"{'roofline ms':>11} {'BW util':>7}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['prefill_latency_s'] * 1e3:>10.1f} {r['median_decode_s'] * 1e3:>8.3f} "
              f"{r['decode_tok_s']:>8.0f} {r['experts_hit_per_layer']:>13.1f} {r['step_bytes'] / 1e9:>9.3f} "
              f"{r['roofline_s'] * 1e3:>11.3f} {r['bandwidth_util']:>7.1%}")
    profiles = []
    if args.profile and runner.is_cuda:
        for bs in args.batch_size:
            profiles.append(profile_decode(runner, bs, args.input_len, 10, server_args.random_seed,
                                           top=args.profile_top))
            print_profile(profiles[-1])
    if args.profile_prefill and runner.is_cuda:
        profiles.append(profile_prefill(runner, *args.profile_prefill, server_args.random_seed, top=args.profile_top))
        print_profile(profiles[-1])
    compare: dict[str, dict[int, float]] = {}
    for name in args.compare:  # on the CPU too (no graphs there): checks the script
        switch, changed = COMPARISONS[name]
        sizes = [bs for bs in args.batch_size if changed(bs)]
        try:
            compare[name] = steps_recaptured(runner, sizes, args.input_len, args.output_len,
                                             server_args.random_seed, switch)
        except Exception as e:  # noqa: BLE001 - the main table is printed already; report and write the JSON
            print(f"comparison without {name} failed: {type(e).__name__}: {e}")
            continue
        for bs, off in compare[name].items():
            on = next(r for r in rows if r["batch_size"] == bs)["median_decode_s"]
            print(f"batch {bs}: with {name} {on * 1e3:.3f} ms, without {off * 1e3:.3f} ms ({off / on:.3f}x)",
                  flush=True)
    meta = {"model": runner.model_config.model_path, "device": runner.device, "dtype": str(runner.dtype),
            "weight_bytes": runner.weight_bytes, "copy_bw": copy_bw,
            "kv_bytes_per_token": runner.token_to_kv_pool.bytes_per_token(),
            "pool_tokens": runner.max_total_num_tokens}
    with open(args.result_file, "w") as f:
        json.dump({"meta": meta, "results": rows, "profiles": profiles, "without": compare},
                  f, indent=2)


if __name__ == "__main__":
    main()
