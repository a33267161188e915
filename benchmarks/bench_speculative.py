"""Speculative decoding on the CPU: tokens/s and acceptance with n-gram speculation against plain decoding, in the
same run, on a workload where the output copies the input (repeat / edit a passage) and on random chat prompts.

    python benchmarks/bench_speculative.py --batch-size 1 4 --num-draft-tokens 3 4 --output-len 128 --repeats 2 \
        --out spec.json

Runs the scheduler in-process (no ZMQ) on the embedded SmolLM2 (or --model-path), greedy, float32 (--dtype). For each
workload and batch size the same requests run with plain decoding and with --speculative-algorithm ngram (the
radix cache is flushed before every run; runs alternate --repeats times and the best time of each is kept). The
outputs of the two must be identical (the script fails otherwise). Reported: output tokens/s (wall time from
submission to the last token, prefill included, the same for both), the speed-up, and the mean tokens committed per
request per verify step (accept len) and per decode step overall (verify steps plus plain steps where nothing was
drafted or a request backed off).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import time
from typing import Any

import torch

from radixserve.managers import io_struct as io
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase funding for the public library, to repair the bridge on Main Street, and to hire two more "
    "teachers for the primary school. The proposal to build a new parking garage was postponed until spring.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n"
    "            total -= values[i - window]\n        if i >= window - 1:\n            out.append(total / window)\n"
    "    return out\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, which contain "
    "the green pigment chlorophyll that absorbs light energy.",
]
INSTRUCTIONS = ["Repeat the following text exactly, word for word:\n\n{p}",
                "Rewrite the following text, changing only the first sentence:\n\n{p}",
                "Copy this text and fix any typos (there may be none):\n\n{p}"]
CHAT = ["What are three tips for staying focused while studying?", "Write a short poem about the sea at night.",
        "Explain what a hash table is to a beginner.", "Give me a recipe idea for a quick vegetarian dinner.",
        "Why is the sky blue?", "Tell me a fun fact about octopuses.", "How do I start learning to play guitar?",
        "Describe a day in the life of a lighthouse keeper."]


def prompts(s: Scheduler, workload: str, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        if workload == "repeat_edit":
            texts.append(INSTRUCTIONS[i % len(INSTRUCTIONS)].format(p=PASSAGES[rng.randrange(len(PASSAGES))]))
        else:
            texts.append(CHAT[rng.randrange(len(CHAT))])
    tok = s.tokenizer
    out = []
    for t in texts:
        if getattr(tok, "chat_template", None):
            t = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        out.append(tok.encode(t, add_special_tokens=False))
    return out


def run(s: Scheduler, batches: list[list[list[int]]], output_len: int) -> tuple[float, list[list[int]], int]:
    """Each batch's requests submitted together, drained, then the next batch. Returns (seconds, outputs,
    decode steps)."""
    s.flush_cache()
    outs: list[list[int]] = []
    steps0 = s.forward_ct
    t0 = time.perf_counter()
    for b, batch in enumerate(batches):
        for i, ids in enumerate(batch):
            sp = SamplingParams.from_dict({"max_new_tokens": output_len, "temperature": 0})
            s.process_input_requests([io.TokenizedGenerateReqInput(rid=f"{b}-{i}", input_text=None, input_ids=ids,
                                                                   sampling_params=sp)])
        got: dict[str, list[int]] = {}
        while s.step() or not s.is_idle():
            pass
        for msg in s.outbox:
            if isinstance(msg, io.BatchTokenIDOut):
                for rid, new in zip(msg.rids, msg.new_token_ids, strict=True):
                    got.setdefault(rid, []).extend(new)
        s.outbox.clear()
        outs += [got[f"{b}-{i}"] for i in range(len(batch))]
    return time.perf_counter() - t0, outs, s.forward_ct - steps0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1])
    ap.add_argument("--num-prompts", type=int, default=4, help="requests per workload and batch size")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, nargs="+", default=[4],
                    help="one speculative run per value (on the CPU, k + 1 <= 8 rows keeps the verify's linears on "
                         "the small-M kernel at batch 1)")
    ap.add_argument("--workloads", nargs="+", default=["repeat_edit", "chat"], choices=["repeat_edit", "chat"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, or auto (bf16 on a CPU with "
                                                     "AVX512-BF16)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    common = dict(model_path=args.model_path, device="cpu", dtype=args.dtype, random_seed=0, max_total_tokens=16384,
                  max_running_requests=max(max(args.batch_size), 8), chunked_prefill_size=-1)
    plain = Scheduler(ServerArgs(**common), port_args={})
    specs = {k: Scheduler(ServerArgs(**common, speculative_algorithm="ngram", speculative_num_draft_tokens=k),
                          port_args={}) for k in args.num_draft_tokens}
    rows: list[dict[str, Any]] = []
    for workload in args.workloads:
        for bs in args.batch_size:
            reqs = prompts(plain, workload, args.num_prompts, seed=bs)
            batches = [reqs[i:i + bs] for i in range(0, len(reqs), bs)]
            runners = [("plain", plain)] + [(f"k{k}", s) for k, s in specs.items()]
            best = {name: float("inf") for name, _ in runners}
            outs: dict[str, list[list[int]]] = {}
            steps: dict[str, int] = {}
            before: dict[str, tuple[int, int]] = {}
            for _ in range(args.repeats):
                for name, s in runners:
                    before[name] = (s.spec_num_tokens, s.spec_num_rows)
                    secs, o, n_steps = run(s, batches, args.output_len)
                    best[name] = min(best[name], secs)
                    outs[name], steps[name] = o, n_steps
            ntok = sum(len(o) for o in outs["plain"])
            for k, s in specs.items():
                name = f"k{k}"
                if outs[name] != outs["plain"]:
                    raise SystemExit(f"{workload} bs={bs} k={k}: outputs differ with speculation")
                v_tokens, v_rows = s.spec_num_tokens - before[name][0], s.spec_num_rows - before[name][1]
                rows.append({"workload": workload, "batch_size": bs, "draft_tokens": k, "requests": len(reqs),
                             "output_tokens": ntok, "plain_tok_s": ntok / best["plain"],
                             "ngram_tok_s": ntok / best[name], "speedup": best["plain"] / best[name],
                             "accept_len_per_verify": v_tokens / v_rows if v_rows else None,
                             "tokens_per_step_plain": ntok / steps["plain"],
                             "tokens_per_step_ngram": ntok / steps[name], "identical_outputs": True})
    print(f"\n{'workload':<12} {'bs':>3} {'k':>2} {'tokens':>7} {'plain tok/s':>12} {'ngram tok/s':>12} "
          f"{'speed-up':>9} {'accept len':>11} {'tok/step':>9}")
    for r in rows:
        acc = f"{r['accept_len_per_verify']:.2f}" if r["accept_len_per_verify"] else "-"
        print(f"{r['workload']:<12} {r['batch_size']:>3} {r['draft_tokens']:>2} {r['output_tokens']:>7} "
              f"{r['plain_tok_s']:>12.1f} {r['ngram_tok_s']:>12.1f} {r['speedup']:>8.2f}x {acc:>11} "
              f"{r['tokens_per_step_ngram']:>9.2f}")
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(), "args": vars(args)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
