"""Tiny PEFT LoRA adapters for a tiny random Llama, and transformers + PEFT references."""

from __future__ import annotations

from typing import Any

import torch

# (name, rank, alpha, rsLoRA, target modules): three ranks, different targets, and one rsLoRA
ADAPTERS = [
    ("a4", 4, 8, False, ["q_proj", "v_proj"]),
    ("b8", 8, 16, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("c16", 16, 8, False, ["o_proj", "gate_proj", "down_proj", "k_proj"]),
]


def make_adapter(base_path: str, out_path: str, rank: int, alpha: float, rslora: bool, targets: list[str],
                 seed: int) -> None:
    """A PEFT adapter of the model at `base_path` with random A and B (PEFT starts B at zero) saved to `out_path`."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    base = tf.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(out_path)


def make_adapters(base_path: str, root: str) -> dict[str, str]:
    """The three ADAPTERS under `root`; returns name -> folder."""
    out = {}
    for i, (name, rank, alpha, rslora, targets) in enumerate(ADAPTERS):
        path = f"{root}/{name}"
        make_adapter(base_path, path, rank, alpha, rslora, targets, seed=100 + i)
        out[name] = path
    return out


def peft_greedy(base_path: str, adapter_path: str | None, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy tokens of transformers (+ PEFT when adapter_path is given), each prompt alone."""
    import transformers as tf

    model: Any = tf.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_path)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            outs.append(out[0, len(p):].tolist())
    return outs
