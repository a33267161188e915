"""Decode throughput with overlap scheduling on vs off, and the GPU's idle fraction between decode steps.

    python benchmarks/bench_overlap.py --model-path radixserve/configs/shapes/qwen2.5-0.5b --batch-size 64 128

Runs the scheduler in-process (no ZMQ) on dummy weights: `bs` requests with fixed input and output lengths, so
every decode step is full. Throughput is measured after the prefill. Two idle measures over windows of decode
steps: "GPU idle" from the torch profiler's CUDA kernel timeline, 1 - (union of kernel intervals) / window, which
also counts the bubbles between consecutive kernels inside a step (launch latency, ~1 us each, hundreds per step);
and "between steps" from CUDA events recorded on the stream around each step: the sum of the gaps between one
step's end and the next step's start / window, i.e. the time the GPU waited for the host at step boundaries (a
host late *inside* a step, e.g. enqueuing the graph launch after the step's input copies ran, is not seen; the
all-gaps figure bounds that from above). "Graph floor": the same captured decode graph replayed back-to-back with
nothing else, timed with CUDA events (no profiler): the GPU time one step needs when the host is never late.
"Host share" = 1 - floor / (wall time per decode step while serving): the part of each step the GPU was not running
the step's graph, i.e. waiting for the host anywhere (at or inside step boundaries) plus the step's few kernels
outside the graph (input copies, the result copy); an upper bound on what the host costs. The profiler's all-gaps
figure is not used for that: CUPTI's tracing of kernels inside a graph adds gaps of its own (the same graph
replayed alone shows 2-11% there)."""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import warnings
from typing import Any

import torch

from radixserve.managers import io_struct as io
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def gpu_idle_fraction(prof: Any) -> float:
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return float("nan")
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = spans[-1][1] - spans[0][0]
    return 1.0 - busy / window


class StepEvents:
    """CUDA events recorded on the stream right before each batch's first device work and right after its last
    (the device-to-host copy of its results), in the thread that runs the worker. Stream order makes each event's
    time the moment the GPU reached it, so start(N+1) - end(N) is the GPU's idle time between two steps (zero when
    step N+1 was queued before step N finished); kernel-to-kernel bubbles inside a step are not counted."""

    def __init__(self, worker: Any) -> None:
        self.on = False
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        fwd, copy = worker.forward_batch_generation, worker.copy_result_to_host

        def forward(*a: Any, **k: Any) -> Any:
            if not self.on:
                return fwd(*a, **k)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            out = fwd(*a, **k)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pairs.append((start, end))
            return out

        def copy_to_host(*a: Any, **k: Any) -> Any:  # overlap only: the step ends after its copies
            out = copy(*a, **k)
            if self.on and self.pairs:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.pairs[-1] = (self.pairs[-1][0], end)
            return out

        worker.forward_batch_generation = forward
        worker.copy_result_to_host = copy_to_host

    def idle_fraction(self) -> float:
        torch.cuda.synchronize()
        pairs = self.pairs
        if len(pairs) < 2:
            return float("nan")
        gaps = sum(max(0.0, pairs[i][1].elapsed_time(pairs[i + 1][0])) for i in range(len(pairs) - 1))
        return gaps / pairs[0][0].elapsed_time(pairs[-1][1])


def graph_floor_ms(s: Scheduler, bs: int, steps: int) -> float:
    """Milliseconds per replay of the captured decode graph for `bs`, replayed `steps` times back-to-back with no
    host work in between (CUDA events, no profiler). Run after the workload: the replays rewrite the last batch's
    KV slots with the same values and its sampled ids."""
    runner = s.worker.model_runner.cuda_graph_runner
    if runner is None or bs not in runner.graphs:
        return float("nan")
    from bench_attention_kernels import replay_ms  # this script's folder is on sys.path

    return replay_ms(runner.graphs[bs], steps)


def count_host_syncs(s: Scheduler, steps: int) -> dict[str, int]:
    """Run `steps` more steps with torch's CUDA sync debug mode on and count, per source line, the operations that
    made the host wait for the device (each one stalls the pipeline the overlap scheduler builds)."""
    counts: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                s.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{os.path.relpath(w.filename)}:{w.lineno}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def run(model_path: str, bs: int, overlap: bool, input_len: int, output_len: int, profile_steps: int,
        copy_bw: float, **extra: Any) -> dict[str, Any]:
    args = ServerArgs(model_path=model_path, load_format="dummy", skip_tokenizer_init=True,
                      max_running_requests=bs, cuda_graph_max_bs=max(bs, 8), disable_overlap_schedule=not overlap,
                      max_total_tokens=bs * (input_len + output_len + 8), chunked_prefill_size=-1,
                      max_prefill_tokens=bs * input_len + 1, **extra)
    s = Scheduler(args, port_args={})
    rng = random.Random(0)
    vocab = s.vocab_size
    for i in range(bs):
        sp = SamplingParams.from_dict({"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True})
        s.process_input_requests([io.TokenizedGenerateReqInput(
            rid=f"r{i}", input_text=None, input_ids=[rng.randrange(100, vocab - 100) for _ in range(input_len)],
            sampling_params=sp)])
    for _ in range(8):  # prefill and the first decode steps
        s.step()
    torch.cuda.synchronize()
    events = StepEvents(s.worker)  # the worker the forward thread (overlap) or the scheduler (normal) drives
    events.on = True
    for _ in range(profile_steps):
        s.step()
    events.on = False
    ct0, t0 = s.forward_ct, time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(profile_steps):
            s.step()
        torch.cuda.synchronize()
    idle = gpu_idle_fraction(prof)
    syncs = count_host_syncs(s, profile_steps)
    ct1, t1 = s.forward_ct, time.perf_counter()
    stamps = []
    while s.step() or not s.is_idle():  # unprofiled remainder
        stamps.append(time.perf_counter())
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    steps_unprofiled = s.forward_ct - ct1
    step_idle = events.idle_fraction()  # every step of the event window has finished by now
    floor = graph_floor_ms(s, bs, 50)
    # wall per step over the last 50 steps before the final drain, whose KV lengths are close to the ones the
    # floor's replays see (the last batch's), so that longer attention at the end does not flatter the host share
    tail = stamps[-52:-2]
    step_ms = (tail[-1] - tail[0]) / (len(tail) - 1) * 1e3 if len(tail) > 1 else float("nan")
    # the roofline as bench_one_batch counts it: every weight + the KV of each token attended to, at the context
    # the tail's steps saw on average (the last 50 steps before the final two)
    runner = s.worker.model_runner
    tail_len = input_len + output_len - 2 - len(tail) / 2
    step_bytes = runner.weight_bytes + bs * tail_len * runner.token_to_kv_pool.bytes_per_token()
    roofline = step_bytes / copy_bw * 1e3 / step_ms if copy_bw else float("nan")
    if s.worker_client is not None:
        s.worker_client.shutdown()
    return {"batch_size": bs, "overlap": overlap, "decode_tok_s": bs * steps_unprofiled / (t2 - t1),
            "decode_tok_s_profiled": bs * (ct1 - ct0) / (t1 - t0), "gpu_idle_fraction": idle,
            "gpu_idle_between_steps": step_idle, "graph_floor_ms": floor,
            "step_ms": step_ms, "host_share": max(0.0, 1.0 - floor / step_ms),
            "step_bytes": step_bytes, "roofline_fraction": roofline,
            "steps": s.forward_ct, "host_syncs": syncs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=30)
    parser.add_argument("--quantization", default=None, help="as the server's flag (e.g. fp8)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="as the server's flag (the LM head in int8 rows)")
    parser.add_argument("--overlap-only", action="store_true", help="skip the runs without overlap")
    parser.add_argument("--result-file", default="bench_overlap.json")
    args = parser.parse_args()
    from radixserve.bench_one_batch import measure_copy_bandwidth

    copy_bw = measure_copy_bandwidth("cuda")
    extra = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
             "quantize_lm_head": args.quantize_lm_head}
    results = []
    for bs in args.batch_size:
        for overlap in ((True,) if args.overlap_only else (False, True)):
            results.append(run(args.model_path, bs, overlap, args.input_len, args.output_len, args.profile_steps,
                               copy_bw, **extra))
            torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {copy_bw / 1e9:,.0f} GB/s")
    print(f"{'batch':>6} {'overlap':>8} {'decode tok/s':>13} {'GPU idle':>9} {'between steps':>14} "
          f"{'step ms':>8} {'graph floor ms':>15} {'host share':>11} {'of roofline':>12}")
    for r in results:
        print(f"{r['batch_size']:>6} {str(r['overlap']):>8} {r['decode_tok_s']:>13.1f} {r['gpu_idle_fraction']:>9.2%} "
              f"{r['gpu_idle_between_steps']:>14.2%} {r['step_ms']:>8.3f} "
              f"{r['graph_floor_ms']:>15.3f} {r['host_share']:>11.2%} {r['roofline_fraction']:>12.1%}")
    for bs in [] if args.overlap_only else args.batch_size:
        off = next(r for r in results if r["batch_size"] == bs and not r["overlap"])
        on = next(r for r in results if r["batch_size"] == bs and r["overlap"])
        print(f"batch {bs}: overlap speed-up {on['decode_tok_s'] / off['decode_tok_s']:.2f}x")
    for r in results:
        if r["host_syncs"]:
            print(f"host syncs (bs {r['batch_size']}, overlap {r['overlap']}): {r['host_syncs']}")
    with open(args.result_file, "w") as f:
        json.dump({"model": args.model_path, "copy_bw_gbs": copy_bw / 1e9, "args": vars(args), "results": results},
                  f, indent=2)


if __name__ == "__main__":
    main()
