"""Quantized serving on the 8B shape with dummy weights quantised online: decode latency at several batch sizes,
bandwidth utilisation on the bytes a decode step actually reads, and memory, for one configuration per process
(bf16, fp8, fp8_fp8kv = fp8 weights + fp8 KV, fp8_int8head = fp8 weights + the LM head in int8 rows, q4_k).
`--summarize DIR` prints the table of every JSON there.

Bytes read per decode step: every weight the step multiplies by (the layers' quantized tensors and scales, the
norms, the LM head) plus one embedding row per sequence, plus the KV of every token attended to (in the pool's
dtype). Bandwidth utilisation = those bytes / step time / the measured device-to-device copy bandwidth.

    python benchmarks/bench_quant_gpu.py --config fp8 --batch-size 1 64 160 --result-file out/fp8.json
    python benchmarks/bench_quant_gpu.py --summarize out
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

CONFIGS = {
    "bf16": {},
    "fp8": {"quantization": "fp8"},
    "fp8_fp8kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
    "fp8_int8head": {"quantization": "fp8", "quantize_lm_head": True},
    "q4_k": {"quantization": "q4_k"},
}
SHAPE = "radixserve/configs/shapes/llama-3.1-8b"


def read_bytes_per_step(runner, batch_size: int, ctx: float) -> tuple[int, int]:  # noqa: ANN001
    """(weight bytes a decode step reads, KV bytes it reads)."""
    model = runner.model
    embed = model.model.embed_tokens.weight
    tied = model.lm_head is model.model.embed_tokens  # (an int8 head has rows of its own: the embedding is not read)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    row = embed.shape[1] * embed.element_size()
    weights = total - (0 if tied else embed.numel() * embed.element_size()) + batch_size * row
    kv = int(batch_size * ctx * runner.token_to_kv_pool.bytes_per_token())
    return weights, kv


def run_one(args: argparse.Namespace) -> dict:
    import torch

    from radixserve.bench_one_batch import latency_test, measure_copy_bandwidth
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    kw = CONFIGS[args.config]
    t0 = time.perf_counter()
    top_bs = max(args.batch_size + (args.profile or []))
    sa = ServerArgs(model_path=args.model_path, load_format="dummy", device=args.device,
                    dtype="bfloat16" if args.device == "cuda" else "float32",
                    cuda_graph_max_bs=top_bs, max_running_requests=top_bs + 8, **kw)
    runner = ModelRunner(ModelConfig(args.model_path, load_format="dummy"), sa)
    init_s = time.perf_counter() - t0
    copy_bw = measure_copy_bandwidth(args.device) if args.device == "cuda" else float("nan")  # (CPU: a dry run)
    latency_test(runner, 1, args.input_len, 3, seed=0)  # warm-up: prefill kernels compile outside the timing
    rows = []
    for bs in args.batch_size:
        r = latency_test(runner, bs, args.input_len, args.output_len, seed=1)
        wbytes, kvbytes = read_bytes_per_step(runner, bs, args.input_len + args.output_len / 2)
        r.update(weight_bytes_read=wbytes, kv_bytes_read=kvbytes,
                 bandwidth_util=(wbytes + kvbytes) / r["median_decode_s"] / copy_bw,
                 achieved_bw_gbs=(wbytes + kvbytes) / r["median_decode_s"] / 1e9)
        rows.append(r)
        print(json.dumps(r), file=sys.stderr)
    profiles = []
    for bs in args.profile or []:  # kernels of one decode step (CUDA graph replay), top by GPU time
        from radixserve.bench_one_batch import print_profile, profile_decode

        profiles.append(profile_decode(runner, bs, args.input_len, args.profile_steps, seed=2, top=args.profile_top))
        print(f"[{args.config}]", end="")
        print_profile(profiles[-1])
    out = {"config": args.config, "flags": kw, "init_s": init_s, "copy_bw_gbs": copy_bw / 1e9, "profiles": profiles,
           "weight_bytes": runner.weight_bytes, "kv_bytes_per_token": runner.token_to_kv_pool.bytes_per_token(),
           "pool_tokens": runner.max_total_num_tokens,
           "max_memory_allocated": torch.cuda.max_memory_allocated() if args.device == "cuda" else 0,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": rows}
    return out


def summarize(folder: str) -> None:
    print(f"{'config':<10} {'bs':>4} {'step ms':>8} {'tok/s':>9} {'GB read':>8} {'BW util':>7} {'weights GiB':>11} "
          f"{'KV B/tok':>8} {'pool tok':>9}")
    for path in sorted(glob.glob(os.path.join(folder, "quant_*.json"))):
        with open(path) as f:
            d = json.load(f)
        for r in d["rows"]:
            gb = (r["weight_bytes_read"] + r["kv_bytes_read"]) / 1e9
            print(f"{d['config']:<10} {r['batch_size']:>4} {r['median_decode_s'] * 1e3:>8.2f} "
                  f"{r['decode_tok_s']:>9.1f} {gb:>8.2f} {r['bandwidth_util']:>7.1%} "
                  f"{d['weight_bytes'] / 2**30:>11.2f} {d['kv_bytes_per_token']:>8} {d['pool_tokens']:>9}")
    for path in sorted(glob.glob(os.path.join(folder, "offline_*.json"))):
        with open(path) as f:
            d = json.load(f)
        for r in d.get("results", []):
            print(f"offline {os.path.basename(path)}: {r['num_prompts']} prompts, {r['elapsed_s']:.1f} s, "
                  f"{r['output_tok_s']:.0f} output tok/s, {r['requests_per_s']:.2f} req/s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", choices=sorted(CONFIGS))
    p.add_argument("--model-path", default=SHAPE)
    p.add_argument("--batch-size", type=int, nargs="*", default=[1, 64, 160])
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script on a tiny shape")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--profile", type=int, nargs="*", default=None, help="also profile decode at these batch sizes")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--profile-top", type=int, default=18)
    p.add_argument("--result-file", default=None)
    p.add_argument("--summarize", default=None)
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    if args.config is None:
        p.error("--config is required")
    out = run_one(args)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
