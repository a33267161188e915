"""Host-side calls of a synchronous batch-1 decode step (bench_one_batch's loop) under the torch profiler.

    python benchmarks/decode_host_profile.py --model-path radixserve/configs/shapes/llama-3.1-8b --load-format dummy

Prints the host time of `CUDAGraph.replay()` alone (the GPU idle before each call), then the CPU-activity profile
of 50 decode steps of one 512-token request: per aten op and CUDA runtime call, calls and microseconds per step
(the profiler's own overhead included, so the sizes are relative). `benchmarks/decode_step_phases.py` gives the
same step cut into phases without the profiler."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve.bench_one_batch import StaticBatch
from radixserve.entrypoints.engine import resolve_model
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    if not torch.cuda.is_available():
        raise SystemExit("decode_host_profile needs CUDA")
    if server_args.max_running_requests is None:
        server_args.max_running_requests = 8
    runner = ModelRunner(resolve_model(server_args), server_args)
    if runner.cuda_graph_runner is None:
        raise SystemExit("decode_host_profile measures a graph replay: run it without --disable-cuda-graph")
    sb = StaticBatch(runner)
    batch, _ = sb.prefill([[i % 1000 + 5 for i in range(512)]])
    for _ in range(30):
        sb.decode(batch)
    torch.cuda.synchronize()
    graph = runner.cuda_graph_runner.graphs[1]
    calls = []
    for _ in range(100):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        calls.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    print(f"graph.replay() host call alone: median {statistics.median(calls) * 1e6:.1f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            sb.decode(batch)
            sb._sync()
    sb.release(batch)
    rows = sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)
    print(f"{'name':60} {'calls/step':>10} {'us/step':>9} {'us/call':>8}")
    for e in rows[:args.top]:
        print(f"{e.key[:60]:60} {e.count / args.steps:10.1f} {e.cpu_time_total / args.steps:9.1f} "
              f"{e.cpu_time_total / max(1, e.count):8.1f}")


if __name__ == "__main__":
    main()
