"""Multi-LoRA cost on one GPU: decode step latency at several batch sizes and offline throughput, each with adapters
and on the base model (no LoRA) in the same run.

    python benchmarks/bench_lora.py --model-path radixserve/configs/shapes/llama-3.1-8b --load-format dummy \
        --num-adapters 8 --rank 16 --batch-size 1 32 128 --result-file lora.json

--modes picks the runs (base, lora, lora-separate: the shrink in separate kernels instead of stacked into the base
GEMM, lora-row-pdl0: the one-row kernels without programmatic dependent launch); --profile prints each decode
batch's kernels per step, and (with --extend-batch) a prefill step's. Adapters are random PEFT folders (rank
--rank on all seven projections) written to --adapter-dir.

Decode: a static batch through the scheduler's ModelRunner (CUDA graphs on), every row with an adapter (rows spread
evenly over the adapters; batch 1 uses one), median step time. Prefill (--extend-batch N L): one extend step of N
requests of L new tokens each, median of 3. Offline: --num-prompts requests through the in-process scheduler
(overlap on, radix cache on), spread evenly over the adapters, output throughput, --offline-repeats times (with the
time by kind of step, the slowest steps, and how many Triton kernels were compiled while it ran: none should be).
CUDA graphs up to the server's default batch unless --cuda-graph-max-bs. Prints a table; writes JSON."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import torch

from radixserve.managers import io_struct as io
from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.managers.scheduler import Scheduler
from radixserve.managers.tp_worker import run_model_worker_batch
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def make_adapters(args: argparse.Namespace) -> list[str]:
    import transformers as tf

    from radixserve.lora.adapter import write_random_adapter

    cfg = tf.AutoConfig.from_pretrained(args.model_path)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return [f"a{i}=" + write_random_adapter(f"{args.adapter_dir}/a{i}", cfg, args.rank, seed=i, device=dev)
            for i in range(args.num_adapters)]


def make_scheduler(args: argparse.Namespace, lora_paths: list[str] | None) -> Scheduler:
    kw: dict[str, Any] = dict(model_path=args.model_path, load_format=args.load_format,
                              max_total_tokens=args.max_total_tokens, skip_tokenizer_init=True,
                              cuda_graph_max_bs=args.cuda_graph_max_bs, log_level="warning",
                              max_running_requests=args.max_running_requests)
    if args.device:
        kw["device"] = args.device
    if lora_paths:
        kw.update(lora_paths=lora_paths, max_loras_per_batch=args.num_adapters, max_lora_rank=args.rank)
    return Scheduler(ServerArgs(**kw), port_args={})


def sync(s: Scheduler) -> None:
    if s.worker.model_runner.is_cuda:
        torch.cuda.synchronize()


def profile_summary(prof: torch.profiler.profile, steps: int, top: int = 12) -> str:
    """The GPU kernels of `steps` profiled steps: launches and microseconds per step, the LoRA ones and the top."""
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time)
    rows = sorted(((sum(t) / steps, len(t) / steps, n) for n, t in kernels.items()), reverse=True)
    lora = [r for r in rows if "lora" in r[2].lower() or "shrink" in r[2] or "expand" in r[2]]
    total = sum(r[0] for r in rows)
    lines = [f"  kernels/step {sum(r[1] for r in rows):.0f}, GPU busy {total:.0f} us/step; LoRA kernels/step "
             f"{sum(r[1] for r in lora):.0f}, {sum(r[0] for r in lora):.0f} us/step"]
    lines += [f"  {us:9.1f} us {n:6.1f}x  {name[:90]}" for us, n, name in rows[:top]]
    host = sorted(((e.self_cpu_time_total / steps, e.count / steps, e.key) for e in prof.key_averages()
                   if e.self_cpu_time_total > 0), reverse=True)
    lines.append(f"  host: {sum(r[0] for r in host):.0f} us/step of profiled CPU ops (self time), the top:")
    lines += [f"  {us:9.1f} us {n:6.1f}x  {name[:90]}" for us, n, name in host[:top]]
    return "\n".join(lines)


def compiled_kernels() -> int:
    """Specialisations of our Triton kernels compiled (or loaded from the disk cache) by this process so far."""
    from radixserve.layers.triton_ops import launch as tl_launch

    fns = [x.fn for x in tl_launch._launchers.values() if x is not None]
    return sum(len(cache[0]) for fn in fns for cache in getattr(fn, "device_caches", {}).values())


def free_reqs(runner: Any, reqs: list[Req]) -> None:
    for r in reqs:
        runner.token_to_kv_pool.free(runner.req_to_token_pool.read(r.req_pool_idx, 0, r.kv_committed_len))
        runner.req_to_token_pool.free(r.req_pool_idx)


def make_reqs(runner: Any, bs: int, names: list[str | None], input_len: int, seed: int) -> list[Req]:
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(bs):
        sp = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1 << 30})
        r = Req(str(i), torch.randint(0, vocab, (input_len,), generator=g).tolist(), sp,
                lora_id=names[i % len(names)])
        r.init_next_round_input(None)
        reqs.append(r)
    return reqs


def extend_latency(s: Scheduler, bs: int, input_len: int, names: list[str | None], repeats: int = 3,
                   profile: bool = False) -> float:
    """Median time of one prefill step of `bs` requests of `input_len` new tokens (rows over `names`)."""
    runner = s.worker.model_runner
    times = []
    for i in range(repeats + (1 if profile else 0)):
        reqs = make_reqs(runner, bs, names, input_len, seed=1000 + i)
        batch = ScheduleBatch(reqs, runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device,
                              runner.model_config.vocab_size)
        batch.lora_table = s.lora_table
        batch.prepare_for_extend()
        sync(s)
        if i == repeats:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_model_worker_batch(runner, batch.get_model_worker_batch()).next_token_ids.tolist()
                sync(s)
            print(profile_summary(prof, 1), flush=True)
        else:
            t = time.perf_counter()
            run_model_worker_batch(runner, batch.get_model_worker_batch()).next_token_ids.tolist()
            sync(s)
            times.append(time.perf_counter() - t)
        free_reqs(runner, reqs)
    return statistics.median(times)


def decode_latency(s: Scheduler, bs: int, names: list[str | None], input_len: int, steps: int,
                   profile: bool = False) -> float:
    """Median decode step time of a static batch of `bs` rows (row i uses names[i % len(names)]); `profile`: then
    print the kernels of a few more steps."""
    runner = s.worker.model_runner
    vocab = runner.model_config.vocab_size
    reqs = make_reqs(runner, bs, names, input_len, seed=bs)
    batch = ScheduleBatch(reqs, runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device, vocab)
    batch.lora_table = s.lora_table

    def run() -> None:
        out = run_model_worker_batch(runner, batch.get_model_worker_batch()).next_token_ids.tolist()
        for r, t in zip(batch.reqs, out, strict=True):
            r.output_ids.append(t)

    batch.prepare_for_extend()
    run()
    times = []
    for _ in range(steps):
        sync(s)
        t = time.perf_counter()
        batch.prepare_for_decode()
        run()
        sync(s)
        times.append(time.perf_counter() - t)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                batch.prepare_for_decode()
                run()
            sync(s)
        print(profile_summary(prof, 4), flush=True)
    free_reqs(runner, batch.reqs)
    return statistics.median(times)


def offline(s: Scheduler, names: list[str | None], n: int, in_lo: int, in_hi: int, out_len: int,
            seed: int) -> dict[str, float]:
    vocab = s.worker.model_runner.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    total_in = 0
    t0 = time.perf_counter()
    for i in range(n):
        length = int(torch.randint(in_lo, in_hi + 1, (1,), generator=g))
        total_in += length
        sp = SamplingParams.from_dict({"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True})
        s.process_input_requests([io.TokenizedGenerateReqInput(
            rid=f"o{seed}-{i}", input_text=None, input_ids=torch.randint(0, vocab, (length,), generator=g).tolist(),
            sampling_params=sp, lora_id=names[i % len(names)])])
    graph = s.worker.model_runner.cuda_graph_runner
    graph_bs = graph.max_bs if graph is not None else 0
    steps: dict[str, list[float]] = {}  # kind of batch launched -> [steps, seconds] (overlap: its wait included)
    slow: list[tuple[float, str, int]] = []  # (seconds, kind, rows) of every step, the slowest kept
    compiled = compiled_kernels()
    while True:
        t = time.perf_counter()
        ran = s.step()
        b = s.last_batch
        if b is not None:
            kind = ("prefill" if b.forward_mode.is_extend() else
                    "decode (graph)" if len(b.reqs) <= graph_bs else "decode (eager)")
            acc = steps.setdefault(kind, [0, 0.0])
            acc[0] += 1
            acc[1] += time.perf_counter() - t
            slow.append((round(time.perf_counter() - t, 4), kind, len(b.reqs)))
        if not ran and s.is_idle():
            break
    sync(s)
    dt = time.perf_counter() - t0
    done = sum(len(m.rids) for m in s.outbox if isinstance(m, io.BatchTokenIDOut))
    s.outbox.clear()
    return {"seconds": dt, "output_tok_s": n * out_len / dt, "total_tok_s": (total_in + n * out_len) / dt,
            "messages": done, "steps": {k: {"steps": v[0], "seconds": round(v[1], 4)} for k, v in steps.items()},
            "slowest_steps": sorted(slow, reverse=True)[:5], "kernels_compiled": compiled_kernels() - compiled,
            "graph_max_bs": graph_bs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default=None)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapter-dir", default="/tmp/radixserve-lora-bench")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--offline-input-range", type=int, nargs=2, default=[256, 768])
    p.add_argument("--offline-output-len", type=int, default=96)
    p.add_argument("--max-total-tokens", type=int, default=200_000)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="default: the server's (by GPU memory)")
    p.add_argument("--offline-repeats", type=int, default=1, help="offline runs per mode (the table shows the last)")
    p.add_argument("--extend-batch", type=int, nargs=2, default=None, metavar=("N", "LEN"),
                   help="also time one prefill step of N requests of LEN new tokens")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--modes", nargs="+", default=["base", "lora"],
                   choices=["base", "lora", "lora-separate", "lora-row-pdl0"],
                   help="lora-separate: adapters with the shrink in separate kernels (no stacking)")
    p.add_argument("--profile", action="store_true", help="print each decode batch's kernels (torch profiler)")
    p.add_argument("--result-file", default="bench_lora.json")
    args = p.parse_args()

    t = time.perf_counter()
    lora_paths = make_adapters(args)
    names = [x.split("=")[0] for x in lora_paths]
    print(f"wrote {len(names)} adapters of rank {args.rank} in {time.perf_counter() - t:.1f} s", flush=True)
    results: dict[str, Any] = {"args": vars(args), "decode": {}, "offline": {}}
    from radixserve.lora import triton_ops as lora_triton
    from radixserve.lora.pool import set_lora_stacking

    row_pdl = lora_triton.ROW_PDL_LEVEL

    for mode in args.modes:
        t = time.perf_counter()
        set_lora_stacking(False if mode == "lora-separate" else None)
        lora_triton.ROW_PDL_LEVEL = 0 if mode == "lora-row-pdl0" else row_pdl
        s = make_scheduler(args, lora_paths if mode != "base" else None)
        print(f"[{mode}] scheduler ready in {time.perf_counter() - t:.1f} s", flush=True)
        rows = names if mode != "base" else [None]
        # warm-up: every kernel compiled (prefill, decode, all batch sizes of the runs below)
        offline(s, rows, 2 * len(rows), 32, 64, 4, seed=99)
        for bs in args.batch_size:
            decode_latency(s, bs, rows[:1] if bs == 1 else rows, 16, 2)
            results["decode"].setdefault(str(bs), {})[mode] = decode_latency(
                s, bs, rows[:1] if bs == 1 else rows, args.input_len, args.decode_steps, args.profile)
            print(f"[{mode}] decode bs={bs}: {results['decode'][str(bs)][mode] * 1e3:.2f} ms/step", flush=True)
        if args.extend_batch:
            n, length = args.extend_batch
            extend_latency(s, n, 32, rows, repeats=1)  # warm-up
            ms = extend_latency(s, n, length, rows, profile=args.profile) * 1e3
            results.setdefault("prefill", {})[mode] = ms
            print(f"[{mode}] prefill {n} x {length} tokens: {ms:.2f} ms", flush=True)
        if not args.skip_offline:
            runs = []
            for rep in range(args.offline_repeats):
                runs.append(offline(s, rows, args.num_prompts, *args.offline_input_range, args.offline_output_len,
                                    seed=1 + rep))
                print(f"[{mode}] offline run {rep + 1}: {runs[-1]}", flush=True)
            results["offline"][mode] = dict(runs[-1], runs=[r["output_tok_s"] for r in runs])
        if s.worker_client is not None:
            s.worker_client.shutdown()
        del s
        set_lora_stacking(None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    others = [m for m in args.modes if m != "base"]
    print(f"\n{'measure':<24}{'base':>12}" + "".join(f"{m:>14}{'ratio':>8}" for m in others))
    for bs, d in results["decode"].items():
        line = f"{'decode bs=' + bs + ' (ms/step)':<24}{d.get('base', float('nan')) * 1e3:>12.2f}"
        for m in others:
            ratio = d["base"] / d[m] if "base" in d else float("nan")
            d["ratio_speed" if m == "lora" else f"ratio_speed_{m}"] = ratio
            line += f"{d[m] * 1e3:>14.2f}{ratio:>8.3f}"
        print(line)
    if results.get("prefill"):
        pf = results["prefill"]
        line = f"{'prefill step (ms)':<24}{pf.get('base', float('nan')):>12.2f}"
        for m in others:
            line += f"{pf[m]:>14.2f}{pf.get('base', float('nan')) / pf[m]:>8.3f}"
        print(line)
    if results["offline"]:
        off = results["offline"]
        b = off.get("base", {}).get("output_tok_s", float("nan"))
        line = f"{'offline (out tok/s)':<24}{b:>12.0f}"
        for m in others:
            ratio = off[m]["output_tok_s"] / b
            off["ratio" if m == "lora" else f"ratio_{m}"] = ratio
            line += f"{off[m]['output_tok_s']:>14.0f}{ratio:>8.3f}"
        print(line)
    with open(args.result_file, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
