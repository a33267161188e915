"""What one speculative verify step costs against a plain decode step: the model's forward over each request's last
token plus k drafted tokens (ForwardMode.TARGET_VERIFY, an extend on top of the request's KV) against the forward
of one token per request (DECODE; through the CUDA graph on a GPU). The verify runs as serving runs it: one decode
row per token (`speculative.verify.as_decode_rows`), so on a GPU it replays the decode graph of batch size
bs * (k + 1) when that is captured (--cuda-graph-max-bs); the eager extend the verify used to be is timed next to
it (`extend` columns) for reference. The ratio bounds the speed-up any acceptance
rate can give: with mean accept length a (tokens per verify), speculation wins when a > verify / decode.

    python benchmarks/bench_spec_verify.py                                  # CPU, the embedded model
    python benchmarks/bench_spec_verify.py --model-path radixserve/configs/shapes/llama-3.1-8b \\
        --load-format dummy --device cuda --batch-size 1 8 32 --draft-tokens 1 2 3 4 5 6 7 8 --out verify.json

Each request first gets a --context-len token prompt prefilled; then decode and verify forwards (k = each of
--draft-tokens) alternate --iters times, timed one by one (synchronised on a GPU); the median is reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from typing import Any

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.managers.schedule_batch import ModelWorkerBatch
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
from radixserve.speculative.verify import as_decode_rows


def make_batch(runner: ModelRunner, mode: ForwardMode, rows: list[int], ctx: int, n_new: int,
               loc: torch.Tensor) -> ModelWorkerBatch:
    """n_new tokens per request after a prefix of ctx (prefill: ctx = 0)."""
    bs = len(rows)
    seq = [ctx + n_new] * bs
    pool = runner.req_to_token_pool
    pool.write_batch(torch.tensor(rows, dtype=torch.int64).repeat_interleave(n_new),
                     torch.arange(ctx, ctx + n_new, dtype=torch.int64).repeat(bs), loc)
    decode = mode.is_decode()
    return ModelWorkerBatch(
        forward_mode=mode,
        input_ids=torch.randint(0, min(1000, runner.model_config.vocab_size), (bs * n_new,), dtype=torch.int64),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64), seq_lens=torch.tensor(seq, dtype=torch.int64),
        seq_lens_cpu=seq, out_cache_loc=loc, seq_lens_sum=sum(seq),
        extend_seq_lens=None if decode else [n_new] * bs, extend_prefix_lens=None if decode else [ctx] * bs,
        return_logprob=False, top_logprobs_nums=None, extend_logprob_start_lens_cpu=None, sampling_info=None,
        sampling_ops=[], req_to_token_writes=pool.take_pending_writes(),
        positions=torch.full((bs,), ctx, dtype=torch.int64) if decode else None)


def timed_forward(runner: ModelRunner, mwb: ModelWorkerBatch, rows: bool = False) -> float:
    runner.req_to_token_pool.apply_writes(mwb.req_to_token_writes)
    mwb.req_to_token_writes = []
    if rows:
        mwb = as_decode_rows(mwb)
    if runner.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        runner.forward(ForwardBatch.init_new(mwb, runner))
    if runner.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1])
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=160,
                    help="largest captured decode batch (as in serving); verify rows beyond it run eagerly")
    ap.add_argument("--extend-k", type=int, nargs="*", default=[4],
                    help="k values whose verify is also timed as the eager extend, for reference")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    max_bs, max_k = max(args.batch_size), max(args.draft_tokens)
    sa = ServerArgs(model_path=args.model_path, load_format=args.load_format, device=args.device, dtype=args.dtype,
                    max_running_requests=max_bs * (max_k + 1) + 1,
                    cuda_graph_max_bs=args.cuda_graph_max_bs,
                    max_total_tokens=max_bs * (args.context_len + max_k + 2) + 16)
    runner = ModelRunner(ModelConfig(args.model_path, load_format=args.load_format), sa)
    results: list[dict[str, Any]] = []
    for bs in args.batch_size:
        rows = runner.req_to_token_pool.alloc(bs)
        prompt_loc = runner.token_to_kv_pool.alloc(bs * args.context_len)
        timed_forward(runner, make_batch(runner, ForwardMode.EXTEND, rows, 0, args.context_len, prompt_loc))
        new_loc = runner.token_to_kv_pool.alloc(bs * (max_k + 1))
        # the same slots are rewritten each time: only the cost of the forward matters here
        dec = make_batch(runner, ForwardMode.DECODE, rows, args.context_len, 1, new_loc[:bs])
        times: dict[str, list[float]] = {"decode": []}
        for _ in range(2):  # warm-up (compilations, graph replays)
            timed_forward(runner, dec)
        for _ in range(args.iters):
            times["decode"].append(timed_forward(runner, dec))
            for k in args.draft_tokens:
                ver = make_batch(runner, ForwardMode.TARGET_VERIFY, rows, args.context_len, 1 + k,
                                 new_loc[:bs * (k + 1)])
                times.setdefault(f"k{k}", []).append(timed_forward(runner, ver, rows=True))
            for k in args.extend_k:
                ver = make_batch(runner, ForwardMode.TARGET_VERIFY, rows, args.context_len, 1 + k,
                                 new_loc[:bs * (k + 1)])
                times.setdefault(f"ext{k}", []).append(timed_forward(runner, ver))
        base = statistics.median(times["decode"])
        row = {"batch_size": bs, "decode_ms": base * 1e3}
        for k in args.draft_tokens:
            med = statistics.median(times[f"k{k}"][1:] or times[f"k{k}"])  # the first of each k may compile
            row[f"verify_k{k}_ms"] = med * 1e3
            row[f"verify_k{k}_ratio"] = med / base
            row[f"verify_k{k}_graph"] = runner.cuda_graph_runner is not None and bs * (k + 1) <= args.cuda_graph_max_bs
        for k in args.extend_k:
            med = statistics.median(times[f"ext{k}"][1:] or times[f"ext{k}"])
            row[f"extend_k{k}_ms"] = med * 1e3
            row[f"extend_k{k}_ratio"] = med / base
        results.append(row)
        print("row", json.dumps(row), flush=True)  # as it comes, in case a time limit cuts the run short
        runner.token_to_kv_pool.free(torch.cat([prompt_loc, new_loc]))
        runner.req_to_token_pool.free(rows)
    print(f"\n{'bs':>4} {'decode ms':>10} " + " ".join(f"{'k=' + str(k):>15}" for k in args.draft_tokens)
          + " ".join(f"{'extend k=' + str(k):>16}" for k in args.extend_k) + "   (* = eager: rows over the graphs)")
    for r in results:
        print(f"{r['batch_size']:>4} {r['decode_ms']:>10.2f} " + " ".join(
            f"{r[f'verify_k{k}_ms']:>7.2f} ({r[f'verify_k{k}_ratio']:.2f}x)"
            + (" " if r[f"verify_k{k}_graph"] or not runner.is_cuda else "*") for k in args.draft_tokens)
            + " ".join(f"{r[f'extend_k{k}_ms']:>8.2f} ({r[f'extend_k{k}_ratio']:.2f}x)" for k in args.extend_k))
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name() if runner.is_cuda else platform.processor() or "cpu",
                "args": vars(args)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
