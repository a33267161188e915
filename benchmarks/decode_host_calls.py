"""Host time of each call in a synchronised decode step (batch 1 unless --batch-size), and of a few single
operations in a tight loop.

    python benchmarks/decode_host_calls.py --model-path radixserve/configs/shapes/llama-3.1-8b --load-format dummy \
        --cuda-graph-max-bs 8 --prefill-cuda-graph-max-tokens 0 --piecewise-cuda-graph-max-tokens 0

Part one times small host operations a decode step is made of (numpy array, tensor views, pinning, a pinned
host-to-device copy, a device tensor's `tolist`) 2,000 times each in a tight loop, and one decode graph's replay.
Part two wraps a timer around each call of interest (prepare_for_decode and inside it the KV allocator and the
request-table mirror write, get_model_worker_batch, ForwardBatch.init_new, the forward call and inside it the graph
runner's replay, the attention backend's replay hook and CUDAGraph.replay, the sample) and runs 300 synchronised
steps. Prints medians in microseconds; the wrappers add their own time to each figure."""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.bench_one_batch import median_call_us, warm_graph_decode  # noqa: E402
from radixserve.model_executor.forward_batch_info import ForwardBatch  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402


def tight(name: str, fn: Callable[[], Any], n: int = 2000) -> None:
    print(f"{name:48} {median_call_us(fn, n, warmup=50):8.2f} us", flush=True)


def single_ops(dev: str) -> None:
    a = np.array([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], dtype=np.int64)
    t = torch.from_numpy(a)
    pinned = torch.empty((5, 2), dtype=torch.int64, pin_memory=True)
    d = pinned.to(dev)
    one = torch.zeros(1, dtype=torch.int64, device=dev)
    tight("np.array 5x2 from lists", lambda: np.array([[1, 0], [2, 0], [3, 0], [3, 0], [3, 0]], dtype=np.int64))
    tight("torch.from_numpy", lambda: torch.from_numpy(a))
    tight("cpu unbind(0)", lambda: t.unbind(0))
    tight("cpu t[:, :1]", lambda: t[:, :1])
    tight("cpu .numpy()", lambda: t.numpy())
    tight("pageable.pin_memory()", lambda: t.pin_memory())
    tight("pageable.is_pinned()", lambda: t.is_pinned())
    tight("torch.empty pinned 5x2", lambda: torch.empty((5, 2), dtype=torch.int64, pin_memory=True))
    tight("pinned.to(cuda, non_blocking)", lambda: pinned.to(dev, non_blocking=True))
    tight("pageable.to(cuda, non_blocking)", lambda: t.to(dev, non_blocking=True))
    tight("cuda unbind(0)", lambda: d.unbind(0))
    tight("cuda d[:, :1]", lambda: d[:, :1])
    tight("cuda 1-element tolist (GPU idle)", lambda: one.tolist())
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=1, help="requests decoded together (a captured size)")
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    if torch.cuda.is_available():
        single_ops("cuda")
    runner, sb, batch = warm_graph_decode(server_args, "decode_host_calls", batch_size=args.batch_size)
    cgr = runner.cuda_graph_runner
    graph = cgr.graphs[min(b for b in cgr.capture_bs if b >= args.batch_size)]
    tight("graph.replay() then sync (whole graph)", lambda: (graph.replay(), torch.cuda.synchronize()), n=100)

    acc: dict[str, list[float]] = {}

    def wrap(obj: Any, name: str, label: str) -> None:
        f = getattr(obj, name)

        @functools.wraps(f)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = f(*a, **k)
            acc.setdefault(label, []).append(time.perf_counter() - t0)
            return out

        setattr(obj, name, timed)

    wrap(batch, "prepare_for_decode", "prepare_for_decode")
    wrap(runner.token_to_kv_pool, "take_pages_np", "  KV allocator")
    wrap(runner.req_to_token_pool, "write_batch", "  request-table mirror write")
    wrap(batch, "get_model_worker_batch", "get_model_worker_batch")
    wrap(ForwardBatch, "init_new", "ForwardBatch.init_new")
    wrap(runner, "forward", "ModelRunner.forward")
    wrap(runner.cuda_graph_runner, "replay", "  CudaGraphRunner.replay")
    wrap(runner.attn_backend, "init_forward_metadata_replay_cuda_graph", "  backend replay hook")
    wrap(graph, "replay", "  CUDAGraph.replay")
    wrap(runner, "sample", "ModelRunner.sample")
    steps = []
    with torch.inference_mode():  # entered once, as bench_one_batch's loop does
        for _ in range(args.steps):
            t0 = time.perf_counter()
            sb.decode(batch)
            sb._sync()
            steps.append(time.perf_counter() - t0)
    for label, times in acc.items():
        print(f"{label:48} {statistics.median(times) * 1e6:8.2f} us  ({len(times) / args.steps:.0f} a step)")
    print(f"{'step (with the timers)':48} {statistics.median(steps) * 1e6:8.2f} us")


if __name__ == "__main__":
    main()
