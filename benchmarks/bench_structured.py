"""Structured output cost: decode throughput of a JSON-schema batch vs the same batch unconstrained, and grammar
compile time.

    python benchmarks/bench_structured.py --batch-size 8 32 --output-len 64

Runs the scheduler in-process (no ZMQ) on the embedded SmolLM2 (or --model-path with its tokenizer). Each batch is
`bs` requests with the same chat prompt and per-request seeds (temperature 0.8). The constrained run gives every
request a JSON schema (an array of at least 64 person objects) that cannot be finished within --output-len tokens,
so, like the unconstrained run (ignore_eos), every request decodes exactly --output-len tokens and every decode
step is full. Throughput is measured over the decode steps only (after the prefill). Runs alternate plain /
constrained --repeats times and the best of each is kept (less noise on a shared machine). Also reported: the time
the scheduler spends building the token bitmask per step, and cold / cached compile times of a few grammars.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from typing import Any

import torch

from radixserve.managers import io_struct as io
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.(com|org|net)$"},
                         "role": {"enum": ["admin", "editor", "viewer"]},
                         "active": {"type": "boolean"}},
          "required": ["name", "age", "email", "role", "active"]}
BENCH_SCHEMA = {"type": "array", "items": PERSON, "minItems": 64}
PROMPT = "Generate a JSON list of 64 people with name, age, email, role and active fields."
COMPILE_CASES = {
    "json_schema (bench schema)": ("json_schema", json.dumps(BENCH_SCHEMA)),
    "json_schema (person)": ("json_schema", json.dumps(PERSON)),
    "regex (phone)": ("regex", r"\(\d{3}\) \d{3}-\d{4}"),
    "ebnf (arithmetic)": ("ebnf", 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'),
}


def make_scheduler(args: argparse.Namespace, overlap: bool, bs: int) -> Scheduler:
    sa = ServerArgs(model_path=args.model_path, tokenizer_path=args.tokenizer_path, load_format=args.load_format,
                    device=args.device, random_seed=0,
                    max_total_tokens=args.max_total_tokens, max_running_requests=max(bs, 8),
                    disable_overlap_schedule=not overlap, enable_overlap_schedule=overlap, chunked_prefill_size=-1)
    return Scheduler(sa, port_args={})


def chat_ids(s: Scheduler) -> list[int]:
    tok = s.tokenizer
    if not getattr(tok, "chat_template", None):  # a bare tokenizer (benchmark shapes): the plain prompt
        return tok.encode(PROMPT, add_special_tokens=False)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


class MaskTimer:
    """Wraps Scheduler.build_grammar_bitmask to sum the time spent building masks."""

    def __init__(self, s: Scheduler) -> None:
        self.total = 0.0
        self.calls = 0
        inner = s.build_grammar_bitmask

        def timed(reqs: list[Any]) -> Any:
            t = time.perf_counter()
            try:
                return inner(reqs)
            finally:
                self.total += time.perf_counter() - t
                self.calls += 1

        s.build_grammar_bitmask = timed  # type: ignore[method-assign]


def run_batch(s: Scheduler, bs: int, output_len: int, constrained: bool, timer: MaskTimer) -> dict[str, Any]:
    ids = chat_ids(s)
    schema = json.dumps(BENCH_SCHEMA)
    for i in range(bs):
        sp: dict[str, Any] = {"max_new_tokens": output_len, "temperature": 0.8, "seed": i, "ignore_eos": True}
        if constrained:
            sp["json_schema"] = schema
        params = SamplingParams.from_dict(sp)
        params.normalize(s.tokenizer)
        s.process_input_requests([io.TokenizedGenerateReqInput(rid=f"{'j' if constrained else 'p'}{i}",
                                                               input_text=None, input_ids=ids,
                                                               sampling_params=params)])
    # compile (or cache hit) and prefill, then two decode steps, outside the timed window
    deadline = time.monotonic() + 300
    while s.forward_ct == 0 or s.grammar_queue or s.waiting_queue:
        if not s.step():
            time.sleep(0.0005)
        if time.monotonic() > deadline or (s.forward_ct == 0 and not s.waiting_queue and not s.grammar_queue):
            raise RuntimeError(f"the requests never started (rejected?): {s.outbox[-1:]}")
    for _ in range(2):
        s.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ct0, mask0, calls0 = s.forward_ct, timer.total, timer.calls
    t0 = time.perf_counter()
    while s.step() or not s.is_idle():
        pass
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    outs: dict[str, list[int]] = {}
    finishes: dict[str, Any] = {}
    for msg in s.outbox:
        if isinstance(msg, io.BatchTokenIDOut):
            for rid, new, fin in zip(msg.rids, msg.new_token_ids, msg.finished_reasons, strict=True):
                outs.setdefault(rid, []).extend(new)
                finishes[rid] = fin
    s.outbox.clear()
    lengths = [len(v) for v in outs.values()]
    if len(outs) != bs or any(n != output_len for n in lengths):
        raise RuntimeError(f"expected {bs} requests of {output_len} tokens, got {sorted(lengths)}: {finishes}")
    steps = s.forward_ct - ct0
    sample = s.tokenizer.decode(outs[f"{'j' if constrained else 'p'}0"], skip_special_tokens=True)
    if constrained and not sample.startswith("["):
        raise RuntimeError(f"constrained output does not follow the schema: {sample[:80]!r}")
    s.flush_cache()
    return {"decode_steps": steps, "decode_tokens": steps * bs, "elapsed_s": elapsed,
            "tok_per_s": steps * bs / elapsed, "step_ms": 1000 * elapsed / steps,
            "mask_ms_per_step": 1000 * (timer.total - mask0) / max(1, timer.calls - calls0) if constrained else 0.0,
            "sample": sample[:120]}


def compile_times(s: Scheduler) -> dict[str, dict[str, float]]:
    """Cold compile on a fresh backend (nothing cached), then the cached lookup."""
    from radixserve.constrained import create_grammar_backend

    t = time.perf_counter()
    backend = create_grammar_backend(s.server_args, s.tokenizer, s.vocab_size,
                                     eos_token_ids=s.model_config.eos_token_ids)
    init_ms = 1000 * (time.perf_counter() - t)
    out: dict[str, dict[str, float]] = {"backend init (token table)": {"cold_ms": init_ms, "cached_ms": 0.0}}
    try:
        for name, (kind, text) in COMPILE_CASES.items():
            t = time.perf_counter()
            backend.get_future(kind, text).result()
            cold = 1000 * (time.perf_counter() - t)
            t = time.perf_counter()
            backend.get_future(kind, text).result().copy()
            cached = 1000 * (time.perf_counter() - t)
            out[name] = {"cold_ms": cold, "cached_ms": cached}
    finally:
        backend.shutdown()
    return out


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"
    if torch.cuda.is_available():
        desc = f"{torch.cuda.get_device_name()} ; host {desc}"
    return desc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--tokenizer-path", default=None, help="default: the model folder")
    p.add_argument("--load-format", default="auto", help="dummy: random weights (benchmark shapes)")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int, nargs="+", default=[8])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=["normal", "overlap"], choices=["normal", "overlap"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--output", default="structured_bench.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_total_tokens is None:
        args.max_total_tokens = max(args.batch_size) * (args.output_len + 128) + 1024

    rows = []
    compile_res: dict[str, dict[str, float]] = {}
    for mode in args.modes:
        for bs in args.batch_size:
            s = make_scheduler(args, mode == "overlap", bs)
            if s.grammar_backend is None:
                raise SystemExit("no grammar backend (is xgrammar installed?)")
            if not compile_res:
                compile_res = compile_times(s)
            timer = MaskTimer(s)
            run_batch(s, bs, min(8, args.output_len), True, timer)  # warm-up (compile, first shapes)
            plain, cons = [], []
            for _ in range(args.repeats):
                plain.append(run_batch(s, bs, args.output_len, False, timer))
                cons.append(run_batch(s, bs, args.output_len, True, timer))
            best_p = max(plain, key=lambda r: r["tok_per_s"])
            best_c = max(cons, key=lambda r: r["tok_per_s"])
            rows.append({"mode": mode, "batch_size": bs, "output_len": args.output_len,
                         "plain_tok_per_s": best_p["tok_per_s"], "json_tok_per_s": best_c["tok_per_s"],
                         "slowdown_pct": 100 * (1 - best_c["tok_per_s"] / best_p["tok_per_s"]),
                         "plain_step_ms": best_p["step_ms"], "json_step_ms": best_c["step_ms"],
                         "mask_ms_per_step": statistics.median(r["mask_ms_per_step"] for r in cons),
                         "plain_runs_tok_per_s": [r["tok_per_s"] for r in plain],
                         "json_runs_tok_per_s": [r["tok_per_s"] for r in cons],
                         "json_sample": best_c["sample"]})
            del s

    print(f"\nStructured output — {hardware()}")
    print(f"decode tok/s, {args.output_len} tokens per request, temperature 0.8, best of {args.repeats}\n")
    print("| mode | batch | plain tok/s | JSON-schema tok/s | slowdown | plain step ms | JSON step ms | "
          "mask build ms/step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['batch_size']} | {r['plain_tok_per_s']:.1f} | {r['json_tok_per_s']:.1f} | "
              f"{r['slowdown_pct']:.1f}% | {r['plain_step_ms']:.1f} | {r['json_step_ms']:.1f} | "
              f"{r['mask_ms_per_step']:.2f} |")
    print("\n| grammar | cold compile ms | cached ms |")
    print("|---|---:|---:|")
    for name, c in compile_res.items():
        print(f"| {name} | {c['cold_ms']:.2f} | {c['cached_ms']:.3f} |")
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "hardware": hardware(),
              "args": vars(args), "schema": BENCH_SCHEMA, "rows": rows, "compile": compile_res}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
