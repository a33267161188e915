"""Decode and prefill latency of the attention backends at several page sizes, in one process: the model loads once,
then for each (backend, page size) the KV pool, the backend and its CUDA graphs are built again and
`bench_one_batch.latency_test` runs every batch size (a warm-up run first: it also compiles flex's kernels).

    python benchmarks/bench_attention_backends.py --model-path radixserve/configs/shapes/llama-3.1-8b \\
        --load-format dummy --configs triton:1 flex:16 flex:1 triton:16 --batch-size 1 64 160 \\
        --input-len 512 --output-len 32 --max-total-tokens 131072

Only the measured batch sizes are captured as graphs (a captured batch's graph is the same as in serving, where
every size up to --cuda-graph-max-bs is captured). Prints one table row per run as soon as it is measured (a run
cut short keeps what it printed), then each backend's batch-1 decode against the best, and writes JSON."""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from radixserve.bench_one_batch import (
    add_bandwidth,
    latency_test,
    measure_copy_bandwidth,
    print_profile,
    profile_decode,
)
from radixserve.entrypoints.engine import resolve_model
from radixserve.layers.attention import create_attention_backend
from radixserve.model_executor import cuda_graph_runner
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs


def rebuild(runner: ModelRunner, backend: str, page_size: int, batch_sizes: list[int]) -> float:
    """New pools, backend and graphs for (backend, page_size); returns the seconds it took."""
    t0 = time.perf_counter()
    runner.cuda_graph_runner = None
    # captured with the previous backend and pool (their pieces write K/V into its buffers): never replayed after
    runner.prefill_graph_runner = runner.piecewise_graph_runner = None
    runner.attn_backend = None
    runner.token_to_kv_pool = runner.req_to_token_pool = None
    gc.collect()
    if runner.is_cuda:
        torch.cuda.empty_cache()
    runner.server_args.page_size = page_size
    runner.server_args.attention_backend = backend
    runner._init_memory_pool()
    runner.attn_backend = create_attention_backend(backend, runner)
    sizes = sorted(set(batch_sizes))
    original = cuda_graph_runner.capture_batch_sizes
    cuda_graph_runner.capture_batch_sizes = lambda max_bs: [s for s in sizes if s <= max_bs]
    try:  # decode graphs (the measured batch sizes only), one-request prefill and piecewise extend graphs
        runner._init_graphs()
    finally:
        cuda_graph_runner.capture_batch_sizes = original
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--configs", nargs="+", default=["triton:1", "flex:16", "flex:1", "triton:16"],
                        help="backend:page_size runs, in order")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 64, 160])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="also profile decode of every run (CUDA only)")
    parser.add_argument("--result-file", default="bench_attention_backends.json")
    args = parser.parse_args()
    server_args = ServerArgs.from_cli_args(args)
    if server_args.max_running_requests is None:
        server_args.max_running_requests = max(args.batch_size)
    server_args.cuda_graph_max_bs = max(args.batch_size)
    model_config = resolve_model(server_args)
    first_backend, first_page = args.configs[0].split(":")
    server_args.attention_backend, server_args.page_size = first_backend, int(first_page)
    cuda_graph_runner_original = cuda_graph_runner.capture_batch_sizes
    sizes = sorted(set(args.batch_size))
    cuda_graph_runner.capture_batch_sizes = lambda max_bs: [s for s in sizes if s <= max_bs]
    t0 = time.perf_counter()
    runner = ModelRunner(model_config, server_args)
    cuda_graph_runner.capture_batch_sizes = cuda_graph_runner_original
    print(f"model + first backend ready in {time.perf_counter() - t0:.1f} s", flush=True)
    copy_bw = measure_copy_bandwidth(runner.device) if runner.is_cuda else None
    if copy_bw is not None:
        print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; weights {runner.weight_bytes / 1e9:.2f} GB", flush=True)
    results = []
    print(f"{'backend':>8} {'page':>5} {'batch':>6} {'prefill ms':>11} {'decode ms':>10} {'decode tok/s':>13} "
          f"{'BW util':>8}", flush=True)
    for i, cfg in enumerate(args.configs):
        backend, page = cfg.split(":")
        setup_s = 0.0 if i == 0 else rebuild(runner, backend, int(page), args.batch_size)
        for bs in args.batch_size:
            t = time.perf_counter()
            latency_test(runner, bs, args.input_len, 4, server_args.random_seed)  # warm-up (and compiles)
            warm_s = time.perf_counter() - t
            r = latency_test(runner, bs, args.input_len, args.output_len, server_args.random_seed)
            if copy_bw is not None and r["decode_tok_s"]:
                add_bandwidth(r, runner, copy_bw)
            r.update(backend=backend, page_size=int(page), setup_s=setup_s, warmup_s=warm_s)
            results.append(r)
            util = f"{r['bandwidth_util']:.1%}" if "bandwidth_util" in r else "-"
            print(f"{backend:>8} {page:>5} {bs:>6} {r['prefill_latency_s'] * 1e3:>11.2f} "
                  f"{r['median_decode_s'] * 1e3:>10.3f} {r['decode_tok_s'] or 0:>13.1f} {util:>8}  "
                  f"(setup {setup_s:.1f} s, warm-up {warm_s:.1f} s)", flush=True)
            if args.profile and runner.is_cuda:
                r["profile"] = profile_decode(runner, bs, args.input_len, 10, server_args.random_seed, top=8)
                print(f"[{backend}:{page}]", end="")
                print_profile(r["profile"])
    for bs in sorted(set(args.batch_size)):
        rows = [r for r in results if r["batch_size"] == bs]
        best = min(r["median_decode_s"] for r in rows)
        print(f"batch {bs}: " + ", ".join(f"{r['backend']}:{r['page_size']} {r['median_decode_s'] / best - 1:+.1%}"
                                          for r in rows) + " vs the best decode step", flush=True)
    meta = {"model": model_config.model_path, "device": runner.device, "dtype": str(runner.dtype),
            "input_len": args.input_len, "output_len": args.output_len,
            "copy_bw_gbs": copy_bw / 1e9 if copy_bw else None}
    with open(args.result_file, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"wrote {args.result_file}")


if __name__ == "__main__":
    main()
