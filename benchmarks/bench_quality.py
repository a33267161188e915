"""Quality of the quantized paths on a real model: the embedded SmolLM2-135M-Instruct on the CPU (float32
activations), each configuration against the unquantised model:

- the greedy answer to "What is the capital of France?" (16 tokens; must still say Paris),
- perplexity on a fixed English text that ships with a dependency: the Apache License 2.0 text in transformers'
  wheel (its `LICENSE` file), the first --tokens tokens, scored in one prefill with prompt logprobs.

Configurations: fp8 weights quantised online (W8A8 dynamic per-token activation scales at prefill, W8A16 at
decode), the LM head in int8 rows (`--quantize-lm-head`) alone and with fp8 weights, an fp8_e4m3 KV cache with
the default scales of 1.0 and with per-layer k/v scales saved into the checkpoint (calibrated on the next --tokens
tokens of the text, as fp8 checkpoints ship them), fp8 weights + fp8 KV, and the model's own GGUF files written
with the `gguf` package: Q8_0 (every linear layer packed) and Q4_K (Q4_K where a row holds whole 256-weight
super-blocks — SmolLM2's ffn_down, K = 1536 — and llama.cpp's fallback Q5_0 for the other layers, whose rows of 576
cannot be Q4_K; Q5_0 is dequantised at load); and Q4_K/Q8_0, the same Q4_K layers with Q8_0 for the rest, to show
Q4_K's own share. Embeddings (tied: also the LM head, except with "int8 head") stay float32. Margins (either
way): fp8 <= 2%, Q8_0 and the int8 head <= 1%, fp8 with the int8 head <= 3% (the two added), Q4_K <= 8%
perplexity.

    python benchmarks/bench_quality.py [--tokens 1024] [--json out.json]

--kv-scale-sweep S1,S2,... adds one fp8_e4m3 KV row per value, every layer's k_scale and v_scale set to it in a copy
of the checkpoint: how much of the fp8 KV loss is where the scale puts e4m3's rounding grid (the rows have no
margin; a summary line gives their least, mean and largest change).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

import torch

MARGINS = {"fp8": 2.0, "fp8 KV e4m3": 2.0, "fp8 KV e4m3 ckpt-scales": 2.0, "fp8 KV e4m3 calc-scales": 2.0,
           "fp8 + fp8 KV": 2.0, "int8 head": 1.0, "fp8 + int8 head": 3.0, "GGUF Q8_0": 1.0, "GGUF Q4_K": 8.0,
           "GGUF Q4_K/Q8_0": 8.0, "GGUF Q4_K_M": 8.0}


def license_text() -> tuple[str, str]:
    """The Apache-2.0 text shipped in transformers' wheel, and where it was found."""
    from importlib import metadata

    for f in metadata.files("transformers") or []:
        if os.path.basename(str(f)).upper().startswith("LICENSE"):
            path = str(f.locate())
            with open(path, encoding="utf-8") as fh:
                return fh.read(), path
    raise SystemExit("transformers' LICENSE file was not found in its installed metadata")


def perplexity(runner: Any, ids: list[int]) -> float:
    from radixserve.bench_one_batch import StaticBatch

    return math.exp(-float(StaticBatch(runner).prompt_logprobs(ids).mean()))


def write_gguf(folder: str, out: str, kind: str) -> dict[str, str]:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from radixserve.model_loader.gguf_writer import write_llama_gguf

    cfg = AutoConfig.from_pretrained(folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))

    def qtype(name: str, shape: tuple[int, ...]) -> str | None:
        if kind == "Q4_K_M":
            return q4_k_m_type(name, shape, cfg.num_hidden_layers, bool(getattr(cfg, "tie_word_embeddings", False)))
        if ".layers." not in name or not name.endswith("proj.weight"):
            return None
        if kind == "Q8_0":
            return "Q8_0"
        return "Q4_K" if shape[1] % 256 == 0 else ("Q8_0" if kind == "Q4_K/Q8_0" else "Q5_0")

    return write_llama_gguf(out, tensors, cfg, qtype)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in a *_K_M mix: the first and last
    eighth, and every third layer in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, shape: tuple[int, ...], n_layers: int, tied: bool) -> str | None:
    """The type llama.cpp's `llama-quantize ... Q4_K_M` gives a Llama tensor (HF name, [rows, K]): Q4_K by default;
    Q6_K for attn_v and ffn_down in the use_more_bits layers; Q6_K for the output matrix (the tied embedding);
    then the fallback for rows that are not whole 256-weight super-blocks (Q4_K -> Q5_0, Q6_K -> Q8_0); 1-D
    tensors (norms) stay float32."""
    if len(shape) != 2:
        return None
    if name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
        want = "Q6_K"
    elif name == "model.embed_tokens.weight":
        want = "Q4_K"
    else:
        layer = int(name.split(".")[2])
        more = name.endswith(("v_proj.weight", "down_proj.weight")) and use_more_bits(layer, n_layers)
        want = "Q6_K" if more else "Q4_K"
    if shape[1] % 256:
        return {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[want]
    return want


def write_kv_scales_checkpoint(folder: str, out: str, calibration_ids: list[int], headroom: float = 1.25,
                               uniform: float | None = None) -> str:
    """A copy of the checkpoint with per-layer `self_attn.k_scale` / `v_scale` (amax of the layer's k / v
    projections on `calibration_ids` times `headroom`, over 448), as fp8 checkpoints ship them. The calibration
    tokens are the text's next --tokens tokens, disjoint from the scored ones. With `uniform`, every scale is that
    value instead."""
    from transformers import AutoConfig, AutoModelForCausalLM

    amax: dict[str, float] = {}
    if uniform is not None:
        for i in range(AutoConfig.from_pretrained(folder).num_hidden_layers):
            for kv in "kv":
                amax[f"model.layers.{i}.self_attn.{kv}_scale"] = uniform * 448.0 / headroom
        return _save_with_scales(folder, out, amax, headroom)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def hook(name: str):  # noqa: ANN202
        def record(mod, inputs, output) -> None:  # noqa: ANN001
            amax[name] = max(amax.get(name, 0.0), float(output.abs().max()))
        return record

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.k_proj.register_forward_hook(hook(f"model.layers.{i}.self_attn.k_scale"))
        layer.self_attn.v_proj.register_forward_hook(hook(f"model.layers.{i}.self_attn.v_scale"))
    with torch.no_grad():
        model(torch.tensor([calibration_ids]))
    return _save_with_scales(folder, out, amax, headroom)


def _save_with_scales(folder: str, out: str, amax: dict[str, float], headroom: float) -> str:
    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    for f in os.listdir(folder):
        if f != "model.safetensors" and os.path.isfile(os.path.join(folder, f)):
            os.symlink(os.path.join(folder, f), os.path.join(out, f))
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors.update({name: torch.tensor(v * headroom / 448.0) for name, v in amax.items()})
    save_file(tensors, os.path.join(out, "model.safetensors"))
    scales = sorted(v * headroom / 448.0 for v in amax.values())
    return f"k/v scales {scales[0]:.4f}..{scales[-1]:.4f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--json", default=None)
    p.add_argument("--configs", default=",".join(["fp32", *MARGINS]))
    p.add_argument("--kv-scale-sweep", default="", help="comma-separated k/v scales: one fp8_e4m3 KV row each")
    args = p.parse_args(argv)
    try:
        sweep = [float(v) for v in args.kv_scale_sweep.split(",") if v.strip()]
    except ValueError:
        p.error(f"--kv-scale-sweep takes comma-separated numbers, not {args.kv_scale_sweep!r}")
    if any(not v > 0 for v in sweep):
        p.error("--kv-scale-sweep values must be positive")
    names = args.configs.split(",")
    unknown = [n for n in names if n not in MARGINS and n != "fp32"]
    if unknown:
        p.error(f"unknown --configs {unknown}; known: fp32, {', '.join(MARGINS)}")
    if sweep and "fp32" not in names:
        names.insert(0, "fp32")  # the sweep's rows are read against the unquantised model
    from transformers import AutoTokenizer

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.model_loader.embedded import ensure_embedded_model
    from radixserve.server_args import ServerArgs

    folder = ensure_embedded_model()
    tok = AutoTokenizer.from_pretrained(folder)
    text, text_path = license_text()
    ids = tok(text)["input_ids"][: args.tokens]
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=True)
    prompt = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    scratch = tempfile.TemporaryDirectory(prefix="bench-quality-")  # the files written: removed at the end
    tmp = scratch.name
    setups: dict[str, dict[str, Any]] = {
        "fp32": {}, "fp8": {"quantization": "fp8"}, "fp8 KV e4m3": {"kv_cache_dtype": "fp8_e4m3"},
        "fp8 KV e4m3 ckpt-scales": {"kv_cache_dtype": "fp8_e4m3", "kv_scales": True},
        "fp8 KV e4m3 calc-scales": {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True},
        "fp8 + fp8 KV": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
        "int8 head": {"quantize_lm_head": True}, "fp8 + int8 head": {"quantization": "fp8", "quantize_lm_head": True},
        "GGUF Q8_0": {"gguf": "Q8_0"}, "GGUF Q4_K": {"gguf": "Q4_K"}, "GGUF Q4_K/Q8_0": {"gguf": "Q4_K/Q8_0"},
        "GGUF Q4_K_M": {"gguf": "Q4_K_M"}}
    for v in sweep:
        setups[f"fp8 KV e4m3 scale {v:g}"] = {"kv_cache_dtype": "fp8_e4m3", "kv_scales": v}
        names.append(f"fp8 KV e4m3 scale {v:g}")
    rows, base_ppl = [], None
    try:
        for name in names:
            kw = dict(setups[name])
            path, note = folder, ""
            scales = kw.pop("kv_scales", False)
            if scales is not False:
                path = os.path.join(tmp, f"smollm2-kv-scales-{len(rows)}")
                note = write_kv_scales_checkpoint(folder, path, tok(text)["input_ids"][args.tokens:2 * args.tokens],
                                                  uniform=None if scales is True else scales)
            if "gguf" in kw:
                kind = kw.pop("gguf")
                path = os.path.join(tmp, f"smollm2-{kind.replace('/', '-')}.gguf")
                types = write_gguf(folder, path, kind)
                counts: dict[str, int] = {}
                for t in types.values():
                    counts[t] = counts.get(t, 0) + 1
                note = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
                kw["quantization"] = "gguf"  # packed on the CPU too (the default there dequantises at load)
            t0 = time.perf_counter()
            sa = ServerArgs(model_path=path, tokenizer_path=folder, device="cpu", dtype="float32",
                            max_total_tokens=args.tokens + 64, max_running_requests=4, **kw)
            runner = ModelRunner(ModelConfig(path), sa)
            ppl = perplexity(runner, ids)
            answer = tok.decode(StaticBatch(runner).generate([prompt], 16)[0])
            base_ppl = ppl if name == "fp32" else base_ppl
            delta = None if base_ppl is None or name == "fp32" else 100.0 * (ppl / base_ppl - 1.0)
            margin = MARGINS.get(name)
            ok = "Paris" in answer and (margin is None or (delta is not None and abs(delta) <= margin))
            rows.append({"config": name, "perplexity": ppl, "delta_pct": delta, "margin_pct": margin, "answer": answer,
                         "pass": ok, "weights": note, "seconds": time.perf_counter() - t0,
                         "weight_bytes": runner.weight_bytes})
            print(f"{name}: ppl {ppl:.4f} ({'' if delta is None else f'{delta:+.2f}%'}) {answer!r}", file=sys.stderr)
    finally:
        scratch.cleanup()
    print(f"\nSmolLM2-135M-Instruct, CPU float32, {len(ids)} tokens of {text_path}")
    print(f"{'config':<14} {'perplexity':>10} {'vs fp32':>8} {'margin':>7} {'Paris':>6} {'pass':>5}  weights")
    for r in rows:
        d = "" if r["delta_pct"] is None else f"{r['delta_pct']:+.2f}%"
        m = "" if r["margin_pct"] is None else f"{r['margin_pct']:.0f}%"
        print(f"{r['config']:<14} {r['perplexity']:>10.4f} {d:>8} {m:>7} {str('Paris' in r['answer']):>6} "
              f"{str(r['pass']):>5}  {r['weights']}")
    swept = [r["delta_pct"] for r in rows if r["config"].startswith("fp8 KV e4m3 scale ")]
    if swept:
        print(f"fp8 KV e4m3 over {len(swept)} uniform scales: least {min(swept):+.2f}%, "
              f"mean {sum(swept) / len(swept):+.2f}%, largest {max(swept):+.2f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"text": text_path, "tokens": len(ids), "rows": rows}, f, indent=1)
    if not all(r["pass"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
