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

from radixserve.bench_one_batch import warm_graph_decode
from radixserve.server_args import ServerArgs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    runner, sb, batch = warm_graph_decode(ServerArgs.from_cli_args(args), "decode_host_profile")
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
