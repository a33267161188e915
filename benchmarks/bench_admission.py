"""Where the time goes in an offline run, phase by phase: the scheduler in-process on dummy weights, each loop
iteration timed (schedule / launch / process), and a profile of the phase where the KV pool is full and finished
requests admit waiting ones a few at a time.

    python benchmarks/bench_admission.py --model-path radixserve/configs/shapes/llama-3.1-8b --load-format dummy \\
        --num-prompts 1000 --input-len 1024 --output-len 1024 --range-ratio 0.5

Phases: `fill` (requests waiting, before the first small prefill), `admit` (requests waiting, from the first
prefill of at most 4 requests into a running batch of at least --min-running: finished requests make room a few
at a time), `drain` (nothing waiting). For each: iterations, prefill batches, decode steps, wall time, output
tok/s, median plain decode-step wall, and the wall each prefill adds beyond the phase's plain decode steps. In the
admit phase, one after the other: a torch-profiler window (top host ops, top kernels, GPU idle; chrome trace to
--out-dir), a window of Python stack sampling of every thread, and a window under CUDA sync debug mode; CUDA
allocator events (cudaMalloc/cudaFree, OOM retries) are counted over the windows."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import threading
import time
import warnings
from collections import defaultdict
from typing import Any

import torch

from radixserve.managers import io_struct as io
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

ALLOC_STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def alloc_stats() -> dict[str, int]:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOC_STATS}


class Timeline:
    """One record per loop iteration."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, **row: Any) -> None:
        self.rows.append(row)

    def phase_summary(self) -> list[dict[str, Any]]:
        by_phase: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in self.rows:
            by_phase[r["phase"]].append(r)
        out = []
        for phase in ("fill", "admit", "drain"):
            rows = by_phase.get(phase, [])
            if not rows:
                continue
            decode = [r for r in rows if r["mode"] == "decode"]
            prefill = [r for r in rows if r["mode"] != "decode"]
            wall = sum(r["total_ms"] for r in rows) / 1e3
            tokens = sum(r["bs"] for r in decode) + sum(r["bs"] for r in prefill)
            # a decode step not preceded by a prefill: the phase's plain decode cost
            plain = [r["total_ms"] for i, r in enumerate(rows) if r["mode"] == "decode"
                     and (i == 0 or rows[i - 1]["mode"] == "decode") and (i + 1 == len(rows)
                                                                          or rows[i + 1]["mode"] == "decode")]
            plain_ms = sorted(plain)[len(plain) // 2] if plain else float("nan")
            extra = (wall * 1e3 - len(decode) * plain_ms) / len(prefill) if prefill and plain else float("nan")
            mean = (lambda key, rs: sum(r[key] for r in rs) / len(rs) if rs else float("nan"))
            out.append({
                "phase": phase, "iterations": len(rows), "prefills": len(prefill), "decode_steps": len(decode),
                "wall_s": wall, "output_tok_s": tokens / wall if wall else float("nan"),
                "mean_running": mean("bs", decode), "plain_decode_ms": plain_ms,
                "wall_per_prefill_ms": extra,
                "prefill_new_tokens_mean": mean("new_tokens", prefill),
                "schedule_ms_decode": mean("schedule_ms", decode), "launch_ms_decode": mean("launch_ms", decode),
                "process_ms_decode": mean("process_ms", decode),
                "schedule_ms_prefill": mean("schedule_ms", prefill), "launch_ms_prefill": mean("launch_ms", prefill),
                "process_ms_prefill": mean("process_ms", prefill),
            })
        return out


def submit(s: Scheduler, n: int, input_len: int, output_len: int, ratio: float, seed: int) -> None:
    rng = random.Random(seed)
    vocab = s.vocab_size
    for i in range(n):
        li = rng.randint(max(1, int(input_len * ratio)), input_len)
        lo = rng.randint(max(1, int(output_len * ratio)), output_len)
        sp = SamplingParams.from_dict({"max_new_tokens": lo, "temperature": 0, "ignore_eos": True})
        s.process_input_requests([io.TokenizedGenerateReqInput(
            rid=f"r{i}", input_text=None, input_ids=[rng.randrange(100, vocab - 100) for _ in range(li)],
            sampling_params=sp)])


def top_table(prof: Any, key: str, limit: int) -> str:
    try:
        return prof.key_averages().table(sort_by=key, row_limit=limit, max_name_column_width=70)
    except (KeyError, AttributeError, RuntimeError):
        return ""


class StackSampler:
    """A poor man's py-spy: every `interval` seconds, the innermost frames of every other thread, counted."""

    def __init__(self, interval: float = 0.002, depth: int = 4) -> None:
        self.interval, self.depth = interval, depth
        self.counts: dict[str, int] = defaultdict(int)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        while not self._stop.wait(self.interval):
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                parts = []
                f = frame
                while f is not None and len(parts) < self.depth:
                    parts.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}:{f.f_lineno}")
                    f = f.f_back
                self.counts[f"[{names.get(ident, ident)}] " + " < ".join(parts)] += 1

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def top(self, n: int = 30) -> list[tuple[str, float]]:
        total = max(self.samples, 1)
        return [(k, v / total) for k, v in sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]]


class CompileLog:
    """Triton JIT compilations (each a new specialisation of a kernel), through Triton's jit_cache_hook."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.iteration = -1
        try:
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._hook
            self.enabled = True
        except (ImportError, AttributeError):
            self.enabled = False

    def _hook(self, **kw: Any) -> bool:
        self.events.append({"iteration": self.iteration, "kernel": str(kw.get("repr", ""))[:400]})
        return False  # compile as usual


def run(s: Scheduler, args: argparse.Namespace, out_dir: str, compiles: CompileLog) -> dict[str, Any]:
    """The overlap (or normal) loop of Scheduler, timed per iteration. Windows of the 'admission' regime (small
    prefills into a big running batch) are profiled, stack-sampled and sync-checked, one after the other."""
    tl = Timeline()
    pool = s.token_to_kv_pool
    small_prefills = 0
    syncs: dict[str, int] = {}
    alloc_in_window = {k: 0 for k in ALLOC_STATS}
    prof_tables: dict[str, str] = {}
    prof_idle = float("nan")
    stacks: list[tuple[str, float]] = []
    t_start = time.perf_counter()
    prof = sampler = catcher = None
    prof_left = sample_left = sync_left = 0
    caught: list[Any] = []
    cuda = torch.cuda.is_available()
    while True:
        used = pool.size - pool.available_size() - s.tree_cache.evictable_size()
        usage = used / pool.size
        phase = "drain" if not s.waiting_queue else ("admit" if small_prefills else "fill")
        before = alloc_stats() if prof_left or sample_left or sync_left else None
        compiles.iteration = len(tl.rows)
        t0 = time.perf_counter()
        batch = s.get_next_batch_to_run()
        t1 = time.perf_counter()
        if batch is None:
            s.flush_results()
            s.last_batch = None
            if s.is_idle():
                break
            continue
        mode = "decode" if batch.forward_mode.is_decode() else "prefill"
        new_tokens = sum(r.extend_input_len for r in batch.reqs) if mode == "prefill" else 0
        bs = len(batch.reqs)
        running = len(s.running_batch.reqs) if s.running_batch is not None else 0
        if mode == "prefill" and bs <= 4 and running >= args.min_running:
            small_prefills += 1
            # the admission regime: open the windows one after the other
            if small_prefills == args.profile_after and args.profile_iters > 0:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                              + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
                prof.__enter__()
                prof_left = args.profile_iters
            elif small_prefills == args.profile_after + 20 and args.sample_iters > 0 and not prof_left:
                sampler = StackSampler().__enter__()
                sample_left = args.sample_iters
            elif small_prefills == args.profile_after + 60 and cuda and args.sync_iters > 0 \
                    and not (prof_left or sample_left):
                catcher = warnings.catch_warnings(record=True)
                caught = catcher.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                sync_left = args.sync_iters
        # Scheduler.step(), with the launch timed apart
        s.result_queue.append(s.run_batch(batch))
        t2 = time.perf_counter()
        if not s.enable_overlap or len(s.result_queue) > 1:
            s.process_batch_result(s.result_queue.popleft())
        t3 = time.perf_counter()
        s.last_batch = batch
        if before is not None:
            after = alloc_stats()
            for k in ALLOC_STATS:
                alloc_in_window[k] += after.get(k, 0) - before.get(k, 0)
        tl.add(phase=phase, mode=mode, bs=bs, new_tokens=new_tokens, usage=round(usage, 4),
               waiting=len(s.waiting_queue), schedule_ms=(t1 - t0) * 1e3, launch_ms=(t2 - t1) * 1e3,
               process_ms=(t3 - t2) * 1e3, total_ms=(t3 - t0) * 1e3,
               window="profile" if prof_left else "sample" if sample_left else "sync" if sync_left else "")
        if prof_left:
            prof_left -= 1
            if prof_left == 0:
                if cuda:
                    torch.cuda.synchronize()
                prof.__exit__(None, None, None)
                prof_tables = {"host": top_table(prof, "self_cpu_time_total", 25),
                               "device": top_table(prof, "self_device_time_total", 15)
                               or top_table(prof, "self_cuda_time_total", 15)}
                if cuda:
                    from bench_overlap import gpu_idle_fraction  # this script's folder is on sys.path

                    prof_idle = gpu_idle_fraction(prof)
                if out_dir:
                    path = os.path.join(out_dir, "admission_trace.json")
                    prof.export_chrome_trace(path)
                    with open(path, "rb") as f_in, gzip.open(path + ".gz", "wb") as f_out:
                        f_out.write(f_in.read())
                    os.remove(path)
                prof = None
        if sample_left:
            sample_left -= 1
            if sample_left == 0:
                sampler.__exit__(None, None, None)
                stacks = sampler.top(40)
        if sync_left:
            sync_left -= 1
            if sync_left == 0:
                torch.cuda.set_sync_debug_mode("default")
                catcher.__exit__(None, None, None)
                for w in caught:
                    if "synchroniz" in str(w.message):
                        k = f"{os.path.relpath(w.filename)}:{w.lineno}"
                        syncs[k] = syncs.get(k, 0) + 1
        if time.perf_counter() - t_start > args.max_seconds:
            print(f"stopping after {args.max_seconds} s (--max-seconds)")
            break
    if s.worker_client is not None:
        s.flush_results()
        s.worker_client.shutdown()
    return {"phases": tl.phase_summary(), "syncs_in_window": syncs, "alloc_events_in_windows": alloc_in_window,
            "profile_tables": prof_tables, "profile_gpu_idle": prof_idle, "stacks": stacks,
            "retractions": s.num_retractions, "timeline": tl.rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile-after", type=int, default=15,
                        help="small prefills (<= 4 requests into >= 64 running) before the profiled window")
    parser.add_argument("--min-running", type=int, default=64,
                        help="a prefill of <= 4 requests into at least this many running ones is a small admission")
    parser.add_argument("--profile-iters", type=int, default=50)
    parser.add_argument("--sample-iters", type=int, default=150, help="iterations of Python stack sampling")
    parser.add_argument("--sync-iters", type=int, default=60, help="iterations under CUDA sync debug mode")
    parser.add_argument("--max-seconds", type=float, default=400.0)
    parser.add_argument("--out-dir", default="", help="where to write the profiler's chrome trace")
    parser.add_argument("--result-file", default="bench_admission.json")
    args = parser.parse_args()
    server_args = ServerArgs.from_cli_args(args)
    server_args.skip_tokenizer_init = True
    s = Scheduler(server_args, port_args={})
    if s.device != "cpu" and not server_args.skip_server_warmup:
        s.warmup()  # as a server does before it reports ready
    print(f"KV pool {s.token_to_kv_pool.size} tokens, max running {s.max_running_requests}, "
          f"overlap {s.enable_overlap}")
    compiles = CompileLog()  # from here on: the compilations while serving (startup and capture are done)
    submit(s, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    res = run(s, args, args.out_dir, compiles)
    res["triton_compiles"] = compiles.events
    for name, table in res["profile_tables"].items():
        print(f"\n--- admit phase, top {name} ops\n{table}")
    print("\n--- Python stacks (share of samples; threads: the scheduler loop, the forward thread)")
    for k, v in res["stacks"]:
        print(f"{v:6.1%}  {k[:260]}")
    print(f"\nTriton compilations while serving: {len(compiles.events)}" if compiles.enabled else
          "\nTriton compilations: not counted (no triton.knobs)")
    for e in compiles.events[:20]:
        print(f"  iteration {e['iteration']}: {e['kernel'][:200]}")
    print(f"\nGPU idle in the profiled window: {res['profile_gpu_idle']:.1%}")
    print(f"host syncs ({args.sync_iters} iterations): {res['syncs_in_window']}")
    print(f"CUDA allocator events in the windows: {res['alloc_events_in_windows']}; retractions {res['retractions']}")
    cols = ("phase", "iterations", "prefills", "decode_steps", "wall_s", "output_tok_s", "mean_running",
            "plain_decode_ms", "wall_per_prefill_ms", "schedule_ms_prefill", "launch_ms_prefill",
            "process_ms_prefill")
    print("\n" + " ".join(f"{c:>14}" for c in cols))
    for p in res["phases"]:
        print(" ".join(f"{p[c]:>14.2f}" if isinstance(p[c], float) else f"{p[c]:>14}" for c in cols))
    with open(args.result_file, "w") as f:
        json.dump({"args": vars(args), **res}, f, indent=1)


if __name__ == "__main__":
    main()
