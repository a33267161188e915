"""Timing kernels in CUDA graphs, for the kernel benchmarks: `capture_graph` (warm-up on a side stream, then one
capture), `replay_seconds` (CUDA-event samples of back-to-back replays), and `seconds_per_layer`: `fn(layer)` for
every one of `layers` distinct layers' weights (so that a replay reads HBM, not L2) captured in one graph, replayed
`reps` times, best of `best_of` such runs. On the CPU (Triton's interpreter) `seconds_per_layer` runs the calls
plainly once: that checks a script, it measures nothing useful."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def capture_graph(calls: Callable[[], Any], warmup: int = 1) -> torch.cuda.CUDAGraph:
    """`calls()` run `warmup` times on a side stream (compiles, allocates), then captured in a CUDA graph that is
    replayed once before it is returned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_seconds(graph: torch.cuda.CUDAGraph, samples: int, replays: int = 1) -> list[float]:
    """Seconds that `replays` back-to-back replays of `graph` take, measured `samples` times with CUDA events."""
    out = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def seconds_per_layer(fn: Callable[[int], Any], layers: int, reps: int, best_of: int = 5,
                      cuda: bool | None = None) -> float:
    """cuda: whether fn runs on the GPU (default: whether there is one)."""
    if not (torch.cuda.is_available() if cuda is None else cuda):
        t0 = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        return (time.perf_counter() - t0) / layers

    def all_layers() -> None:
        for layer in range(layers):
            fn(layer)

    graph = capture_graph(all_layers)
    return min(replay_seconds(graph, best_of, reps)) / reps / layers
