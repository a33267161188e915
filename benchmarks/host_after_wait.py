"""How fast the host runs a decode step's work right after waiting for the GPU.

    python benchmarks/host_after_wait.py --model-path radixserve/configs/shapes/llama-3.1-8b --load-format dummy \
        --cuda-graph-max-bs 8 --prefill-cuda-graph-max-tokens 0 --piecewise-cuda-graph-max-tokens 0

Two measurements on one process. (1) Synchronised batch-1 decode steps in blocks of 120, alternating the wait for
the sampled token: a blocking synchronisation (`tolist`, as bench_one_batch) or polling a CUDA event in Python
first; per block the medians of `prepare_for_decode`, of the rest up to the launch and the sample, and of the step.
(2) A fixed piece of host work (a 6 x 2 numpy array, a tensor view of it, an unbind: what a decode step does a few
times over) timed in a tight loop and right after a 4 ms sleep, a 4 ms Python spin, and a decode graph's replay with
its synchronisation. Prints the medians in microseconds."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.bench_one_batch import warm_graph_decode  # noqa: E402
from radixserve.managers.tp_worker import run_model_worker_batch  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402


def work() -> None:
    a = np.array([[1, 2], [3, 0], [4, 0], [5, 0], [5, 0], [5, 0]], dtype=np.int64)
    a[5] -= 1
    torch.from_numpy(a)[1:].unbind(0)


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    runner, _, batch = warm_graph_decode(ServerArgs.from_cli_args(args), "host_after_wait")

    def step(poll: bool) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        batch.prepare_for_decode()
        t1 = time.perf_counter()
        result = run_model_worker_batch(runner, batch.get_model_worker_batch())
        t2 = time.perf_counter()
        if poll:
            event = torch.cuda.Event()
            event.record()
            while not event.query():
                pass
        for req, tok in zip(batch.reqs, result.next_token_ids.tolist(), strict=True):
            req.output_ids.append(tok)
        return t1 - t0, t2 - t1, time.perf_counter() - t0

    with torch.inference_mode():  # entered once, as bench_one_batch's loop does
        for _ in range(3):
            for mode in ("block", "poll"):
                rows = [step(mode == "poll") for _ in range(120)]
                prep, rest, total = (statistics.median(col) * 1e6 for col in zip(*rows, strict=True))
                print(f"{mode:6} prep {prep:7.1f} us  mwb+init+forward+sample {rest:7.1f} us  step {total:8.1f} us",
                      flush=True)
    graph = runner.cuda_graph_runner.graphs[1]
    before: list[tuple[str, Callable[[], object]]] = [
        ("tight", lambda: None), ("after 4 ms sleep", lambda: time.sleep(0.004)),
        ("after 4 ms spin", lambda: spin(0.004)),
        ("after graph+sync", lambda: (graph.replay(), torch.cuda.synchronize()))]
    for label, pre in before:
        times = []
        for _ in range(200):
            pre()
            t0 = time.perf_counter()
            work()
            times.append(time.perf_counter() - t0)
        print(f"work {label:20} {statistics.median(times) * 1e6:7.2f} us", flush=True)


if __name__ == "__main__":
    main()
