"""Offline throughput through the Engine (all processes, no HTTP).

    python -m radixserve.bench_offline_throughput --num-prompts 64 --dataset random \\
        --random-input-len 256 --random-output-len 64 --random-range-ratio 0.5
    python -m radixserve.bench_offline_throughput --dataset shared-prefix --num-prompts 64

Prints requests/s, input and output tok/s and the cache hit rate; writes JSON. --peer transformers runs the same
prompts through transformers `generate` (batched, greedy, fixed output length) in the same process for the ratio."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
from typing import Any

from tqdm import tqdm

from radixserve.managers import io_struct as io
from radixserve.server_args import ServerArgs


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int
                    ) -> list[tuple[list[int], int]]:
    """Prompts of random token ids with lengths uniform in [len * range_ratio, len]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        li = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        lo = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        out.append(([rng.randrange(100, vocab - 100) for _ in range(li)], lo))
    return out


CHAT_TASKS = ["Explain {} in simple terms.", "Write a short poem about {}.", "Give me three tips about {}.",
              "What are the pros and cons of {}?", "Summarize the history of {} in a few sentences.",
              "Tell me a fun fact about {}.", "How would you teach {} to a child?", "Write a tweet about {}."]
CHAT_TOPICS = ["the ocean", "photosynthesis", "coffee", "black holes", "learning a language", "gardening",
               "the Roman Empire", "electric cars", "sleep", "chess", "volcanoes", "bread baking", "running",
               "the internet", "honey bees", "jazz", "recycling", "the moon", "saving money", "rainbows"]


def chat_requests(n: int, output_len: int, range_ratio: float, tok: Any, seed: int
                  ) -> list[tuple[list[int], int]]:
    """Chat-style prompts: short user questions rendered through the tokenizer `tok`'s chat template (with its
    system prompt), output lengths uniform in [output_len * range_ratio, output_len]."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = CHAT_TASKS[i % len(CHAT_TASKS)].format(CHAT_TOPICS[(i * 7 + i // len(CHAT_TASKS)) % len(CHAT_TOPICS)])
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out.append((list(ids), rng.randint(max(1, int(output_len * range_ratio)), output_len)))
    return out


def shared_prefix_requests(n: int, num_groups: int, prefix_len: int, suffix_len: int, output_len: int, vocab: int,
                           seed: int) -> list[tuple[list[int], int]]:
    """`num_groups` long system prompts, each shared by n / num_groups requests with short distinct questions."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab - 100) for _ in range(prefix_len)] for _ in range(num_groups)]
    reqs = [(prefixes[i % num_groups] + [rng.randrange(100, vocab - 100) for _ in range(suffix_len)], output_len)
            for i in range(n)]
    rng.shuffle(reqs)
    return reqs


def run_radixserve(server_args: ServerArgs, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    return run_radixserve_workloads(server_args, [("radixserve", reqs)])[0]


def run_radixserve_workloads(server_args: ServerArgs, workloads: list[tuple[str, list[tuple[list[int], int]]]]
                             ) -> list[dict[str, Any]]:
    """Each (name, requests) workload timed in turn through one engine (one start-up), the cache flushed before
    each; a row per workload."""
    from radixserve import Engine

    rows = []
    with Engine(**dataclasses.asdict(server_args)) as engine:
        # warm up (compiles kernels / captures nothing new; excluded from timing)
        engine.generate(input_ids=[workloads[0][1][0][0][:16]],
                        sampling_params={"max_new_tokens": 4, "temperature": 0})
        for name, reqs in workloads:
            rows.append(_timed(engine, server_args, name, reqs))
    return rows


def _timed(engine: Any, server_args: ServerArgs, name: str, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    engine.flush_cache()
    before = engine.get_internal_state()
    params = [{"max_new_tokens": lo, "temperature": 0, "ignore_eos": True} for _, lo in reqs]
    obj = io.GenerateReqInput(input_ids=[p for p, _ in reqs], sampling_params=params)
    bar = tqdm(total=len(reqs), desc=name, unit="req")

    async def collect() -> list[dict[str, Any]]:
        outs = []
        async for out in engine.tokenizer_manager.generate_request(obj):  # each as it finishes, no streaming
            outs.append(out)
            bar.update(1)
        return outs

    t0 = time.perf_counter()
    outs = engine._run(collect())
    elapsed = time.perf_counter() - t0
    bar.close()
    after = engine.get_internal_state()
    info = engine.tokenizer_manager.scheduler_info
    hit = after["cache_hit_tokens"] - before["cache_hit_tokens"]
    prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    extra: dict[str, Any] = {"tp_size": server_args.tp_size, "dp_size": server_args.dp_size,
                             "enable_dp_attention": server_args.enable_dp_attention, "ep_size": server_args.ep_size,
                             "dtype": info.dtype if info else server_args.dtype,
                             "attention_backend": info.attention_backend if info else None}
    if server_args.resolved_device() == "cpu":
        from radixserve.model_executor.model_runner import cpu_forward_threads

        extra["threads"] = cpu_forward_threads(server_args) or int(os.environ.get("OMP_NUM_THREADS", "0"))
        extra["cores"] = os.cpu_count()
    if "dp_routed" in after:  # DP: where the controller sent the timed requests, and each replica's hit rate
        extra["load_balance_method"] = server_args.load_balance_method
        extra["dp_routed"] = [a - b for a, b in zip(after["dp_routed"], before["dp_routed"], strict=True)]
        extra["dp_cache_routed"] = after.get("dp_cache_routed", 0) - before.get("dp_cache_routed", 0)
        extra["dp_cache_hit_rate"] = [
            (a["cache_hit_tokens"] - b["cache_hit_tokens"])
            / max(a["prompt_tokens_total"] - b["prompt_tokens_total"], 1)
            for a, b in zip(after.get("dp_states", []), before.get("dp_states", []), strict=True)]
    return summarize(name, reqs, [o["meta_info"]["completion_tokens"] for o in outs], elapsed,
                     cache_hit_rate=hit / max(prompt, 1), retractions=after["num_retractions"] -
                     before["num_retractions"], **extra)


def generate_left_padded(model: Any, part: list[tuple[list[int], int]], device: Any) -> None:
    """One static batch through HF generate: the prompts left-padded, greedy, every row to the longest output."""
    import torch

    width = max(len(p) for p, _ in part)
    ids = torch.zeros(len(part), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, (p, _) in enumerate(part):
        ids[j, width - len(p):] = torch.tensor(p)
        mask[j, width - len(p):] = 1
    n = max(lo for _, lo in part)
    with torch.no_grad():
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)


def warm_up_generate(model: Any, prompt: list[int], device: Any) -> None:
    """A few greedy tokens from the prompt's head through HF generate (first-call allocations, oneDNN primitive
    creation), so that the timed run leaves them out as ours does."""
    import torch

    with torch.no_grad():
        model.generate(input_ids=torch.tensor([prompt[:16]], device=device), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)


def run_transformers(model_path: str, reqs: list[tuple[list[int], int]], device: str, dtype: str,
                     batch_size: int, threads: int | None = None) -> dict[str, Any]:
    """Static batches through HF generate (left-padded, greedy, each batch runs to its longest output; only the
    tokens each request asked for count). batch_size 0: all prompts in one batch."""
    import torch
    import transformers as tf

    batch_size = batch_size or len(reqs)
    if threads:  # the same intra-op threads as the engine's forward
        torch.set_num_threads(threads)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
    warm_up_generate(model, reqs[0][0], device)
    produced = []
    bar = tqdm(total=len(reqs), desc="transformers", unit="req")
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        part = reqs[i:i + batch_size]
        generate_left_padded(model, part, device)
        produced += [lo for _, lo in part]  # count only the tokens each request asked for
        bar.update(len(part))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    bar.close()
    return summarize("transformers", reqs, produced, elapsed, batch_size=batch_size, dtype=dtype,
                     threads=torch.get_num_threads())


def summarize(name: str, reqs: list[tuple[list[int], int]], completion: list[int], elapsed: float,
              **extra: Any) -> dict[str, Any]:
    n_in = sum(len(p) for p, _ in reqs)
    n_out = sum(completion)
    return {"engine": name, "num_prompts": len(reqs), "elapsed_s": elapsed, "requests_per_s": len(reqs) / elapsed,
            "input_tok_s": n_in / elapsed, "output_tok_s": n_out / elapsed, "total_input_tokens": n_in,
            "total_output_tokens": n_out, **extra}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dataset", choices=["random", "shared-prefix", "chat"], default="random",
                        help="chat: short questions through the chat template; output lengths as for random")
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.5)
    parser.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct system prompts")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--fixed-output", action="store_true", help="every request generates --random-output-len")
    parser.add_argument("--subset-prompts", type=int, default=0,
                        help="first time the first N prompts with --subset-output-len tokens each through the same "
                             "engine (the subset a slower peer runs; benchmarks/peers/hf_peer.py with the same "
                             "seed, lengths and --num-prompts N --fixed-output makes the same requests)")
    parser.add_argument("--subset-output-len", type=int, default=256)
    parser.add_argument("--peer", choices=["none", "transformers"], default="none")
    parser.add_argument("--peer-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="the peer's dtype (default: the one the engine ran in)")
    parser.add_argument("--peer-batch-size", type=int, default=0,
                        help="prompts per transformers generate call (0: all in one padded batch)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--result-file", default="bench_offline_throughput.json")
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    from radixserve.configs.model_config import ModelConfig

    cfg = ModelConfig(server_args.model_path, context_length=server_args.context_length,
                      load_format=server_args.load_format, trust_remote_code=server_args.trust_remote_code)
    server_args.model_path = cfg.model_path
    if args.dataset == "random":
        reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, cfg.vocab_size, args.seed)
    elif args.dataset == "chat":
        from radixserve.managers.tokenizer_utils import get_tokenizer_for

        reqs = chat_requests(args.num_prompts, args.random_output_len, args.random_range_ratio,
                             get_tokenizer_for(server_args, cfg.tokenizer_path), args.seed)
    else:
        reqs = shared_prefix_requests(args.num_prompts, args.num_groups, args.prefix_len, args.suffix_len,
                                      args.random_output_len, cfg.vocab_size, args.seed)
    if args.fixed_output:
        reqs = [(p, args.random_output_len) for p, _ in reqs]
    workloads = [("radixserve", reqs)]
    if args.subset_prompts:
        if not 0 < args.subset_prompts <= len(reqs):
            raise ValueError(f"--subset-prompts must be in [1, {len(reqs)}]; got {args.subset_prompts}")
        subset = [(p, args.subset_output_len) for p, _ in reqs[:args.subset_prompts]]
        workloads.insert(0, ("radixserve_subset", subset))
    results = run_radixserve_workloads(server_args, workloads)
    results.sort(key=lambda r: r["engine"] != "radixserve")  # the whole workload's row first
    if args.peer == "transformers":
        device = server_args.resolved_device()
        # the dtype the engine ran in, unless --peer-dtype names one (e.g. transformers' own default)
        dtype = args.peer_dtype or results[0]["dtype"].removeprefix("torch.")
        results.append(run_transformers(cfg.model_path, reqs, device, dtype, args.peer_batch_size,
                                        results[0].get("threads") or None))
    print(f"\n{'engine':<17} {'req/s':>8} {'in tok/s':>10} {'out tok/s':>10} {'elapsed s':>10} {'hit rate':>9}")
    for r in results:
        hit = f"{r['cache_hit_rate']:.3f}" if "cache_hit_rate" in r else "-"
        print(f"{r['engine']:<17} {r['requests_per_s']:>8.2f} {r['input_tok_s']:>10.1f} {r['output_tok_s']:>10.1f} "
              f"{r['elapsed_s']:>10.2f} {hit:>9}")
    if "dp_routed" in results[0]:
        r = results[0]
        layout = f"DP attention over tp {r['tp_size']}" if r.get("enable_dp_attention") else \
            f"dp {r['dp_size']} x tp {r['tp_size']}"
        print(f"{layout}, {r['load_balance_method']}: routed {r['dp_routed']} "
              f"({r['dp_cache_routed']} to the replica holding their prefix), replica hit rates "
              f"{', '.join(f'{h:.3f}' for h in r['dp_cache_hit_rate'])}")
    if results[-1]["engine"] == "transformers":
        results[0]["ratio_vs_transformers"] = results[0]["output_tok_s"] / results[-1]["output_tok_s"]
        print(f"output throughput ratio radixserve / transformers: {results[0]['ratio_vs_transformers']:.2f}x")
    with open(args.result_file, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.result_file}")


if __name__ == "__main__":
    main()
