"""The hardware bound of an offline run of an MoE model, with its arithmetic, from the run's JSON (token totals) and
the model's config (parameter counts from the model built on the meta device).

    python benchmarks/moe_offline_bound.py --model-path radixserve/configs/shapes/qwen3-30b-a3b \\
        --offline-json offline.json --batch 512 --copy-bw 4.275e12 --matmul-flops 7.9e14

- prefill: 2 x active parameters per token (the router's k experts, attention, dense / shared MLPs, LM head; not
  the embedding table) + causal attention (QK^T and PV over the prompt), at the bf16 matrix rate;
- decode: steps = max(longest output, output tokens / batch); each step reads the non-expert weights, the experts a
  batch of `--batch` tokens touches (E x (1 - (1 - k/E)^batch) per layer) and the KV of every running request at
  the mean context (input + output / 2), at the copy bandwidth.
Bound = output tokens / (prefill + decode time). Prints the arithmetic and the measured run's share of it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model_counts(model_path: str) -> dict[str, Any]:
    import transformers as tf

    from radixserve.layers.moe import FusedMoE
    from radixserve.models.registry import get_model_class

    cfg = tf.AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = get_model_class(cfg.architectures)(cfg)
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    total = sum(p.numel() for p in model.parameters())
    experts = sum(m.w13_weight.numel() + m.w2_weight.numel() for m in moe)
    embed = model.model.embed_tokens.weight.numel()
    tied = model.lm_head is model.model.embed_tokens
    non_expert = total - experts - (0 if tied else embed)  # what every token passes through
    per_expert = experts / max(1, sum(m.num_experts for m in moe))
    layers = cfg.num_hidden_layers
    if getattr(cfg, "kv_lora_rank", None):
        kv_per_token = layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
        attn_dims = cfg.num_attention_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.kv_lora_rank)
    else:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_per_token = layers * (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) \
            * head_dim * 2 * 2
        attn_dims = cfg.num_attention_heads * head_dim * 2
    k = moe[0].router.top_k if moe else 0
    return {"non_expert": non_expert, "per_expert": per_expert, "moe_layers": len(moe),
            "num_experts": moe[0].num_experts if moe else 0, "top_k": k,
            "active": non_expert + len(moe) * k * per_expert, "kv_per_token": kv_per_token,
            "attn_dims": attn_dims, "layers": layers}


def bound(c: dict[str, Any], n_prompts: int, n_in: int, n_out: int, max_out: int, batch: int, copy_bw: float,
          matmul: float) -> dict[str, float]:
    mean_in = n_in / n_prompts
    # causal attention per prompt: 2 FLOPs per multiply-add over L^2 / 2 positions, QK^T and PV, every layer
    attn = n_prompts * c["layers"] * c["attn_dims"] * mean_in * mean_in
    prefill_flops = 2 * c["active"] * n_in + attn
    b = min(batch, n_prompts)
    steps = max(max_out, n_out / b)
    touched = c["num_experts"] * (1 - (1 - c["top_k"] / max(1, c["num_experts"])) ** b)
    ctx = mean_in + n_out / n_prompts / 2
    step_bytes = 2 * (c["non_expert"] + c["moe_layers"] * touched * c["per_expert"]) + b * ctx * c["kv_per_token"]
    prefill_s, decode_s = prefill_flops / matmul, steps * step_bytes / copy_bw
    return {"prefill_flops": prefill_flops, "prefill_s": prefill_s, "decode_steps": steps,
            "experts_touched_per_layer": touched, "step_bytes": step_bytes, "decode_s": decode_s,
            "bound_s": prefill_s + decode_s, "bound_out_tok_s": n_out / (prefill_s + decode_s)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--offline-json", help="bench_offline_throughput's result file (radixserve's row is used)")
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--input-tokens", type=int)
    parser.add_argument("--output-tokens", type=int)
    parser.add_argument("--max-output", type=int, default=1024, help="the longest output a request may have")
    parser.add_argument("--batch", type=int, default=512, help="requests decoding at once")
    parser.add_argument("--copy-bw", type=float, default=4.275e12, help="bytes/s (measured copy bandwidth)")
    parser.add_argument("--matmul-flops", type=float, default=7.9e14, help="bf16 FLOP/s (measured matrix rate)")
    args = parser.parse_args(argv)
    measured = None
    if args.offline_json:
        run = json.loads(Path(args.offline_json).read_text())
        row = next(r for r in run["results"] if r["engine"] == "radixserve")
        args.num_prompts, args.input_tokens, args.output_tokens = (row["num_prompts"], row["total_input_tokens"],
                                                                   row["total_output_tokens"])
        args.max_output = run["args"].get("random_output_len", args.max_output)
        measured = row["output_tok_s"]
    if not (args.num_prompts and args.input_tokens and args.output_tokens):
        raise SystemExit("give --offline-json or --num-prompts, --input-tokens and --output-tokens")
    c = model_counts(args.model_path)
    b = bound(c, args.num_prompts, args.input_tokens, args.output_tokens, args.max_output, args.batch, args.copy_bw,
              args.matmul_flops)
    print(f"{Path(args.model_path).name}: active {c['active'] / 1e9:.2f} B params/token (non-expert "
          f"{c['non_expert'] / 1e9:.2f} B + {c['moe_layers']} x {c['top_k']} experts x {c['per_expert'] / 1e6:.1f} M), "
          f"KV {c['kv_per_token']} B/token")
    print(f"prefill: {args.input_tokens} tokens -> {b['prefill_flops'] / 1e15:.2f} PFLOP at "
          f"{args.matmul_flops / 1e12:.0f} TFLOP/s = {b['prefill_s']:.2f} s")
    print(f"decode: {b['decode_steps']:.0f} steps x {b['step_bytes'] / 1e9:.1f} GB (batch "
          f"{min(args.batch, args.num_prompts)}, {b['experts_touched_per_layer']:.1f} experts/layer) at "
          f"{args.copy_bw / 1e9:.0f} GB/s = {b['decode_s']:.2f} s")
    line = f"bound: {b['bound_s']:.2f} s = {b['bound_out_tok_s']:,.0f} output tok/s"
    if measured:
        line += f"; measured {measured:,.0f} = {measured / b['bound_out_tok_s']:.1%} of the bound"
    print(line)


if __name__ == "__main__":
    main()
