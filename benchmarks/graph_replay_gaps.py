"""Where a synchronised decode step loses time against the same graph replayed back to back.

    python benchmarks/graph_replay_gaps.py --model-path radixserve/configs/shapes/llama-3.1-8b --load-format dummy \
        --batch-size 160 --cuda-graph-max-bs 160

Decodes `--batch-size` requests until warm, then times that batch's decode graph three ways: replayed back to
back (the graph floor, CUDA events), replayed then synchronised (a synchronised step with no host work), and two
replays then one synchronisation. Then, under the torch profiler, one replay at a time (synchronised, with a
pause between) against the same number back to back: per replay the span from its first kernel's start to its
last kernel's end, the idle time between its kernels and the largest gaps with the kernels on either side. Last,
whole synchronised decode steps as `bench_one_batch` times them (prepare, forward, sample, wait for the tokens),
under the profiler with host activity too: per step (medians, µs from the step's start) when the device's first
copy and first kernel began, when its last kernel ended, and when the step returned; and the same steps without
the profiler, cut by CUDA events recorded at the step's start (the stream idle: its host time), just before and
after the graph's launch, and at its end (idle again): the host's share before the launch, the graph inside a real
step, and the tail from the graph's end to the step's return; then the graph alone timed by the same events, after
the host spun as long as a step's work before its launch and / or after the batch's pack was copied. Prints a
table and writes JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.bench_one_batch import median_call_us, warm_graph_decode  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402


def floor_us(graph: Any, n: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def replays_under_profiler(graph: Any, reps: int, synced: bool) -> list[list[tuple[float, float, str]]]:
    """Kernel (start, end, name) lists, one per replay, times in µs."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
            if synced:
                torch.cuda.synchronize()
                time.sleep(0.002)
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    per = len(kernels) // reps
    if len(kernels) % reps:
        print(f"warning: {len(kernels)} kernels for {reps} replays, not a whole number a replay: cut at {per}")
    return [kernels[i * per:(i + 1) * per] for i in range(reps)]


def gap_stats(replays: list[list[tuple[float, float, str]]], top: int) -> dict[str, Any]:
    spans, idles, gaps = [], [], {}
    for ks in replays[1:]:  # the first replay of each series is left out
        spans.append(ks[-1][1] - ks[0][0])
        idle, reach = 0.0, ks[0][1]
        for i in range(1, len(ks)):
            g = ks[i][0] - reach
            if g > 0:
                idle += g
                gaps.setdefault(i, []).append(g)
            reach = max(reach, ks[i][1])
        idles.append(idle)
    ks = replays[-1]
    worst = sorted(((statistics.median(v), i) for i, v in gaps.items()), reverse=True)[:top]
    return {"kernels": len(ks), "span_us": statistics.median(spans), "idle_us": statistics.median(idles),
            "first_kernel": ks[0][2][:60], "last_kernel": ks[-1][2][:60],
            "largest_gaps": [{"after": ks[i - 1][2][:60], "before": ks[i][2][:60], "index": i, "us": g}
                             for g, i in worst]}


def step_timeline(sb: Any, batch: Any, steps: int) -> dict[str, float]:
    """Medians over `steps` synchronised decode steps, in µs from each step's start (its `record_function` range)."""
    sb._sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("decode_step"):
                sb.decode(batch)
                sb._sync()
    events = prof.events()
    marks = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "decode_step"
                   and e.device_type == torch.autograd.DeviceType.CPU)
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
              and e.time_range.end > e.time_range.start]
    rows: dict[str, list[float]] = {}
    for s0, s1 in marks[1:]:  # the first step is left out
        mine = [e for e in device if s0 <= e.time_range.start <= s1]
        kernels = [e for e in mine if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
        copies = [e for e in mine if "memcpy" in e.name.lower()]
        if not kernels:
            continue
        for key, value in (("step", s1 - s0), ("first_copy", min((e.time_range.start for e in copies), default=0) - s0),
                           ("first_kernel", min(e.time_range.start for e in kernels) - s0),
                           ("last_kernel_end", max(e.time_range.end for e in kernels) - s0),
                           ("last_device_end", max(e.time_range.end for e in mine) - s0),
                           ("copies", float(len(copies)))):
            rows.setdefault(key, []).append(value)
    return {k: statistics.median(v) for k, v in rows.items()}


def step_events(sb: Any, batch: Any, graph: Any, steps: int) -> dict[str, float]:
    """Medians over `steps` synchronised decode steps, µs, from CUDA events around the graph's replay."""
    marks: list[Any] = []
    replay = graph.replay

    def timed_replay() -> None:
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
        replay()
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()

    graph.replay = timed_replay
    rows: dict[str, list[float]] = {}
    try:
        for _ in range(steps + 1):
            marks.clear()
            sb._sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sb.decode(batch)
            end.record()
            end.synchronize()
            if len(marks) != 2:
                raise SystemExit(f"the step replayed its graph {len(marks) // 2} times, not once")
            for key, value in (("before_launch", start.elapsed_time(marks[0])),
                               ("graph", marks[0].elapsed_time(marks[1])),
                               ("after_graph", marks[1].elapsed_time(end)), ("step", start.elapsed_time(end))):
                rows.setdefault(key, []).append(value * 1e3)
    finally:
        del graph.replay
    return {k: statistics.median(v[1:]) for k, v in rows.items()}


def graph_alone_us(graph: Any, reps: int, idle_us: float = 0.0, before: Any = None) -> float:
    """Median µs between CUDA events recorded just before and after one replay on an idle stream, the host first
    spinning `idle_us` after the synchronisation (as a step's host work would) and then calling `before` (e.g. the
    pack's copy)."""
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        until = time.perf_counter() + idle_us * 1e-6
        while time.perf_counter() < until:
            pass
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--reps", type=int, default=20, help="replays in each profiled series")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--out", default="graph_replay_gaps.json")
    args = parser.parse_args(argv)
    runner, sb, batch = warm_graph_decode(ServerArgs.from_cli_args(args), "graph_replay_gaps",
                                            batch_size=args.batch_size)
    cgr = runner.cuda_graph_runner
    graph = cgr.graphs[min(b for b in cgr.capture_bs if b >= args.batch_size)]
    result: dict[str, Any] = {"batch_size": args.batch_size, "floor_us": floor_us(graph)}
    result["replay_sync_us"] = median_call_us(lambda: (graph.replay(), torch.cuda.synchronize()), 100)
    result["two_replays_sync_us"] = median_call_us(
        lambda: (graph.replay(), graph.replay(), torch.cuda.synchronize()), 50)
    result["synced"] = gap_stats(replays_under_profiler(graph, args.reps, True), args.top)
    result["back_to_back"] = gap_stats(replays_under_profiler(graph, args.reps, False), args.top)
    result["step_timeline"] = step_timeline(sb, batch, args.reps)
    result["step_events"] = step_events(sb, batch, graph, 5 * args.reps)
    print(f"batch {args.batch_size}: floor {result['floor_us']:.1f} us, replay + sync {result['replay_sync_us']:.1f}, "
          f"two replays + sync {result['two_replays_sync_us']:.1f}")
    print(f"{'series':<14} {'kernels':>7} {'span us':>9} {'idle us':>9}  first / last kernel")
    for k in ("synced", "back_to_back"):
        s = result[k]
        print(f"{k:<14} {s['kernels']:>7} {s['span_us']:>9.1f} {s['idle_us']:>9.1f}  {s['first_kernel']} / "
              f"{s['last_kernel']}")
    for k in ("synced", "back_to_back"):
        print(f"largest gaps, {k}:")
        for g in result[k]["largest_gaps"]:
            print(f"  {g['us']:7.1f} us at kernel {g['index']:>4}: {g['after']} -> {g['before']}")
    t = result["step_timeline"]
    print("a synchronised decode step, µs from its start (medians): "
          + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
    print("the same steps by CUDA events, µs (medians): "
          + ", ".join(f"{k} {v:.1f}" for k, v in result["step_events"].items()))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    # the graph on its own, timed the same way, to tell what in a step makes it slower: alone; after the host spun
    # as long as a step's work before the launch; after the batch's pack was copied to the device as a step does
    idle = result["step_events"]["before_launch"]
    host = batch.decode_pack
    copy = (lambda: cgr.copy_pack(host, cgr.pack[:host.numel()].view(host.shape))) if host is not None else None
    result["graph_alone"] = {"alone": graph_alone_us(graph, 5 * args.reps),
                             "after_idle": graph_alone_us(graph, 5 * args.reps, idle),
                             "after_copy": graph_alone_us(graph, 5 * args.reps, 0.0, copy) if copy else None,
                             "after_idle_and_copy": graph_alone_us(graph, 5 * args.reps, idle, copy) if copy else None}
    print("the graph alone by the same events, µs (medians): "
          + ", ".join(f"{k} {v:.1f}" for k, v in result["graph_alone"].items() if v is not None))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
