"""Offline throughput of the attention backends and page sizes on the same prompts, one process.

For each `backend:page_size` a Scheduler is built in this process (its model runner loads the model, sizes the pool
and captures its CUDA graphs; no ZMQ, no tokenizer), every prompt is submitted at once, and `Scheduler.step` (the
loop the server's scheduler process runs) drains them; the clock runs from the submission to the last token.
A short warm-up request runs first (compiles kernels; not timed). Then the scheduler is dropped and the next one
built, so the configurations never share a pool.

    python benchmarks/bench_offline_backends.py --model-path radixserve/configs/shapes/llama-3.1-8b \\
        --load-format dummy --configs triton:1 triton:16 flex:16 flex:1 flashinfer:16 flashinfer:1 \\
        torch_native:16 torch_native:1 --num-prompts 200 --random-input-len 512 --random-output-len 256

Prompts: random token ids, lengths uniform in [len * --random-range-ratio, len] (the same seed for every
configuration; `bench_offline_throughput.random_requests`), each decoding its own length with ignore_eos. Prints one
table row per configuration as soon as it is measured and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from radixserve.bench_offline_throughput import random_requests  # noqa: E402
from radixserve.configs.model_config import ModelConfig  # noqa: E402
from radixserve.managers import io_struct as io  # noqa: E402
from radixserve.managers.scheduler import Scheduler  # noqa: E402
from radixserve.sampling.sampling_params import SamplingParams  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402


def submit(s: Scheduler, reqs: list[tuple[list[int], int]], tag: str) -> None:
    msgs = []
    for i, (prompt, n) in enumerate(reqs):
        params = SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        msgs.append(io.TokenizedGenerateReqInput(rid=f"{tag}{i}", input_text=None, input_ids=prompt,
                                                 sampling_params=params))
    s.process_input_requests(msgs)


def drain(s: Scheduler) -> int:
    """Steps until idle; returns the output tokens produced."""
    produced = 0
    while True:
        busy = s.step()
        for msg in s.outbox:
            if isinstance(msg, io.BatchTokenIDOut):
                produced += sum(len(ids) for ids in msg.new_token_ids)
        s.outbox.clear()
        if not busy and s.is_idle():
            return produced


def run_config(base: ServerArgs, backend: str, page_size: int, reqs: list[tuple[list[int], int]]) -> dict:
    args = dataclasses.replace(base, attention_backend=backend, page_size=page_size)
    t0 = time.perf_counter()
    s = Scheduler(args, port_args={})
    setup_s = time.perf_counter() - t0
    try:
        t = time.perf_counter()
        submit(s, [(reqs[0][0][:16], 4)], "warm")
        drain(s)
        warm_s = time.perf_counter() - t
        if str(s.device).startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        submit(s, reqs, "r")
        produced = drain(s)
        if str(s.device).startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        ok = s.check_memory()
    finally:
        if s.worker_client is not None:
            s.worker_client.shutdown()
        del s
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    left_gb = torch.cuda.memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0  # what the next one lacks
    expected = sum(n for _, n in reqs)
    if produced != expected:
        raise RuntimeError(f"{backend}:{page_size} produced {produced} tokens, expected {expected}")
    return {"backend": backend, "page_size": page_size, "elapsed_s": elapsed, "output_tokens": produced,
            "input_tokens": sum(len(p) for p, _ in reqs), "output_tok_s": produced / elapsed,
            "requests_per_s": len(reqs) / elapsed, "setup_s": setup_s, "warmup_s": warm_s, "pool_ok": ok,
            "gpu_gb_left_after": left_gb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--configs", nargs="+", default=["triton:1", "triton:16", "flex:16", "flex:1"],
                        help="backend:page_size runs, in order")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--random-input-len", type=int, default=512)
    parser.add_argument("--random-output-len", type=int, default=256)
    parser.add_argument("--random-range-ratio", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--result-file", default="bench_offline_backends.json")
    args = parser.parse_args()
    base = ServerArgs.from_cli_args(args)
    base.skip_tokenizer_init = True
    cfg = ModelConfig(base.model_path, load_format=base.load_format)
    base.model_path = cfg.model_path
    reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                           cfg.vocab_size, args.seed)
    print(f"{len(reqs)} prompts: {sum(len(p) for p, _ in reqs)} input tokens, {sum(n for _, n in reqs)} output "
          f"tokens", flush=True)
    print(f"{'backend':>13} {'page':>5} {'elapsed s':>10} {'out tok/s':>10} {'req/s':>7}  setup / warm-up s",
          flush=True)
    results = []
    for cfg_text in args.configs:
        backend, page = cfg_text.split(":")
        try:
            r = run_config(base, backend, int(page), reqs)
        except Exception as e:  # one configuration failing must not stop the others
            print(f"{backend:>13} {page:>5} FAILED: {type(e).__name__}: {e}", flush=True)
            results.append({"backend": backend, "page_size": int(page), "error": f"{type(e).__name__}: {e}"})
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        results.append(r)
        print(f"{backend:>13} {page:>5} {r['elapsed_s']:>10.2f} {r['output_tok_s']:>10.1f} {r['requests_per_s']:>7.2f}"
              f"  {r['setup_s']:.1f} / {r['warmup_s']:.1f}{'' if r['pool_ok'] else '  POOL LEAK'}"
              f"  ({r['gpu_gb_left_after']:.1f} GB still allocated after)", flush=True)
    done = [r for r in results if "error" not in r]
    if done:
        best = max(r["output_tok_s"] for r in done)
        print("vs the best: " + ", ".join(f"{r['backend']}:{r['page_size']} {r['output_tok_s'] / best - 1:+.1%}"
                                         for r in done), flush=True)
    with open(args.result_file, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if isinstance(v, int | float | str | list | None)},
                   "num_prompts": len(reqs), "results": results}, f, indent=2)
    print(f"wrote {args.result_file}", flush=True)


if __name__ == "__main__":
    main()
