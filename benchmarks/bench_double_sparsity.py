"""Double sparsity: decode speed against dense Triton attention, and accuracy against dense on the embedded model.

    # GPU: one layer's decode attention at 32K / 64K contexts, 8B shape (32 query heads, 8 KV heads, head_dim 128)
    python benchmarks/bench_double_sparsity.py kernels --context 32768 65536 --batch-size 1 8 \\
        --heavy-token-num 512 1024 2048
    # CPU or GPU: greedy agreement and logit error of the embedded SmolLM2 (float32) at long contexts
    python benchmarks/bench_double_sparsity.py accuracy --context 2048 4096 8000 --heavy-token-num 256 512 1024

`kernels` times each variant as a replayed CUDA graph (GPU time, no launch overhead) and, for double sparsity, its
parts: label scoring, top-k, sparse attention. `accuracy` prefills real text once per context, then decodes
--steps tokens from it under each setting: teacher-forced on the dense greedy output (top-1 agreement with it,
logit error against dense at the same step) and free-running (tokens equal to dense's before the first
difference). Both print a table and write JSON (--result-file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run from anywhere, or imported by the tests

from layer_timing import capture_graph, replay_seconds  # noqa: E402


# ---------------------------------------------------------------- kernels (GPU)
def _graph_time(fn: Any, iters: int = 50) -> float:
    """GPU time of one call of fn in ms: the best of 3 replays of a CUDA graph of `iters` calls, after a warm-up.
    Off CUDA (a dry run of this script's logic): one call's wall time."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def calls() -> None:
        for _ in range(iters):
            fn()

    return min(replay_seconds(capture_graph(calls), 3)) * 1e3 / iters


def bench_kernels(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    for ctx in args.context:
        for bs in args.batch_size:
            rows += _bench_case(ctx, bs, args)
            torch.cuda.empty_cache()
    return rows


def _bench_case(ctx: int, bs: int, args: argparse.Namespace) -> list[dict]:
    """One layer's decode over bs requests of ctx tokens (contiguous KV slots): dense, then double sparsity for
    each --heavy-token-num."""
    from radixserve.layers.attention.triton_ops import double_sparsity as ds_ops
    from radixserve.layers.attention.triton_ops.decode_attention import (
        decode_attention_fwd,
        kv_split_cap,
        split_capacity,
    )
    from radixserve.layers.attention.triton_ops.double_sparsity import (
        ds_score_fwd,
        ds_sparse_decode_fwd,
        topk_positions,
    )
    from radixserve.layers.attention.triton_ops.topk_select import new_scratch, threshold_topk

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h, hkv, d, hc = args.num_heads, args.num_kv_heads, args.head_dim, args.heavy_channel_num
    dtype = torch.bfloat16
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
    gen = torch.Generator(device=dev).manual_seed(0)
    n = ctx * bs
    k_buf = torch.randn(n + 1, hkv, d, device=dev, dtype=dtype, generator=gen)
    v_buf = torch.randn(n + 1, hkv, d, device=dev, dtype=dtype, generator=gen)
    channels = torch.stack([torch.randperm(d, device=dev, generator=gen)[:hc] for _ in range(hkv)])
    labels = k_buf.gather(2, channels.unsqueeze(0).expand(n + 1, -1, -1)).contiguous()
    req_to_token = (torch.arange(n, device=dev, dtype=torch.int32) + 1).view(bs, ctx)
    rpi = torch.arange(bs, device=dev, dtype=torch.int64)
    seq_lens = torch.full((bs,), ctx, device=dev, dtype=torch.int64)
    q = torch.randn(bs, h, d, device=dev, dtype=dtype, generator=gen)
    q_ch = channels.repeat_interleave(h // hkv, dim=0).contiguous()
    o, o_ds = torch.empty_like(q), torch.empty_like(q)
    splits = kv_split_cap(bs, h, hkv, num_sms, 64)
    cap = split_capacity(splits)
    mid_o = torch.empty(bs, h, cap, d, device=dev, dtype=torch.float32)
    mid_lse = torch.empty(bs, h, cap, device=dev, dtype=torch.float32)
    scores = torch.empty(bs, hkv, ctx, device=dev, dtype=torch.float32)
    scratch = new_scratch(bs * hkv, dev)
    state: dict[str, Any] = {}

    def dense() -> None:
        decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, rpi, seq_lens, mid_o, mid_lse, d ** -0.5,
                             num_kv_splits=splits)

    def score(block_n: int | None = None) -> None:
        ds_score_fwd(q, labels, req_to_token, rpi, seq_lens, scores, block_n=block_n, q_channels=q_ch)

    def pick() -> torch.Tensor:
        if state["method"] == "threshold":
            return threshold_topk(scores, state["k"], out=state["top32"], scratch=scratch, block=state["chunks"],
                                  pdl_level=ds_ops.PDL_LEVEL)
        return topk_positions(scores, state["k"], state["chunks"])

    def select() -> None:
        top = pick()
        if top is not state["top32"]:
            state["top"].copy_(top)

    def attend() -> None:
        ds_sparse_decode_fwd(q, k_buf, v_buf, o_ds, req_to_token, rpi, seq_lens, state["top"], 0, mid_o, mid_lse,
                             d ** -0.5, splits)

    def full() -> None:
        score()
        top = pick()
        ds_sparse_decode_fwd(q, k_buf, v_buf, o_ds, req_to_token, rpi, seq_lens, top, 0, mid_o, mid_lse,
                             d ** -0.5, splits)

    t_dense = _graph_time(dense)
    t_score = _graph_time(score)
    kv_bytes = 2 * n * hkv * d * 2
    label_bytes = n * hkv * hc * 2
    for block_n in args.score_block_n:  # the scoring kernel's tile
        t_plain = _graph_time(lambda b=block_n: score(b))
        print(f"ctx {ctx:6d} bs {bs:3d} score BLOCK_N {block_n:4d}: {t_plain * 1e3:6.1f} us "
              f"({label_bytes / t_plain / 1e9:.2f} TB/s)", flush=True)
    rows = []
    for top_k in args.heavy_token_num:
        state["k"], state["top"] = top_k, torch.zeros(bs, hkv, top_k, device=dev, dtype=torch.int64)
        state["top32"] = torch.zeros(bs, hkv, top_k, device=dev, dtype=torch.int32)
        # torch: --topk-chunks pieces; threshold: --threshold-block positions per program
        variants = [(m, c) for m in args.topk_method
                    for c in (args.topk_chunks if m == "torch" else args.threshold_block)]
        for method, chunks in variants:
            state["method"], state["chunks"] = method, chunks
            if method == "threshold":  # the attention reads the positions it selected
                state["top"] = state["top32"]
                select()
                want = topk_positions(scores, top_k).sort(-1).values
                got_vals = scores.gather(-1, state["top32"].long()).sort(-1).values
                same = bool(torch.equal(got_vals, scores.gather(-1, want).sort(-1).values))
                near = (got_vals - scores.gather(-1, want).sort(-1).values).abs().max().item()
                print(f"threshold top-k keeps the scores torch.topk keeps: {same} (largest difference of the sorted "
                      f"kept scores {near:.2e})", flush=True)
            t_select, t_attend = _graph_time(select), _graph_time(attend)
            t_ds = _graph_time(full)
            by_pdl = {}
            default_level = ds_ops.PDL_LEVEL
            for level in args.pdl:  # the chain with programmatic dependent launch at each level (0: off)
                ds_ops.PDL_LEVEL = level
                by_pdl[level] = _graph_time(full)
                print(f"ctx {ctx:6d} bs {bs:3d} K {top_k:5d} {method:>9} {chunks:4d}: ds with PDL level {level}: "
                      f"{by_pdl[level] * 1e3:7.1f} us, speedup {t_dense / by_pdl[level]:.2f}x", flush=True)
            ds_ops.PDL_LEVEL = default_level
            row = {"context": ctx, "batch_size": bs, "heavy_token_num": top_k, "heavy_channel_num": hc,
                   "topk_method": method, "topk_chunks": chunks, "dense_ms": t_dense, "ds_ms": t_ds,
                   "speedup": t_dense / t_ds, "pdl_level": default_level,
                   "ds_ms_by_pdl_level": {str(k): v for k, v in by_pdl.items()},
                   "score_ms": t_score, "topk_ms": t_select, "sparse_attn_ms": t_attend,
                   "dense_kv_tb_s": kv_bytes / t_dense / 1e9, "score_label_tb_s": label_bytes / t_score / 1e9}
            rows.append(row)
            print(f"ctx {ctx:6d} bs {bs:3d} K {top_k:5d} {method:>9} {chunks:4d}: dense {t_dense * 1e3:7.1f} us "
                  f"({row['dense_kv_tb_s']:.2f} TB/s)  ds {t_ds * 1e3:7.1f} us = score {t_score * 1e3:6.1f} "
                  f"({row['score_label_tb_s']:.2f} TB/s) + topk {t_select * 1e3:6.1f} + attn {t_attend * 1e3:6.1f}"
                  f"  speedup {row['speedup']:.2f}x", flush=True)
    return rows


def check_kernels_on_gpu() -> dict:
    """Sparse decode keeping every token equals dense decode (bf16, 8B shape, 4K context)."""
    from radixserve.layers.attention.triton_ops.decode_attention import decode_attention_fwd
    from radixserve.layers.attention.triton_ops.double_sparsity import ds_sparse_decode_fwd

    dev = torch.device("cuda")
    bs, h, hkv, d, ctx = 2, 32, 8, 128, 4096
    k_buf = torch.randn(bs * ctx + 1, hkv, d, device=dev, dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    r2t = (torch.randperm(bs * ctx, device=dev).to(torch.int32) + 1).view(bs, ctx)
    rpi = torch.arange(bs, device=dev)
    lens = torch.tensor([ctx, ctx - 100], device=dev)
    q = torch.randn(bs, h, d, device=dev, dtype=torch.bfloat16)
    o1, o2 = torch.empty_like(q), torch.empty_like(q)
    mid_o = torch.empty(bs, h, 16, d, device=dev)
    mid_lse = torch.empty(bs, h, 16, device=dev)
    decode_attention_fwd(q, k_buf, v_buf, o1, r2t, rpi, lens, mid_o, mid_lse, d ** -0.5, num_kv_splits=8)
    top = torch.stack([torch.randperm(ctx, device=dev) for _ in range(bs * hkv)]).view(bs, hkv, ctx)
    ds_sparse_decode_fwd(q, k_buf, v_buf, o2, r2t, rpi, lens, top, 0, mid_o, mid_lse, d ** -0.5, 8)
    err = (o1.float() - o2.float()).abs().max().item()
    print(f"check: sparse decode keeping all {ctx} tokens vs dense decode, max |diff| = {err:.2e}", flush=True)
    return {"keep_all_max_abs_diff": err}


# ---------------------------------------------------------------- accuracy (embedded model)
class Continuations:
    """One prefill of `prompt`, then any number of decode runs from its end: each run's KV slots are freed after
    it, so every run starts from the same cached prompt (the prefill, dense under every setting, is paid once)."""

    def __init__(self, runner: Any, prompt: list[int]) -> None:
        from radixserve.bench_one_batch import StaticBatch

        self.runner, self.prompt_len = runner, len(prompt)
        self.sb = StaticBatch(runner)
        self.batch, first = self.sb.prefill([prompt])
        self.first = first[0]
        self.first_logits = self.sb.last_logits.next_token_logits[0].float().cpu()

    def run(self, steps: int, forced: list[int] | None) -> tuple[list[int], torch.Tensor]:
        """Greedy decode; with `forced`, step i's input is forced[i] (teacher forcing). Returns the argmax tokens
        (the first from the prefill) and the logits of every step [steps, V]."""
        req = self.batch.reqs[0]
        req.output_ids = [self.first]
        tokens, logits = [self.first], [self.first_logits]
        for i in range(steps - 1):
            if forced is not None:
                req.output_ids[-1] = forced[i]
            tokens.append(self.sb.decode(self.batch)[0])
            logits.append(self.sb.last_logits.next_token_logits[0].float().cpu())
        pools = self.runner
        pools.token_to_kv_pool.free(pools.req_to_token_pool.read(req.req_pool_idx, self.prompt_len,
                                                                 req.kv_committed_len))
        req.kv_committed_len = self.prompt_len
        return tokens, torch.stack(logits)

    def close(self) -> None:
        self.batch.reqs[0].output_ids = [self.first]
        self.sb.release(self.batch)


def bench_accuracy(args: argparse.Namespace) -> list[dict]:
    from radixserve.calibrate_double_sparsity import default_text
    from radixserve.calibrate_double_sparsity import main as calibrate_main
    from radixserve.entrypoints.engine import resolve_model
    from radixserve.layers.attention import double_sparsity_backend as ds_backend
    from radixserve.managers.tokenizer_utils import get_tokenizer
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    channel_file = args.channel_file
    if channel_file is None:
        channel_file = args.channel_file_out
        calibrate_main(["--out", channel_file, "--num-tokens", str(args.calib_tokens), "--device", args.device,
                        "--dtype", "float32"] + (["--model-path", args.model_path] if args.model_path else [])
                       + (["--text-file", args.text_file] if args.text_file else []))
    longest = max(args.context) + args.steps
    sa = ServerArgs(model_path=args.model_path, device=args.device, dtype="float32",
                    attention_backend="double_sparsity", ds_channel_config_path=channel_file,
                    ds_heavy_channel_num=args.heavy_channel_num, max_total_tokens=longest + 64,
                    max_running_requests=2, disable_cuda_graph=True)
    sa.validate()
    cfg = resolve_model(sa)
    if longest > cfg.context_len:
        raise ValueError(f"context {max(args.context)} + {args.steps} steps exceeds the model's {cfg.context_len}")
    runner = ModelRunner(cfg, sa)
    backend = runner.attn_backend
    with open(args.text_file, encoding="utf-8") if args.text_file else _nullcontext(default_text()) as f:
        text = f.read()
    ids = get_tokenizer(sa.tokenizer_path).encode(text[len(text) // 3:][:64 * longest])
    rows = []
    for ctx in args.context:
        t0 = time.perf_counter()
        backend.threshold = 1 << 30  # dense
        cont = Continuations(runner, ids[:ctx])
        ref, ref_logits = cont.run(args.steps, None)
        dense_s = time.perf_counter() - t0
        for top_k, keep in [(k, e) for k in args.heavy_token_num for e in args.keep_ends]:
            backend.threshold, backend.heavy_token_num = 0, top_k  # every decode step sparse
            if keep is not None:  # the positions always kept (defaults: the backend's)
                ds_backend.KEEP_FIRST, ds_backend.KEEP_LAST = keep
            forced, forced_logits = cont.run(args.steps, ref)
            free, _ = cont.run(args.steps, None) if args.free_running else (None, None)
            agree = sum(a == b for a, b in zip(forced[1:], ref[1:], strict=True)) / (args.steps - 1)
            diff = (forced_logits[1:] - ref_logits[1:]).abs()
            scale = ref_logits[1:].abs().amax(dim=-1).mean().item()
            p_ref = torch.log_softmax(ref_logits[1:], -1)
            kl = (p_ref.exp() * (p_ref - torch.log_softmax(forced_logits[1:], -1))).sum(-1).mean().item()
            row = {"context": ctx, "heavy_token_num": top_k, "heavy_channel_num": args.heavy_channel_num,
                   "kept_ends": list(ds_backend.kept_ends(top_k)),
                   "steps": args.steps, "teacher_forced_agreement": agree,
                   "logit_max_abs_err": diff.max().item(), "logit_mean_abs_err": diff.mean().item(),
                   "ref_logit_scale": scale, "kl_dense_to_ds": kl, "dense_run_s": dense_s}
            # how close dense itself was at each teacher-forced miss: its logit lead of its token over the one
            # double sparsity chose (a near-tie is a lead under 1% of the step's largest |logit|)
            misses = [i for i in range(1, args.steps) if forced[i] != ref[i]]
            leads = [(ref_logits[i, ref[i]] - ref_logits[i, forced[i]]).item() for i in misses]
            row["miss_steps"], row["miss_dense_leads"] = misses, leads
            row["miss_near_ties"] = sum(lead < 0.01 * ref_logits[i].abs().max().item()
                                        for i, lead in zip(misses, leads, strict=True))
            line = ""
            if free is not None:
                prefix = next((i for i, (a, b) in enumerate(zip(free, ref, strict=True)) if a != b), args.steps)
                if prefix < args.steps:  # dense's lead at the first free-running difference
                    row["free_running_first_diff_dense_lead"] = (ref_logits[prefix, ref[prefix]]
                                                                 - ref_logits[prefix, free[prefix]]).item()
                row["free_running_equal_prefix"] = prefix
                row["free_running_positional_agreement"] = sum(
                    a == b for a, b in zip(free, ref, strict=True)) / args.steps
                line = f"  free-running equal prefix {prefix:3d}/{args.steps}"
                if prefix < args.steps:
                    line += f" (dense lead there {row['free_running_first_diff_dense_lead']:.3f})"
            line += f"  misses {len(misses)} (near-ties {row['miss_near_ties']}, dense leads " \
                    f"{', '.join(f'{x:.2f}' for x in leads)})"
            rows.append(row)
            print(f"ctx {ctx:5d} K {top_k:5d} ch {args.heavy_channel_num:3d} keep {row['kept_ends']}: "
                  f"teacher-forced agreement "
                  f"{agree * 100:5.1f}%{line}  logit err max {row['logit_max_abs_err']:.3f} mean "
                  f"{row['logit_mean_abs_err']:.4f} (|logit| max ~{scale:.1f})  KL {kl:.2e}", flush=True)
        cont.close()
    return rows


class _nullcontext:
    def __init__(self, text: str) -> None:
        self.text = text

    def __enter__(self) -> _nullcontext:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def read(self) -> str:
        return self.text


def _pair(text: str) -> tuple[int, int]:
    first, last = text.split(",")
    return int(first), int(last)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    k = sub.add_parser("kernels", help="GPU decode attention, dense Triton vs double sparsity")
    k.add_argument("--context", type=int, nargs="+", default=[32768, 65536])
    k.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    k.add_argument("--heavy-token-num", type=int, nargs="+", default=[1024])
    k.add_argument("--heavy-channel-num", type=int, default=16)
    k.add_argument("--score-block-n", type=int, nargs="*", default=[],
                   help="also time the scoring kernel alone with these tiles (positions per program)")
    k.add_argument("--pdl", type=int, nargs="*", default=[], choices=[0, 1, 2],
                   help="also time the sparse chain with programmatic dependent launch at these levels")
    k.add_argument("--topk-method", nargs="+", choices=["torch", "threshold"],
                   default=["torch", "threshold"],
                   help="torch.topk (with --topk-chunks) and the histogram-threshold select (topk_select.py)")
    k.add_argument("--threshold-block", type=int, nargs="+", default=[2048],
                   help="threshold select: positions per program")
    k.add_argument("--topk-chunks", type=int, nargs="+", default=[1, 8],
                   help="pieces each score row is cut into for the top-k (topk_positions)")
    k.add_argument("--num-heads", type=int, default=32)
    k.add_argument("--num-kv-heads", type=int, default=8)
    k.add_argument("--head-dim", type=int, default=128)
    k.add_argument("--check", action="store_true", help="also check keep-all sparse decode against dense")
    a = sub.add_parser("accuracy", help="embedded model, dense vs double sparsity")
    a.add_argument("--context", type=int, nargs="+", default=[2048, 4096, 8000])
    a.add_argument("--heavy-token-num", type=int, nargs="+", default=[256, 512, 1024])
    a.add_argument("--heavy-channel-num", type=int, default=16)
    a.add_argument("--steps", type=int, default=128)
    a.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    a.add_argument("--channel-file", default=None, help="default: calibrate one first (to --channel-file-out)")
    a.add_argument("--channel-file-out", default=os.path.join(os.environ.get("RS_DEVICE_TMP", "/tmp"),
                                                               "ds_channels.json"))
    a.add_argument("--calib-tokens", type=int, default=8192)
    a.add_argument("--text-file", default=None,
                   help="the text to calibrate on (unless --channel-file) and to decode; default: this package's "
                        "Python sources")
    a.add_argument("--device", default="cpu")
    a.add_argument("--keep-ends", type=_pair, nargs="+", default=[None],
                   help="FIRST,LAST positions always kept, one run each (default: the backend's)")
    a.add_argument("--no-free-running", dest="free_running", action="store_false",
                   help="only the teacher-forced runs")
    for p in (k, a):
        p.add_argument("--result-file", default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.mode == "kernels":
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("kernels mode needs a CUDA device (or TRITON_INTERPRET=1 for a dry run of tiny shapes)")
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"
        out: dict[str, Any] = {"device": name, "rows": []}
        if args.check:
            out["check"] = check_kernels_on_gpu()
        out["rows"] = bench_kernels(args)
    else:
        out = {"device": args.device, "rows": bench_accuracy(args)}
    out["args"] = {k: v for k, v in vars(args).items() if k != "result_file"}
    text = json.dumps(out, indent=1)
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            f.write(text)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
