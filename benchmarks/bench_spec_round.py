"""Draft-model speculation, time per round: the real scheduler (in-process) with --speculative-algorithm draft_model,
each step of a running batch timed as plain decoding and as a speculative round (the draft's k forwards: its
catch-up and k - 1 decodes, then the target's verify of the k drafts, then committing the kept tokens).

    python benchmarks/bench_spec_round.py --model-path radixserve/configs/shapes/llama-3.1-8b \\
        --draft-shape radixserve/configs/shapes/qwen2.5-0.5b --load-format dummy --device cuda \\
        --batch-size 1 8 --num-draft-tokens 4 --steps 20

--draft-shape is a config directory whose vocabulary is replaced by the target's (a draft must share the target's
tokenizer; the Qwen2.5-0.5B shape drafting for a Llama-3.1-8B target thus gets 128,256 rows of embeddings); with
random weights (--load-format dummy) the drafts are rejected, so the adaptive back-off is switched off here: every
round drafts k tokens, which is what the time of a round means. Plain steps are taken in the same scheduler with
drafting off for that step. Reported: median ms per plain decode step, per round, and the parts of a round (draft,
verify) timed around the drafter and the verify forward (synchronised on a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from radixserve.managers import io_struct as io
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.speculative import scheduler_mixin


def draft_with_target_vocab(shape: str, target: str, out_dir: str) -> str:
    with open(os.path.join(shape, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(target, "config.json")) as f:
        tcfg = json.load(f)
    cfg["vocab_size"] = tcfg["vocab_size"]
    for key in ("bos_token_id", "eos_token_id"):
        if key in tcfg:
            cfg[key] = tcfg[key]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--draft-model-path", default=None, help="a draft checkpoint sharing the target's tokenizer")
    ap.add_argument("--draft-shape", default=None, help="or: a config directory, given the target's vocabulary")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1])
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if (args.draft_model_path is None) == (args.draft_shape is None):
        raise SystemExit("give one of --draft-model-path and --draft-shape")
    draft = args.draft_model_path
    if draft is None:
        if args.model_path is None:
            raise SystemExit("--draft-shape needs --model-path (whose vocabulary the draft takes)")
        draft = draft_with_target_vocab(args.draft_shape, args.model_path,
                                        tempfile.mkdtemp(prefix="draft_shape_", dir=os.environ.get("RS_DEVICE_TMP")))
    scheduler_mixin.BACKOFF_MIN_ACCEPT = -1.0  # random weights reject every draft: keep drafting (see above)

    max_bs, k = max(args.batch_size), args.num_draft_tokens
    need = 2 * max_bs * (args.input_len + 2 * (args.steps + 4) * (k + 1)) + 64
    sa = ServerArgs(model_path=args.model_path, load_format=args.load_format, device=args.device, dtype=args.dtype,
                    skip_tokenizer_init=True, random_seed=0, disable_radix_cache=True,
                    max_total_tokens=args.max_total_tokens or need, max_running_requests=max(max_bs, 8),
                    chunked_prefill_size=-1, speculative_algorithm="draft_model", speculative_draft_model_path=draft,
                    speculative_num_draft_tokens=k, log_level="warning")
    s = Scheduler(sa, port_args={})
    drafter = s.spec_drafter
    parts: dict[str, list[float]] = {"draft": [], "verify": []}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            sync(args.device)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            sync(args.device)
            parts[name].append(time.perf_counter() - t0)
            return out
        return wrapper

    drafter.propose_batch = timed("draft", drafter.propose_batch)
    scheduler_mixin.run_verify_batch = timed("verify", scheduler_mixin.run_verify_batch)

    rng = random.Random(0)
    results: list[dict[str, Any]] = []
    for bs in args.batch_size:
        for i in range(bs):
            sp = SamplingParams.from_dict({"max_new_tokens": 2 * (args.steps + 4) * (k + 1), "temperature": 0,
                                           "ignore_eos": True})
            s.process_input_requests([io.TokenizedGenerateReqInput(
                rid=f"b{bs}-{i}", input_text=None, input_ids=[rng.randrange(10, min(30000, s.vocab_size))
                                                  for _ in range(args.input_len)],
                sampling_params=sp)])
        for _ in range(1000):
            if s.running_batch is not None and len(s.running_batch.reqs) >= bs and not s.waiting_queue:
                break
            s.step()
        else:
            raise SystemExit(f"the {bs} requests did not all start decoding")
        plain, rounds = [], []
        for p in parts.values():
            p.clear()
        for it in range(args.steps + 2):  # the first two of each: warm-up (the draft's first catch-up is a prefill)
            s.spec_drafter = None
            sync(args.device)
            t0 = time.perf_counter()
            s.step()
            sync(args.device)
            t1 = time.perf_counter()
            s.spec_drafter = drafter
            s.step()
            sync(args.device)
            t2 = time.perf_counter()
            if it >= 2:
                plain.append(t1 - t0)
                rounds.append(t2 - t1)
        row = {"batch_size": bs, "draft_tokens": k, "decode_ms": statistics.median(plain) * 1e3,
               "round_ms": statistics.median(rounds) * 1e3,
               "draft_ms": statistics.median(parts["draft"][2:]) * 1e3,
               "verify_ms": statistics.median(parts["verify"][2:]) * 1e3}
        row["round_over_decode"] = row["round_ms"] / row["decode_ms"]
        row["break_even_accept_len"] = row["round_over_decode"]  # tokens per round at which speculation pays
        results.append(row)
        print("row", json.dumps(row), flush=True)  # as it comes, in case a time limit cuts the run short
        for req in list(s.running_batch.reqs if s.running_batch else []):
            req.sampling_params.max_new_tokens = len(req.output_ids) + 1
        while not s.is_idle():
            s.spec_drafter = None
            s.step()
        s.spec_drafter = drafter
    print(f"\n{'bs':>4} {'k':>2} {'decode ms':>10} {'round ms':>9} {'draft ms':>9} {'verify ms':>10} "
          f"{'round/decode':>13}")
    for r in results:
        print(f"{r['batch_size']:>4} {r['draft_tokens']:>2} {r['decode_ms']:>10.2f} {r['round_ms']:>9.2f} "
              f"{r['draft_ms']:>9.2f} {r['verify_ms']:>10.2f} {r['round_over_decode']:>12.2f}x")
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "args": vars(args)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
