"""What a prefill chunk costs the requests that decode meanwhile: a chunk step then a decode step (an unmixed
chunk's schedule) against one MIXED step that carries both (the step token budget's).

    python benchmarks/bench_mixed_step.py --model-path radixserve/configs/shapes/llama-3.1-8b --load-format dummy \
        --decodes 16 32 48 --context 1024 --chunk 256 --result-file mixed_step.json

N requests are prefilled to `--context` tokens and decode; then, for each chunk, a fresh prompt of that many tokens
(no cached prefix) is timed three ways through the ModelRunner with its CUDA graphs: `decode` (the N requests step
alone), `chunk` (the prompt alone), `mixed` (the prompt's first chunk - N tokens with the N decodes riding along:
the same token count as the chunk, a budget shared by both) and `mixed_full` (the whole chunk plus the N decodes).
Times are the device's: a long sleep kernel queued before each step keeps the host's preparation off the clock
(the overlap loop of the server hides it too; on the CPU: wall time); the host's time to launch each step is
reported beside it. Medians over `--trials`, in ms, printed and written to JSON; with `--profile` also the top
kernels of each kind of step, with `--cprofile` where the host's launch of a mixed step spends its time."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from radixserve.bench_one_batch import StaticBatch
from radixserve.entrypoints.engine import resolve_model
from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.managers.tp_worker import run_model_worker_batch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

MODES = ("decode", "chunk", "mixed", "mixed_full")


class MixedStepBench:
    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.sb = StaticBatch(runner)
        self.vocab = runner.model_config.vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        self.count = 0
        self.host_ms = 0.0  # the last step's launch time on the host

    def _prompt(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def running(self, decodes: int, context: int) -> ScheduleBatch:
        batch, _ = self.sb.prefill([self._prompt(context) for _ in range(decodes)])
        for _ in range(3):
            self.sb.decode(batch)
        self.sb._sync()
        return batch

    def _new_prefill(self, tokens: int) -> ScheduleBatch:
        self.count += 1
        req = Req(f"p{self.count}", self._prompt(tokens),
                  SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1 << 30}))
        req.init_next_round_input(None)
        batch = ScheduleBatch([req], self.runner.req_to_token_pool, self.runner.token_to_kv_pool, None,
                              self.runner.device, self.vocab)
        batch.prepare_for_extend()
        return batch

    def _timed(self, batch: ScheduleBatch) -> float:
        """The device's time for one step of `batch`, in ms (host preparation kept off the clock); on the CPU the
        step's wall time."""
        if not self.runner.is_cuda:
            t0 = time.perf_counter()
            result = run_model_worker_batch(self.runner, batch.get_model_worker_batch())
            out = result.next_token_ids.tolist()
            for req, t in zip(batch.reqs, out, strict=True):
                req.output_ids.append(t)
            self.host_ms = (time.perf_counter() - t0) * 1e3
            return self.host_ms
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~20-30 ms of GPU time, longer than the host's preparation
        start.record()
        t0 = time.perf_counter()
        result = run_model_worker_batch(self.runner, batch.get_model_worker_batch())
        self.host_ms = (time.perf_counter() - t0) * 1e3  # the launches (the device is still asleep)
        end.record()
        out = result.next_token_ids.tolist()
        for req, t in zip(batch.reqs, out, strict=True):
            req.output_ids.append(t)
        return start.elapsed_time(end)

    def step(self, mode: str, running: ScheduleBatch, chunk: int) -> float:
        if mode == "decode":
            running.prepare_for_decode()
            return self._timed(running)
        tokens = {"chunk": chunk, "mixed": chunk - len(running.reqs), "mixed_full": chunk}[mode]
        batch = self._new_prefill(tokens)
        if mode != "chunk":
            batch.mix_with_running(running)
        ms = self._timed(batch)
        self.sb.release(ScheduleBatch(batch.reqs[:1], self.runner.req_to_token_pool, self.runner.token_to_kv_pool,
                                      None, self.runner.device, self.vocab))
        return ms


def profile_step(bench: MixedStepBench, mode: str, running: ScheduleBatch, chunk: int, top: int) -> list[dict]:
    if not bench.runner.is_cuda:
        return []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            bench.step(mode, running, chunk)
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "sleep" not in e.name:
            by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 3
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return [{"kernel": k[:90], "us_per_step": v} for k, v in ranked]


def cprofile_step(bench: MixedStepBench, mode: str, running: ScheduleBatch, chunk: int, top: int) -> str:
    """The host's launch of a few steps under cProfile: where its Python time goes."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    orig = bench._timed

    def timed(batch: ScheduleBatch) -> float:
        prof.enable()
        try:
            return orig(batch)
        finally:
            prof.disable()

    bench._timed = timed  # type: ignore[method-assign]
    for _ in range(3):
        bench.step(mode, running, chunk)
    del bench._timed
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top * 2)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--decodes", type=int, nargs="+", default=[16, 32, 48])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--chunk", type=int, nargs="+", default=[256])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-top", type=int, default=12)
    parser.add_argument("--cprofile", action="store_true", help="also the host's launch of a mixed step under "
                        "cProfile (its top functions by own time)")
    parser.add_argument("--result-file", default="mixed_step.json")
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    if server_args.max_running_requests is None:
        server_args.max_running_requests = max(args.decodes) + 8
    runner = ModelRunner(resolve_model(server_args), server_args)
    bench = MixedStepBench(runner)
    rows: list[dict[str, Any]] = []
    for n in args.decodes:
        running = bench.running(n, args.context)
        for chunk in args.chunk:
            if chunk <= n:
                continue
            for mode in MODES:  # warm-up: compile and first replays
                bench.step(mode, running, chunk)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            host: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(args.trials):
                for mode in MODES:
                    times[mode].append(bench.step(mode, running, chunk))
                    host[mode].append(bench.host_ms)
            row: dict[str, Any] = {"decodes": n, "context": args.context, "chunk_tokens": chunk,
                                   **{m: statistics.median(v) for m, v in times.items()},
                                   **{f"{m}_host": statistics.median(v) for m, v in host.items()}}
            if args.cprofile:
                row["cprofile"] = cprofile_step(bench, "mixed", running, chunk, args.profile_top)
            if args.profile:
                row["profile"] = {m: profile_step(bench, m, running, chunk, args.profile_top) for m in MODES}
            rows.append(row)
        bench.sb.release(running)
    print(f"\n{'decodes':>7} {'chunk':>6} {'decode ms':>10} {'chunk ms':>9} {'chunk+decode':>13} "
          f"{'mixed ms':>9} {'mixed_full ms':>14}   host ms: decode / chunk / mixed / mixed_full")
    for r in rows:
        print(f"{r['decodes']:>7} {r['chunk_tokens']:>6} {r['decode']:>10.2f} {r['chunk']:>9.2f} "
              f"{r['chunk'] + r['decode']:>13.2f} {r['mixed']:>9.2f} {r['mixed_full']:>14.2f}   "
              + " / ".join(f"{r[m + '_host']:.2f}" for m in MODES))
    for r in rows:
        if "cprofile" in r:
            print(f"\nmixed step launch, {r['decodes']} decodes, under cProfile:\n{r['cprofile']}")
    for r in rows:
        for m, kernels in r.get("profile", {}).items():
            print(f"\n{m}, {r['decodes']} decodes, chunk {r['chunk_tokens']}:")
            for k in kernels:
                print(f"{k['us_per_step']:>9.1f}  {k['kernel']}")
    with open(args.result_file, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if runner.is_cuda else "cpu", "server_args": {
            "piecewise_cuda_graph_max_tokens": server_args.piecewise_cuda_graph_max_tokens,
            "attention_backend": server_args.attention_backend}, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
