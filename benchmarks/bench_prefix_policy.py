"""Schedule policies on a shared-prefix workload whose prefixes do not all fit in the KV pool.

`--groups` system prompts of `--prefix-len` tokens, each followed by `--per-group` questions of `--question-len`
tokens; the requests arrive interleaved (group 0's first question, group 1's first, ..., then every group's second,
...), all at once, and the KV pool (`--max-total-tokens`) holds only a few of the prefixes at a time. `fcfs` admits
them in arrival order, so each prefill batch mixes groups and a prefix is often evicted before its group comes
round again; `lpm` admits first the requests whose prefix is cached. The scheduler runs in-process (the production
step function); one model load serves every policy (the cache is flushed between them).

    python benchmarks/bench_prefix_policy.py                       # the embedded SmolLM2 on the CPU
    python benchmarks/bench_prefix_policy.py --model-path radixserve/configs/shapes/llama-3.1-8b \\
        --load-format dummy --groups 16 --per-group 8 --prefix-len 2048 --max-total-tokens 12288

Prints a table (cache hit rate = prompt tokens served from the cache / prompt tokens; throughput = prompt and
output tokens per second of wall time) and writes the JSON to --result-file.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from typing import Any

import torch

from radixserve.managers import io_struct as io
from radixserve.managers.schedule_policy import LPM_MAX_QUEUE, SchedulePolicy
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Prompts in arrival order (interleaved across groups)."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(args.prefix_len)] for _ in range(args.groups)]
    prompts = []
    for _ in range(args.per_group):
        for g in range(args.groups):
            prompts.append(prefixes[g] + [rng.randrange(10, vocab) for _ in range(args.question_len)])
    return prompts


def run_policy(s: Scheduler, policy: str, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, Any]:
    s.policy = SchedulePolicy(policy, s.tree_cache, s.server_args.random_seed)
    if not s.flush_cache():
        raise RuntimeError("the scheduler is not idle")
    s.cache_hit_tokens = s.prompt_tokens_total = s.num_retractions = 0
    forward_ct = s.forward_ct
    sp = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    s.process_input_requests([io.TokenizedGenerateReqInput(rid=f"{tag}{i}", input_text=None, input_ids=p,
                                                           sampling_params=SamplingParams.from_dict(sp))
                              for i, p in enumerate(prompts)])
    while s.step() or not s.is_idle():
        pass
    if s.device != "cpu":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    outputs = sum(len(ids) for m in s.outbox if isinstance(m, io.BatchTokenIDOut) for ids in m.new_token_ids)
    s.outbox.clear()
    if not s.check_memory():
        raise RuntimeError("the pools do not balance after the run")
    prompt_tokens = s.prompt_tokens_total
    return {"policy": policy, "requests": len(prompts), "prompt_tokens": prompt_tokens,
            "cached_tokens": s.cache_hit_tokens, "cache_hit_rate": s.cache_hit_tokens / max(prompt_tokens, 1),
            "prefill_tokens_computed": prompt_tokens - s.cache_hit_tokens, "output_tokens": outputs,
            "steps": s.forward_ct - forward_ct, "retractions": s.num_retractions, "wall_s": wall,
            "total_tok_s": (prompt_tokens + outputs) / wall, "output_tok_s": outputs / wall,
            "requests_per_s": len(prompts) / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--policies", nargs="+", default=["fcfs", "lpm"])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="runs per policy, alternating; the best is reported")
    parser.add_argument("--result-file", default="bench_prefix_policy.json")
    args = parser.parse_args()
    if args.model_path is None:
        from radixserve.model_loader.embedded import ensure_embedded_model

        args.model_path = ensure_embedded_model()
    if args.max_total_tokens is None:  # room for about a quarter of the prefixes
        args.max_total_tokens = max(args.groups // 4, 2) * (args.prefix_len + args.question_len + args.output_len)
    args.skip_tokenizer_init = True
    server_args = ServerArgs.from_cli_args(args)
    n = args.groups * args.per_group
    if n > LPM_MAX_QUEUE:
        print(f"warning: {n} requests wait at once, more than LPM_MAX_QUEUE={LPM_MAX_QUEUE}: lpm orders them fcfs")
    s = Scheduler(server_args, port_args={})
    if args.max_total_tokens >= args.groups * args.prefix_len:
        print("warning: every prefix fits in the pool at once")
    prompts = workload(args, s.vocab_size)
    device = torch.cuda.get_device_name() if s.device != "cpu" else f"CPU ({platform.processor() or 'x86-64'}, " \
        f"{torch.get_num_threads()} threads)"
    result: dict[str, Any] = {
        "benchmark": "bench_prefix_policy", "date": time.strftime("%Y-%m-%d"), "device": device,
        "model": args.model_path, "load_format": args.load_format, "pool_tokens": s.token_to_kv_pool.size,
        "attention_backend": type(s.worker.model_runner.attn_backend).__name__,
        "cuda_graph": s.worker.model_runner.cuda_graph_runner is not None,
        "workload": {k: getattr(args, k) for k in ("groups", "per_group", "prefix_len", "question_len", "output_len",
                                                   "seed")},
        "results": []}
    print(f"{device}; {args.model_path}; pool {s.token_to_kv_pool.size} tokens; {args.groups} prefixes x "
          f"{args.prefix_len} tokens (all: {args.groups * args.prefix_len}), {args.per_group} questions each, "
          f"{args.question_len}-token questions, {args.output_len} output tokens", flush=True)
    header = (f"{'policy':<10} {'hit rate':>8} {'prefill tok':>11} {'wall s':>8} {'tok/s':>9} {'out tok/s':>9} "
              f"{'req/s':>7} {'retract':>7}")
    print(header, flush=True)
    # warm-up (kernel compilation, allocator): a few requests of the same shapes, not timed
    run_policy(s, "fcfs", prompts[: min(len(prompts), 4)], args.output_len, "warm")
    best: dict[str, dict[str, Any]] = {}
    for r in range(args.repeat):
        for policy in args.policies:
            res = run_policy(s, policy, prompts, args.output_len, f"{policy}{r}-")
            print(_row(res) + (f"  (run {r + 1})" if args.repeat > 1 else ""), flush=True)
            if policy not in best or res["wall_s"] < best[policy]["wall_s"]:
                best[policy] = res
            result["results"] = [best[p] for p in args.policies if p in best]
            with open(args.result_file, "w") as f:  # after every run: a cut-short run keeps what it measured
                json.dump(result, f, indent=2)
    if args.repeat > 1:
        print("best of each:\n" + header)
        for res in result["results"]:
            print(_row(res))


def _row(r: dict[str, Any]) -> str:
    return (f"{r['policy']:<10} {r['cache_hit_rate']:>8.1%} {r['prefill_tokens_computed']:>11} {r['wall_s']:>8.2f} "
            f"{r['total_tok_s']:>9.0f} {r['output_tok_s']:>9.1f} {r['requests_per_s']:>7.2f} {r['retractions']:>7}")


if __name__ == "__main__":
    main()
