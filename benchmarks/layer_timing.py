"""Time one layer's kernels at real shapes: `fn(layer)` for every one of `layers` distinct layers' weights (so that
a replay reads HBM, not L2) captured in one CUDA graph, replayed `reps` times, best of `best_of` such runs. On the
CPU (Triton's interpreter) the calls run plainly once: that checks a script, it measures nothing useful."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def seconds_per_layer(fn: Callable[[int], Any], layers: int, reps: int, best_of: int = 5,
                      cuda: bool | None = None) -> float:
    """cuda: whether fn runs on the GPU (default: whether there is one)."""
    if not (torch.cuda.is_available() if cuda is None else cuda):
        t0 = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        return (time.perf_counter() - t0) / layers
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in range(layers):  # warm-up: compiles, allocates
            fn(layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(best_of):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps / layers)
    return best
