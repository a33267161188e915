"""The peer: the same workload through Hugging Face transformers on the same device, random weights of the same
config (initialised on the device, so an 8B shape starts in seconds).

    python benchmarks/peers/hf_peer.py --model-path radixserve/configs/shapes/llama-3.1-8b --mode generate \\
        --batch-size 1 --input-len 256 --output-len 128
    python benchmarks/peers/hf_peer.py --model-path ... --mode generate_batch --num-prompts 256 \\
        --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5

generate: static batch through `model.generate` (sdpa), reports decode tok/s.
generate_batch: continuous batching (`model.generate_batch`, "paged|sdpa" attention, CUDA graphs when the
installed version has them), reports output tok/s over the same random prompts as bench_offline_throughput; if
the model cannot run that way (DeepSeek's MLA in transformers 5.x: its paged cache expects one head size for K
and V), the prompts go through static batches of `generate` instead (`--fallback-batch-size` each, left-padded),
and the JSON says which mode ran.
static_batch: those static batches directly."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def load_model(path: str, attn: str, dtype: torch.dtype, device: str) -> Any:
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    return model.eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_generate(model: Any, batch_size: int, input_len: int, output_len: int, device: str) -> dict[str, Any]:
    vocab = model.config.vocab_size
    ids = torch.randint(100, vocab - 100, (batch_size, input_len), device=device)

    def once(n: int) -> float:
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t

    once(4)
    short, full = once(1), once(output_len)
    decode_s = (full - short) / (output_len - 1)
    return {"mode": "generate", "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
            "prefill_latency_s": short, "median_decode_s": decode_s, "decode_tok_s": batch_size / decode_s}


def run_generate_batch(model: Any, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    from transformers.generation import GenerationConfig

    max_new = max(lo for _, lo in reqs)
    kwargs: dict[str, Any] = {"progress_bar": False}
    try:
        from transformers.generation import ContinuousBatchingConfig

        try:  # half the free memory for its paged cache: the rest for its CUDA-graph warm-up (all of it: OOM)
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
                use_cuda_graph=torch.cuda.is_available(), max_memory_percent=0.5)
        except TypeError:  # versions without that field
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(use_cuda_graph=torch.cuda.is_available())
    except Exception:  # older versions: no separate config
        pass

    def config(n: int) -> Any:
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)

    # warm up on a few prompts with short outputs (not the whole length: that would double the run)
    model.generate_batch(inputs=[p for p, _ in reqs[:4]], generation_config=config(8), **kwargs)
    sync()
    t = time.perf_counter()
    # each request asks for its own length: generate_batch takes one config, so count only what each asked for
    outs = model.generate_batch(inputs=[p for p, _ in reqs], generation_config=config(max_new), **kwargs)
    sync()
    elapsed = time.perf_counter() - t
    produced = sum(min(len(o.generated_tokens), lo) for o, (_, lo) in zip(ordered(outs, len(reqs)), reqs,
                                                                          strict=True))
    if produced < sum(lo for _, lo in reqs):  # failed requests are logged by transformers, not raised
        raise RuntimeError(f"generate_batch produced {produced} of the {sum(lo for _, lo in reqs)} tokens asked")
    return {"mode": "generate_batch", "num_prompts": len(reqs), "elapsed_s": elapsed,
            "output_tokens": produced, "output_tok_s": produced / elapsed,
            "input_tok_s": sum(len(p) for p, _ in reqs) / elapsed}


def ordered(outs: dict[Any, Any], n: int) -> list[Any]:
    """generate_batch's results in request order (its request ids end in the request's index)."""
    def index(key: Any) -> int:
        return int(str(key).rsplit("_", 1)[-1])

    keys = sorted(outs, key=index)
    if len(keys) != n:
        raise RuntimeError(f"generate_batch returned {len(keys)} results for {n} requests")
    return [outs[k] for k in keys]


def run_static_batches(model: Any, reqs: list[tuple[list[int], int]], batch_size: int) -> dict[str, Any]:
    """Left-padded static batches through `generate` (sdpa); each batch runs to its longest output and only the
    tokens each request asked for count."""
    from radixserve.bench_offline_throughput import generate_left_padded, warm_up_generate

    device = model.device
    warm_up_generate(model, reqs[0][0], device)
    sync()
    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        generate_left_padded(model, reqs[i:i + batch_size], device)
    sync()
    elapsed = time.perf_counter() - t
    produced = sum(lo for _, lo in reqs)
    return {"mode": "static_generate", "batch_size": batch_size, "num_prompts": len(reqs), "elapsed_s": elapsed,
            "output_tokens": produced, "output_tok_s": produced / elapsed,
            "input_tok_s": sum(len(p) for p, _ in reqs) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--mode", choices=["generate", "generate_batch", "static_batch"], default="generate")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=256)
    parser.add_argument("--random-range-ratio", type=float, default=0.5)
    parser.add_argument("--fixed-output", action="store_true", help="every request generates --random-output-len")
    parser.add_argument("--fallback-batch-size", type=int, default=0,
                        help="generate_batch failing: prompts per static generate batch (0: all at once)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--result-file", default="hf_peer.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t_load = time.perf_counter()
    if args.mode == "generate":
        model = load_model(args.model_path, "sdpa", torch.bfloat16, device)
        res = run_generate(model, args.batch_size, args.input_len, args.output_len, device)
    else:
        from radixserve.bench_offline_throughput import random_requests

        attn = "paged|sdpa" if args.mode == "generate_batch" else "sdpa"
        model = load_model(args.model_path, attn, torch.bfloat16, device)
        vocab = model.config.vocab_size
        reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, vocab, args.seed)
        if args.fixed_output:
            reqs = [(p, args.random_output_len) for p, _ in reqs]
        print(f"model built in {time.perf_counter() - t_load:.1f} s", flush=True)
        try:
            if args.mode == "static_batch":
                res = run_static_batches(model, reqs, args.fallback_batch_size or len(reqs))
            else:
                res = run_generate_batch(model, reqs)
        except Exception as e:  # noqa: BLE001 - the peer's own limits: fall back to its plain path
            print(f"generate_batch failed ({type(e).__name__}: {str(e)[:300]}); static generate instead", flush=True)
            model.set_attn_implementation("sdpa")
            res = run_static_batches(model, reqs, args.fallback_batch_size or len(reqs))
            res["generate_batch_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(res, indent=2))
    with open(args.result_file, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
