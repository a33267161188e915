"""Where the host time of a synchronous decode step goes (bench_one_batch's loop), phase by phase.

    python benchmarks/decode_step_phases.py --model-path radixserve/configs/shapes/llama-3.1-8b --load-format dummy \
        --batch-size 1 --input-len 512 --result-file decode_step_phases.json

One request batch is prefilled, then each decode step is cut into: `prep` (ScheduleBatch.prepare_for_decode), `mwb`
(get_model_worker_batch), `fb_init` (the sampling ops and ForwardBatch.init_new: the one host-to-device copy; for
a decode that replays a graph that is all, else also the request-table writes and the attention metadata),
`forward` (ModelRunner.forward: a graph replay, with its input kernel, or the eager launches),
`sample` (its launch) and `wait` (the sampled ids back on the host, which waits for the device). The device idles
while the host runs everything before `forward`; a synchronous step costs about prep + mwb + fb_init + the device's
time. Medians in microseconds, printed and written to JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from radixserve.bench_one_batch import StaticBatch
from radixserve.entrypoints.engine import resolve_model
from radixserve.model_executor.forward_batch_info import ForwardBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

PHASES = ("prep", "mwb", "fb_init", "forward", "sample", "wait", "step")


@torch.inference_mode()  # entered once, as bench_one_batch's loop does
def measure(runner: ModelRunner, batch_size: int, input_len: int, steps: int) -> dict[str, float]:
    sb = StaticBatch(runner)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, runner.model_config.vocab_size, (batch_size, input_len), generator=g).tolist()
    batch, _ = sb.prefill(prompts)
    for _ in range(10):
        sb.decode(batch)
    sb._sync()
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    for _ in range(steps):
        t0 = time.perf_counter()
        batch.prepare_for_decode()
        t1 = time.perf_counter()
        mwb = batch.get_model_worker_batch()
        t2 = time.perf_counter()
        info = mwb.sampling_info.apply(mwb.sampling_ops) if mwb.sampling_info is not None else None
        fb = ForwardBatch.init_new(mwb, runner, sampling_info=info, req_to_token_writes=mwb.req_to_token_writes)
        t3 = time.perf_counter()
        out = runner.forward(fb)
        t4 = time.perf_counter()
        ids = runner.sample(out, fb)
        t5 = time.perf_counter()
        host = ids.tolist()
        t6 = time.perf_counter()
        for req, tok in zip(batch.reqs, host, strict=True):
            req.output_ids.append(tok)
        for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t6 - t0), strict=True):
            times[k].append(v)
    sb.release(batch)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--result-file", default="decode_step_phases.json")
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    if server_args.max_running_requests is None:
        server_args.max_running_requests = max(args.batch_size)
    runner = ModelRunner(resolve_model(server_args), server_args)
    rows = [{"batch_size": bs, **measure(runner, bs, args.input_len, args.steps)} for bs in args.batch_size]
    print(f"{'batch':>6} " + " ".join(f"{k + ' us':>11}" for k in PHASES))
    for r in rows:
        print(f"{r['batch_size']:>6} " + " ".join(f"{r[k]:>11.1f}" for k in PHASES))
    with open(args.result_file, "w") as f:
        json.dump({"device": runner.device, "input_len": args.input_len, "steps": args.steps, "results": rows}, f,
                  indent=2)
    print(f"wrote {args.result_file}")


if __name__ == "__main__":
    main()
