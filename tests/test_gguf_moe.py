"""GGUF files of MoE models (llama.cpp's qwen3moe / qwen2moe architectures): the stacked expert tensors
(`ffn_{gate,up,down}_exps`, quantized or not), the router and the shared expert load into the stacked experts; the
expert sizes come from the file's metadata (transformers' GGUF config reader leaves them at its defaults); greedy
decoding is token-identical to transformers on the same (dequantised) weights, with packed linear layers too."""

from __future__ import annotations

import os

import pytest
import torch
from model_utils import hf_greedy, make_runner, make_tiny_model

from radixserve.bench_one_batch import StaticBatch
from radixserve.configs.model_config import ModelConfig
from radixserve.model_loader.gguf_loader import gguf_weights_iterator
from radixserve.model_loader.gguf_writer import write_llama_gguf

PROMPTS = [[5, 17, 99, 3, 42, 7, 100, 8], [1, 2, 3]]


def _write(kind: str, folder: str, quantize_experts: bool) -> tuple[str, str]:
    """A tiny HF model of `kind` as a GGUF file (experts Q8_0 or float32, attention Q8_0), and a folder holding the
    weights the file dequantises to, with the model's config, for transformers. Returns (gguf path, that folder)."""
    from safetensors.torch import load_file, save_file

    src = os.path.join(folder, "hf")
    # every layer MoE for qwen2_moe: llama.cpp's format has no dense-MLP layers among MoE ones (`mlp_only_layers`)
    hf = make_tiny_model(kind, src, initializer_range=0.08, **({"mlp_only_layers": []} if kind == "qwen2_moe" else {}))
    tensors = {k: v.float() for k, v in load_file(os.path.join(src, "model.safetensors")).items()}

    def qtype(name: str, shape: tuple[int, ...]) -> str | None:
        if ".mlp.experts." in name:
            return "Q8_0" if quantize_experts else None
        return "Q8_0" if name.endswith(("q_proj.weight", "o_proj.weight")) else None

    path = os.path.join(folder, "m.gguf")
    written = write_llama_gguf(path, tensors, hf.config, qtype, arch=kind.replace("_", ""))
    assert written["model.layers.0.mlp.experts.gate_proj.weight"] == ("Q8_0" if quantize_experts else "F32")
    deq = os.path.join(folder, "deq")
    os.makedirs(deq)
    save_file(dict(gguf_weights_iterator(path)), os.path.join(deq, "model.safetensors"))
    for f in os.listdir(src):
        if f.endswith(".json"):
            with open(os.path.join(src, f)) as a, open(os.path.join(deq, f), "w") as b:
                b.write(a.read())
    return path, deq


@pytest.mark.parametrize("kind,quantize_experts", [("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", True)])
def test_gguf_moe_loads_and_matches_transformers(tmp_path, kind: str, quantize_experts: bool) -> None:
    import transformers as tf

    path, deq = _write(kind, str(tmp_path), quantize_experts)
    cfg = ModelConfig(path)
    assert cfg.hf_config.moe_intermediate_size == 32  # from the file, not transformers' default
    if kind == "qwen2_moe":
        assert cfg.hf_config.shared_expert_intermediate_size == 48
    hf = tf.AutoModelForCausalLM.from_pretrained(deq, torch_dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, 8) for p in PROMPTS]
    for quantization in (None, "gguf"):  # dequantised at load; packed Q8_0 attention (the experts: dequantised)
        runner = make_runner(path, quantization=quantization)
        experts = runner.model.model.layers[1].mlp.experts
        assert experts.w13_weight.shape == (8, 64, 64) and experts.w13_weight.dtype == torch.float32
        assert StaticBatch(runner).generate(PROMPTS, 8) == want, quantization
        kinds = {type(getattr(m, "quant_method", None)).__name__ for m in runner.model.modules()}
        assert ("GGUFLinearMethod" in kinds) == (quantization == "gguf")


def test_gguf_mixtral_written_as_llama_loads_and_matches_transformers(tmp_path) -> None:
    """llama.cpp writes Mixtral as architecture "llama" with experts (`llama.expert_count`, the stacked `ffn_*_exps`
    and the router `ffn_gate_inp`), which transformers' GGUF reader turns into a dense Llama config (the expert
    tensors were then refused as unexpected weights): served as Mixtral, token-identical to the source model."""
    from safetensors.torch import load_file

    src = os.path.join(str(tmp_path), "hf")
    hf = make_tiny_model("mixtral", src, initializer_range=0.08)
    tensors = {k: v.float() for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    path = os.path.join(str(tmp_path), "m.gguf")
    written = write_llama_gguf(path, tensors, hf.config, lambda name, shape: None)
    assert "model.layers.0.mlp.experts.gate_proj.weight" in written
    cfg = ModelConfig(path)
    assert cfg.architectures == ["MixtralForCausalLM"]
    assert (cfg.hf_config.num_local_experts, cfg.hf_config.num_experts_per_tok) == (8, 2)
    runner = make_runner(path)
    assert StaticBatch(runner).generate(PROMPTS, 8) == [hf_greedy(hf, p, 8) for p in PROMPTS]
