"""Static-batch latency through the ModelRunner directly (no scheduler, no processes).

    python -m radixserve.bench_one_batch --batch-size 1 8 --input-len 64 --output-len 32
    python -m radixserve.bench_one_batch --correctness-test          # decode real prompts, print the text
    python -m radixserve.bench_one_batch --tp-size 2 --batch-size 1  # one process per rank; rank 0 reports

Prints prefill latency, median decode step latency and throughput per batch size, and writes JSON."""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

CORRECTNESS_PROMPTS = ["What is the capital of France?", "Name three primary colors.",
                       "Write a haiku about the sea."]


class StaticBatch:
    """Prefill a fixed set of prompts together, then decode them step by step, all through one ModelRunner."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.vocab = runner.model_config.vocab_size

    def _sync(self) -> None:
        if self.runner.is_cuda:
            torch.cuda.synchronize()

    def prefill(self, prompts: list[list[int]], sampling: dict[str, Any] | None = None,
                max_tokens: int | None = None) -> tuple[ScheduleBatch, list]:
        """One extend forward for all `prompts`, or with `max_tokens` one for each run of whole prompts within that
        many tokens (as the scheduler's prefill budget cuts them: a 160 x 512-token batch in one forward needs
        activations beyond what a pool-filled 80 GB card leaves), merged into one batch for decode."""
        groups: list[list[int]] = []
        for i, ids in enumerate(prompts):
            if not groups or (max_tokens is not None
                              and sum(len(prompts[j]) for j in groups[-1]) + len(ids) > max_tokens):
                groups.append([])
            groups[-1].append(i)
        batch, next_ids = None, []
        for group in groups:
            reqs = []
            for i in group:
                sp = SamplingParams.from_dict(dict(sampling or {"temperature": 0, "max_new_tokens": 1 << 30}))
                req = Req(str(i), prompts[i], sp)
                req.init_next_round_input(None)
                reqs.append(req)
            part = ScheduleBatch(reqs, self.runner.req_to_token_pool, self.runner.token_to_kv_pool, None,
                                 self.runner.device, self.vocab)
            part.prepare_for_extend()
            next_ids += self._run(part)
            if batch is None:
                batch = part
            else:
                batch.merge_batch(part)
        if batch is None:
            raise ValueError("prefill needs at least one prompt")
        return batch, next_ids

    def _run(self, batch: ScheduleBatch) -> list[int]:
        from radixserve.managers.tp_worker import run_model_worker_batch

        result = run_model_worker_batch(self.runner, batch.get_model_worker_batch())
        self.last_logits = result.logits_output
        out = result.next_token_ids.tolist()
        for req, t in zip(batch.reqs, out, strict=True):
            req.output_ids.append(t)
        return out

    def decode(self, batch: ScheduleBatch) -> list[int]:
        batch.prepare_for_decode()
        return self._run(batch)

    def prompt_logprobs(self, ids: list[int]) -> torch.Tensor:
        """The log-probabilities of tokens 1 .. N-1 of `ids` given their prefixes (float32 [N - 1]), from one
        prefill with prompt logprobs; the request's memory is released after."""
        req = Req("prompt-logprobs", ids, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1}),
                  return_logprob=True, logprob_start_len=0, top_logprobs_num=0)
        req.init_next_round_input(None)
        batch = ScheduleBatch([req], self.runner.req_to_token_pool, self.runner.token_to_kv_pool, None,
                              self.runner.device, self.vocab)
        batch.prepare_for_extend()
        self._run(batch)
        self.release(batch)
        out = self.last_logits.input_token_logprobs[0].float()
        if out.numel() != len(ids) - 1:
            raise RuntimeError(f"expected {len(ids) - 1} prompt logprobs, got {out.numel()}")
        return out

    def release(self, batch: ScheduleBatch) -> None:
        for r in batch.reqs:
            self.runner.token_to_kv_pool.free(self.runner.req_to_token_pool.read(r.req_pool_idx, 0,
                                                                                 r.kv_committed_len))
            self.runner.req_to_token_pool.free(r.req_pool_idx)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        batch, _ = self.prefill(prompts)
        for _ in range(max_new_tokens - 1):
            self.decode(batch)
        out = [list(r.output_ids) for r in batch.reqs]
        self.release(batch)
        return out


def warm_graph_decode(server_args: ServerArgs, tool: str, input_len: int = 512,
                             batch_size: int = 1) -> tuple[ModelRunner, StaticBatch, ScheduleBatch]:
    """For the benchmarks that time a synchronised decode step's host work: a model runner on CUDA with decode graphs
    (at most max(8, batch_size) running requests unless the flags say otherwise) and `batch_size` requests of
    `input_len` tokens, prefilled and decoded 30 steps so that every kernel and graph is warm."""
    from radixserve.entrypoints.engine import resolve_model

    if not torch.cuda.is_available():
        raise SystemExit(f"{tool} needs CUDA")
    if server_args.max_running_requests is None:
        server_args.max_running_requests = max(8, batch_size)
    runner = ModelRunner(resolve_model(server_args), server_args)
    if runner.cuda_graph_runner is None:
        raise SystemExit(f"{tool} times a decode graph's replay: run it without --disable-cuda-graph")
    if batch_size > runner.cuda_graph_runner.max_bs:
        raise SystemExit(f"{tool}: batch {batch_size} has no decode graph (--cuda-graph-max-bs "
                         f"{runner.cuda_graph_runner.max_bs})")
    sb = StaticBatch(runner)
    batch, _ = sb.prefill([[(i + j) % 1000 + 5 for i in range(input_len)] for j in range(batch_size)])
    for _ in range(30):
        sb.decode(batch)
    sb._sync()
    return runner, sb, batch


@torch.inference_mode()  # once for the whole loop: the forward and the sample then skip entering it each step
def latency_test(runner: ModelRunner, batch_size: int, input_len: int, output_len: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    prompts = torch.randint(0, vocab, (batch_size, input_len), generator=g).tolist()
    sb = StaticBatch(runner)
    sb._sync()
    t0 = time.perf_counter()
    batch, _ = sb.prefill(prompts, max_tokens=runner.server_args.max_prefill_tokens)
    sb._sync()
    prefill = time.perf_counter() - t0
    steps = []
    for _ in range(output_len - 1):
        t = time.perf_counter()
        sb.decode(batch)
        sb._sync()
        steps.append(time.perf_counter() - t)
    sb.release(batch)
    med = statistics.median(steps) if steps else float("nan")
    return {"batch_size": batch_size, "input_len": input_len, "output_len": output_len,
            "prefill_latency_s": prefill, "prefill_tok_s": batch_size * input_len / prefill,
            "median_decode_s": med, "decode_tok_s": batch_size / med if steps else None,
            "total_latency_s": prefill + sum(steps), "tp_size": runner.tp_size}


def median_call_us(fn: Callable[[], Any], n: int, warmup: int = 10) -> float:
    """Median microseconds of one `fn()` call over n calls timed one by one, after `warmup` untimed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def host_probe_us(reps: int = 5, number: int = 2000) -> float:
    """Microseconds of one pure-Python loop (the sum of range(1000)), the median of `reps` timings: the speed of the
    host at the time. A synchronised decode step's host work scales with it, so processes of one code on one
    machine differ with it (docs/perf-log.md, 2026-12-02 (code 126762e))."""
    import timeit

    return statistics.median(timeit.repeat("sum(range(1000))", number=number, repeat=reps)) / number * 1e6


def measure_copy_bandwidth(device: str, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read plus the bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2 * nbytes / seconds


def add_bandwidth(result: dict[str, Any], runner: ModelRunner, copy_bw: float, seed: int = 0) -> None:
    """Bytes a decode step must read over step time: all weights + the KV of every token attended to, or for an
    MoE model the weights every token passes through, the experts this batch touches and the KV
    (`step_bytes.moe_step_bytes`); plus a hybrid model's recurrent states."""
    from radixserve.step_bytes import distinct_experts, expert_layers, moe_step_bytes

    if expert_layers(runner):
        hit = distinct_experts(runner, result["batch_size"], result["input_len"], seed)
        result.update(moe_step_bytes(runner, result, hit))
        step_bytes = result["step_bytes"]
    else:
        kv_per_token = runner.token_to_kv_pool.bytes_per_token()
        avg_len = result["input_len"] + result["output_len"] / 2
        step_bytes = runner.weight_bytes + result["batch_size"] * avg_len * kv_per_token
    # a hybrid model's linear-attention layers read each request's recurrent state (and write it back)
    state = result["batch_size"] * getattr(runner, "state_bytes", 0)
    if state:
        result["state_bytes_read"] = state
        step_bytes += state
    achieved = step_bytes / result["median_decode_s"]
    result.update(step_bytes=step_bytes, achieved_bw_gbs=achieved / 1e9, copy_bw_gbs=copy_bw / 1e9,
                  bandwidth_util=achieved / copy_bw)


@torch.inference_mode()
def profile_decode(runner: ModelRunner, batch_size: int, input_len: int, steps: int, seed: int,
                   top: int = 15) -> dict[str, Any]:
    """Decode `steps` steps under the torch profiler: wall time per step, GPU-busy time per step (union of kernel
    intervals), kernels per step, and the kernels that take the most GPU time."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, runner.model_config.vocab_size, (batch_size, input_len), generator=g).tolist()
    sb = StaticBatch(runner)
    batch, _ = sb.prefill(prompts)
    for _ in range(3):
        sb.decode(batch)
    sb._sync()
    # host time per step, without the profiler: the whole step (it ends in a sync) and the part spent in
    # ModelRunner.forward (batch metadata + graph launch) — the GPU idles for whatever the host does outside it
    inner, forward = [], runner.forward

    def timed_forward(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = forward(*a, **k)
        inner.append(time.perf_counter() - t)
        return out

    runner.forward = timed_forward  # type: ignore[method-assign]
    t0 = time.perf_counter()
    for _ in range(steps):
        sb.decode(batch)
    plain_wall = (time.perf_counter() - t0) / steps
    del runner.forward
    # the graph floor: this batch's decode graph replayed back to back with no host work in between (CUDA events):
    # a step's GPU time when the host is never late, which the overlap loop of the server comes within ~1% of
    floor = None
    cgr = runner.cuda_graph_runner
    if cgr is not None and batch_size <= cgr.max_bs:
        import bisect

        graph = cgr.graphs[cgr.capture_bs[bisect.bisect_left(cgr.capture_bs, batch_size)]]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        floor = start.elapsed_time(end) / 50
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            sb.decode(batch)
            sb._sync()
        wall = time.perf_counter() - t0
    sb.release(batch)
    busy, count, table = _kernel_summary(prof, steps, runner.model_config.num_hidden_layers, top)
    return {"batch_size": batch_size, "input_len": input_len, "steps": steps, "wall_ms_per_step": wall / steps * 1e3,
            "unprofiled_wall_ms_per_step": plain_wall * 1e3, "graph_floor_ms": floor,
            "host_forward_call_ms_per_step": sum(inner) / max(1, len(inner)) * 1e3,
            "gpu_busy_ms_per_step": busy / steps / 1e3, "kernels_per_step": count / steps,
            "top_kernels": table}


def profile_prefill(runner: ModelRunner, batch_size: int, input_len: int, seed: int,
                    top: int = 15) -> dict[str, Any]:
    """One prefill of `batch_size` prompts of `input_len` tokens under the torch profiler (after an untimed one):
    wall time, GPU-busy time, kernels and the kernels that take the most GPU time (none on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    sb = StaticBatch(runner)
    activity = torch.profiler.ProfilerActivity.CUDA if runner.is_cuda else torch.profiler.ProfilerActivity.CPU
    for _ in range(2):
        prompts = torch.randint(0, runner.model_config.vocab_size, (batch_size, input_len), generator=g).tolist()
        sb._sync()
        with torch.profiler.profile(activities=[activity]) as prof:
            t0 = time.perf_counter()
            batch, _ = sb.prefill(prompts)
            sb._sync()
            wall = time.perf_counter() - t0
        sb.release(batch)
    busy, count, table = _kernel_summary(prof, 1, runner.model_config.num_hidden_layers, top)
    return {"batch_size": batch_size, "input_len": input_len, "prefill": True, "wall_ms": wall * 1e3,
            "gpu_busy_ms": busy / 1e3, "kernels": count, "tokens_per_s": batch_size * input_len / wall,
            "top_kernels": table}


def _kernel_summary(prof: Any, steps: int, layers: int, top: int) -> tuple[float, int, list[dict[str, Any]]]:
    """GPU-busy µs (the union of kernel intervals), the number of kernels and the `top` kernels by GPU time."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.time_range.end > e.time_range.start]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, cur_s, cur_e = 0.0, None, None
    for s_, e_ in spans:
        if cur_e is None or s_ > cur_e:
            busy += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s_, e_
        else:
            cur_e = max(cur_e, e_)
    busy += 0 if cur_e is None else cur_e - cur_s
    by_name: dict[str, list[float]] = {}
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    table = [{"kernel": name[:90], "calls_per_step": len(ts) / steps, "us_per_step": sum(ts) / steps,
              "share": sum(ts) / max(busy, 1e-9), "us_by_position": _by_layer_position(ts, steps, layers)}
             for name, ts in ranked]
    return busy, len(kernels), table


def _by_layer_position(times: list[float], steps: int, layers: int) -> list[float] | None:
    """For a kernel called c times a layer (c > 1: e.g. the GEMVs of q/k/v, o, gate_up, down), its mean µs at each
    of the c positions within a layer, in call order; None for other kernels."""
    per_step = len(times) // steps
    if len(times) % steps or per_step % layers or per_step // layers < 2:
        return None
    c = per_step // layers
    return [sum(times[i::c]) / (len(times) // c) for i in range(c)]


def print_profile(p: dict[str, Any]) -> None:
    if p.get("prefill"):
        print(f"\nprofile, prefill of {p['batch_size']} x {p['input_len']} tokens: wall {p['wall_ms']:.2f} ms "
              f"({p['tokens_per_s']:,.0f} tok/s), GPU busy {p['gpu_busy_ms']:.2f} ms, {p['kernels']} kernels")
    else:
        _print_decode_header(p)
    print(f"{'us/step':>9} {'calls':>6} {'share':>6}  kernel")
    for k in p["top_kernels"]:
        print(f"{k['us_per_step']:>9.1f} {k['calls_per_step']:>6.0f} {k['share']:>6.1%}  {k['kernel']}")
        if k.get("us_by_position"):
            print(f"{'':>24}per call at each position in a layer: "
                  + ", ".join(f"{v:.1f}" for v in k["us_by_position"]) + " µs")


def _print_decode_header(p: dict[str, Any]) -> None:
    print(f"\nprofile, batch {p['batch_size']}: wall {p['wall_ms_per_step']:.3f} ms/step, GPU busy "
          f"{p['gpu_busy_ms_per_step']:.3f} ms/step, {p['kernels_per_step']:.0f} kernels/step; without the profiler "
          f"{p['unprofiled_wall_ms_per_step']:.3f} ms/step, of which {p['host_forward_call_ms_per_step']:.3f} ms "
          f"in the ModelRunner.forward call (host); graph floor "
          f"{'-' if p['graph_floor_ms'] is None else format(p['graph_floor_ms'], '.3f')} ms (the decode graph "
          f"replayed back to back)")


def correctness_test(runner: ModelRunner, tokenizer: Any, output_len: int) -> list[str]:
    prompts = []
    for p in CORRECTNESS_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer.encode(p)
        prompts.append(list(ids))
    outs = StaticBatch(runner).generate(prompts, output_len)  # a static batch: every row decodes output_len
    stops = {t for t in (*runner.model_config.eos_token_ids, getattr(tokenizer, "eos_token_id", None)) if t is not None}
    texts = []
    for p, o in zip(CORRECTNESS_PROMPTS, outs, strict=True):
        end = next((i for i, t in enumerate(o) if t in stops), len(o))  # the text a server would return
        text = tokenizer.decode(o[:end], skip_special_tokens=True)
        texts.append(text)
        print(f"=== {p}\n{text}\n")
    return texts


def _rank_main(tp_rank: int, argv: list[str]) -> None:
    from radixserve.distributed import parallel_state

    main(argv, tp_rank)
    if parallel_state.model_parallel_is_initialized():  # leave together: a rank gone early aborts the others
        torch.distributed.barrier(group=parallel_state.get_tp_cpu_group())
    # Tearing down NCCL communicators that captured CUDA graphs used can hang at exit (seen on 2 x H200: the
    # results were written, then the ranks sat until killed); everything is written and flushed, so leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(argv: list[str] | None, server_args: ServerArgs) -> None:
    """Run this benchmark in one process per TP rank (torch.multiprocessing, spawn): every rank runs the same
    batches (same seeded prompts, greedy), rank 0 prints and writes the JSON. Raises if a rank fails."""
    import torch.multiprocessing as torch_mp

    from radixserve.utils import free_port

    argv = list(sys.argv[1:] if argv is None else argv)
    argv += ["--model-path", str(server_args.model_path)]  # resolved once, here
    if not server_args.dist_init_addr:
        argv += ["--dist-init-addr", f"127.0.0.1:{free_port()}"]
    torch_mp.spawn(_rank_main, args=(argv,), nprocs=server_args.tp_size, join=True)


def main(argv: list[str] | None = None, tp_rank: int | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, nargs="+", default=[64],
                        help="context lengths to measure (each with every batch size)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--correctness-test", action="store_true")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before measuring")
    parser.add_argument("--profile", action="store_true",
                        help="also profile decode (CUDA only): GPU-busy time per step and the top kernels")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--profile-top", type=int, default=15, help="kernels listed per profile (by GPU time)")
    parser.add_argument("--profile-prefill", type=int, nargs=2, default=None, metavar=("BATCH", "LEN"),
                        help="also profile one prefill of BATCH prompts of LEN tokens (CUDA)")
    parser.add_argument("--result-file", default="bench_one_batch.json")
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    logging.basicConfig(level=server_args.log_level.upper())
    from radixserve.entrypoints.engine import resolve_model

    model_config = resolve_model(server_args)
    if server_args.tp_size > 1 and tp_rank is None:
        spawn_ranks(argv, server_args)
        return
    tp_rank = tp_rank or 0
    if tp_rank > 0:  # the other ranks run the same batches silently
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        args.result_file = os.devnull
    if server_args.max_running_requests is None:
        server_args.max_running_requests = max(args.batch_size + (args.profile_prefill or [0])[:1]
                                               + ([len(CORRECTNESS_PROMPTS)] if args.correctness_test else []))
    runner = ModelRunner(model_config, server_args, tp_rank=tp_rank, tp_size=server_args.tp_size,
                         gpu_id=server_args.base_gpu_id + tp_rank)
    if args.correctness_test:
        from radixserve.managers.tokenizer_utils import get_tokenizer_for

        correctness_test(runner, get_tokenizer_for(server_args, model_config.tokenizer_path), args.output_len)
        return
    results = []
    copy_bw = measure_copy_bandwidth(runner.device) if runner.is_cuda else None
    for input_len in args.input_len:
        for bs in args.batch_size:
            for _ in range(args.warmup):
                latency_test(runner, bs, input_len, min(args.output_len, 4), server_args.random_seed)
            r = latency_test(runner, bs, input_len, args.output_len, server_args.random_seed)
            if copy_bw is not None and r["decode_tok_s"]:
                add_bandwidth(r, runner, copy_bw, server_args.random_seed)
            results.append(r)
    probe = host_probe_us()
    if copy_bw is not None:
        print(f"measured copy bandwidth: {copy_bw / 1e9:.0f} GB/s; weights: {runner.weight_bytes / 1e9:.2f} GB")
    print(f"host probe: {probe:.2f} us a pure-Python loop of 1,000 additions (the host's speed now)")
    base = {r["batch_size"]: r["median_decode_s"] for r in results if r["input_len"] == args.input_len[0]}
    print(f"\n{'batch':>6} {'context':>8} {'prefill ms':>11} {'prefill tok/s':>14} {'decode ms':>10} "
          f"{'decode tok/s':>13} {'vs ctx ' + str(args.input_len[0]):>11} {'BW util':>8}")
    for r in results:
        util = f"{r['bandwidth_util']:.1%}" if "bandwidth_util" in r else "-"
        r["decode_vs_first_context"] = r["median_decode_s"] / base[r["batch_size"]]
        print(f"{r['batch_size']:>6} {r['input_len']:>8} {r['prefill_latency_s'] * 1e3:>11.2f} "
              f"{r['prefill_tok_s']:>14.1f} {r['median_decode_s'] * 1e3:>10.3f} {r['decode_tok_s'] or 0:>13.1f} "
              f"{r['decode_vs_first_context']:>10.2f}x {util:>8}")
    profiles = []
    if args.profile and runner.is_cuda:
        for bs in args.batch_size:
            profiles.append(profile_decode(runner, bs, args.input_len[0], args.profile_steps,
                                           server_args.random_seed, top=args.profile_top))
            print_profile(profiles[-1])
    if args.profile_prefill and runner.is_cuda:
        profiles.append(profile_prefill(runner, *args.profile_prefill, server_args.random_seed, top=args.profile_top))
        print_profile(profiles[-1])
    meta = {"model": model_config.model_path, "device": runner.device, "dtype": str(runner.dtype),
            "attention_backend": type(runner.attn_backend).__name__, "weight_bytes": runner.weight_bytes,
            "threads": torch.get_num_threads(), "cores": os.cpu_count(), "host_probe_us": probe}
    with open(args.result_file, "w") as f:
        json.dump({"meta": meta, "results": results, "profiles": profiles}, f, indent=2)
    print(f"wrote {args.result_file}")


if __name__ == "__main__":
    main()
