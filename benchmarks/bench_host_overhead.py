"""Host (Python) cost per decode step of the whole scheduling loop, on the CPU, with a negligible model.

    python benchmarks/bench_host_overhead.py --batch-size 64 128 --result-file host_overhead.json [--profile]

Runs the real Scheduler in-process (as benchmarks/bench_overlap.py does) on a 1-layer tiny model whose forward is
replaced by one lookup in a fixed [vocab, vocab] logits table (the next token depends on the last token only), so
what is measured is the Python work around a forward: building the next batch, ForwardBatch.init_new, replaying
the sampling ops, the future-id map, processing the previous batch's results and pickling the message for the
detokenizer (a fake socket that pickles like zmq's send_pyobj and drops the bytes). Every request streams.

Reported per decode step, in milliseconds of *thread CPU time* (time.thread_time, so waiting for the GIL or for
the other thread is not counted):
  sched   the scheduler thread (schedule + launch + process results + detokenizer message)
  fwd     the forward thread's work (worker.forward_batch_generation + copy_result_to_host); with overlap off it
          runs on the scheduler thread and is counted here instead of in sched
  wall    elapsed time per step
On a GPU the loop keeps the device busy only while max(sched, fwd) (plus GIL contention) stays below the device's
step time. On a GPU, thread CPU time also includes CUDA's spin-wait inside event synchronisation, so there the wall
time is the figure to read. --profile adds one more run per configuration (not counted in the figures) and prints
the cProfile top functions of the scheduler thread (overlap off, where it also runs the forward) and of the forward
thread (overlap on): one profiler at a time, as Python 3.12's cProfile is process-wide."""

from __future__ import annotations

import argparse
import cProfile
import io as _io
import json
import pickle
import pstats
import random
import tempfile
import threading
import time
from typing import Any

import torch

from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.managers import io_struct as io
from radixserve.managers.scheduler import Scheduler
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


class PickleSocket:
    """Stands in for the detokenizer's zmq socket: pays the pickling, drops the bytes."""

    def __init__(self) -> None:
        self.messages = []

    def send_pyobj(self, obj: Any) -> None:
        self.messages.append(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))


def stub_forward(table: torch.Tensor):
    def forward(self: ModelRunner, fb: Any) -> LogitsProcessorOutput:
        ids = fb.input_ids
        if fb.forward_mode.is_extend():
            ids = ids[torch.cumsum(fb.extend_seq_lens, 0) - 1]
        return LogitsProcessorOutput(next_token_logits=table[ids])
    return forward


class Meter:
    """thread_time accumulated inside wrapped methods (per calling thread kind)."""

    def __init__(self) -> None:
        self.fwd = 0.0
        self.profile: cProfile.Profile | None = None
        self.profile_on = False

    def wrap_worker(self, worker: Any) -> None:
        meter = self

        def timed(fn):
            def inner(*a, **k):
                prof = meter.profile if (meter.profile_on and threading.current_thread() is not
                                         threading.main_thread()) else None
                t0 = time.thread_time()
                if prof is not None:
                    prof.enable()
                try:
                    return fn(*a, **k)
                finally:
                    if prof is not None:
                        prof.disable()
                    meter.fwd += time.thread_time() - t0
            return inner

        worker.forward_batch_generation = timed(worker.forward_batch_generation)
        worker.copy_result_to_host = timed(worker.copy_result_to_host)


def run(path: str, bs: int, overlap: bool, input_len: int, steps: int, warmup: int,
        profile: bool, device: str = "cpu") -> dict[str, Any]:
    output_len = warmup + steps + 16  # every measured step is a full decode batch
    real = device != "cpu"  # a real (dummy-weight) model on the GPU: GPU time and launches included
    extra: dict[str, Any] = dict(load_format="dummy", cuda_graph_max_bs=max(bs, 8)) if real else \
        dict(dtype="float32")
    args = ServerArgs(model_path=path, device=device, **extra, skip_tokenizer_init=True, random_seed=0,
                      max_running_requests=bs, disable_overlap_schedule=not overlap, enable_overlap_schedule=overlap,
                      max_total_tokens=bs * (input_len + output_len + 8), chunked_prefill_size=-1,
                      max_prefill_tokens=bs * input_len + 1)
    s = Scheduler(args, port_args={})
    sock = PickleSocket()
    s.send_to_detokenizer = sock
    meter = Meter()
    meter.wrap_worker(s.worker)
    rng = random.Random(0)
    vocab = s.vocab_size
    for i in range(bs):
        sp = SamplingParams.from_dict({"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True})
        s.process_input_requests([io.TokenizedGenerateReqInput(
            rid=f"r{i}", input_text=None, input_ids=[rng.randrange(3, vocab) for _ in range(input_len)],
            sampling_params=sp, stream=True)])
    for _ in range(warmup):  # the prefill and the first decode steps
        s.step()
    # One profiler at a time (Python 3.12's cProfile is process-wide): with overlap off the scheduler thread (which
    # then also runs the forward), with overlap on the forward thread.
    main_prof = cProfile.Profile() if profile and not overlap else None
    if profile and overlap:
        meter.profile = cProfile.Profile()
        meter.profile_on = True
    fwd0, ct0 = meter.fwd, s.forward_ct
    c0, t0 = time.thread_time(), time.perf_counter()
    if main_prof is not None:
        main_prof.enable()
    for _ in range(steps):
        s.step()
    if main_prof is not None:
        main_prof.disable()
    if real:
        torch.cuda.synchronize()
    c1, t1 = time.thread_time(), time.perf_counter()
    fwd = meter.fwd - fwd0  # overlap: forward-thread CPU; off: the part of the main thread's CPU spent there
    n = s.forward_ct - ct0
    sched = (c1 - c0) - (0.0 if overlap else fwd)
    meter.profile_on = False
    while s.step() or not s.is_idle():
        pass
    tokens: dict[str, list[int]] = {}
    for raw in sock.messages:
        msg = pickle.loads(raw)
        for rid, ids in zip(msg.rids, msg.new_token_ids, strict=True):
            tokens.setdefault(rid, []).extend(ids)
    if s.worker_client is not None:
        s.worker_client.shutdown()
    res = {"batch_size": bs, "overlap": overlap, "steps": n, "sched_ms": 1e3 * sched / n, "fwd_ms": 1e3 * fwd / n,
           "wall_ms": 1e3 * (t1 - t0) / n, "memory_ok": s.check_memory(),
           "tokens_digest": hash(tuple((rid, tuple(tokens[rid])) for rid in sorted(tokens)))}
    if profile:
        for name, prof in (("scheduler thread", main_prof), ("forward thread", meter.profile)):
            if prof is None:
                continue
            prof.create_stats()
            buf = _io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            print(f"===== bs={bs} overlap={overlap}: {name} (cProfile, tottime) =====")
            print(buf.getvalue())
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200, help="measured decode steps")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--vocab-size", type=int, default=None, help="the stubbed tiny model's vocabulary (512)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs per configuration; the minimum is reported (other load only adds time)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--model-path", default=None,
                        help="a real model folder (e.g. a shape config) run with dummy weights on --device instead "
                             "of the stubbed tiny model: measures the host cost with real launches on the GPU")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--result-file", default="bench_host_overhead.json")
    args = parser.parse_args()
    if args.model_path is not None and args.vocab_size is not None:
        parser.error("--vocab-size sets the stubbed tiny model's vocabulary; a --model-path model has its own")
    if args.model_path is None:
        args.vocab_size = args.vocab_size or 512
    torch.set_num_threads(1)  # tiny tensors: intra-op threads would only add noise
    from model_utils import make_tiny_model  # tests/model_utils.py (on sys.path below)

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or tmp
        if args.model_path is None:
            make_tiny_model("qwen2", path, seed=0, num_hidden_layers=1, vocab_size=args.vocab_size)
            table = torch.randn(args.vocab_size, args.vocab_size, generator=torch.Generator().manual_seed(0))
            ModelRunner.forward = stub_forward(table)  # type: ignore[method-assign]
        for bs in args.batch_size:
            for overlap in (False, True):
                runs = [run(path, bs, overlap, args.input_len, args.steps, args.warmup, False, args.device)
                        for _ in range(args.repeat)]
                if args.profile:  # an extra run, not counted: the profiler slows what it watches
                    run(path, bs, overlap, args.input_len, args.steps, args.warmup, True, args.device)
                best = {k: min(r[k] for r in runs) for k in ("sched_ms", "fwd_ms", "wall_ms")}
                results.append({**runs[0], **best, "runs": runs})
    print(f"\n{'batch':>6} {'overlap':>8} {'sched ms':>9} {'fwd ms':>8} {'wall ms':>8}")
    for r in results:
        print(f"{r['batch_size']:>6} {str(r['overlap']):>8} {r['sched_ms']:>9.3f} {r['fwd_ms']:>8.3f} "
              f"{r['wall_ms']:>8.3f}")
    for bs in args.batch_size:
        off, on = (next(r for r in results if r["batch_size"] == bs and r["overlap"] == o) for o in (False, True))
        same = all(x["tokens_digest"] == off["tokens_digest"] for x in off["runs"] + on["runs"])
        print(f"batch {bs}: overlap on/off token-identical: {same}; memory ok: "
              f"{all(x['memory_ok'] for x in off['runs'] + on['runs'])}")
    with open(args.result_file, "w") as f:
        json.dump({"input_len": args.input_len, "steps": args.steps, "vocab_size": args.vocab_size,
                   "results": results}, f, indent=2)


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    main()
