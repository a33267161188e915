"""Reading a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) into full (unsharded) CPU
tensors: for each (layer, projection) the pair A [r, in] and B [out, r]."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from radixserve.lora.config import TARGET_MODULES, LoRAConfig

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT may also keep the adapter name before
# ".weight" in memory; saved files drop it); Llama 4 names its MLP `feed_forward` (its dense layers')
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp|feed_forward)\.(" + "|".join(TARGET_MODULES)
                  + r")\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# the image encoder of a multimodal checkpoint served as text (Gemma 3, Qwen-VL's `visual`): its layers are not
# loaded, so neither is their LoRA (PEFT's q_proj / v_proj targets match Gemma 3's tower too, under the same layer
# numbers as the text's; its gate/up/down_proj targets match Qwen2.5-VL's vision blocks)
_UNSERVED_PARTS = (".vision_tower.", ".multi_modal_projector.", ".visual.")


@dataclass
class LoRAWeights:
    config: LoRAConfig
    # (layer id, module name) -> (A [r, in], B [out, r]) on the CPU, in the checkpoint's dtype
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def target_modules(self) -> set[str]:
        return {m for _, m in self.weights}


def read_lora_weights(path: str, num_layers: int) -> LoRAWeights:
    """Read and check an adapter folder; raises ValueError with the reason when it cannot be served."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a folder")
    config = LoRAConfig.from_folder(path)
    st = os.path.join(path, "adapter_model.safetensors")
    binf = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        tensors = load_file(st, device="cpu")
    elif os.path.isfile(binf):
        tensors = torch.load(binf, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"LoRA adapter {path!r}: no adapter_model.safetensors (or .bin)")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if any(part in f".{name}" for part in _UNSERVED_PARTS):
            continue
        m = _KEY.search(name)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: unexpected tensor {name!r} (only LoRA A/B of "
                             f"{', '.join(TARGET_MODULES)} are supported)")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is for layer {layer}, the model has "
                             f"{num_layers}")
        if which in halves.setdefault((layer, module), {}):
            raise ValueError(f"LoRA adapter {path!r}: more than one lora_{which} for layer {layer} {module} "
                             f"(e.g. {name!r})")
        halves[(layer, module)][which] = t
    out = LoRAWeights(config)
    for key, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layer {key[0]} {key[1]} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {path!r}: layer {key[0]} {key[1]}: A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)} do not make a low-rank pair")
        if a.shape[0] != config.r:
            raise ValueError(f"LoRA adapter {path!r}: layer {key[0]} {key[1]} has rank {a.shape[0]}, the config "
                             f"says r={config.r}")
        out.weights[key] = (a, b)
    if not out.weights:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return out


def write_random_adapter(path: str, config: object, rank: int, targets: tuple[str, ...] = TARGET_MODULES,
                         alpha: float | None = None, seed: int = 0, std: float = 0.02,
                         dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> str:
    """Save a PEFT-format adapter with random A and B for the model `config` (a transformers config) to `path`
    (benchmarks and GPU tests: no `peft` needed, any model shape)."""
    import json

    from safetensors.torch import save_file

    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for m in targets:
            out_f, in_f = shapes[m]
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g, device=device)
                                                / in_f ** 0.5).to(dtype).cpu()
            tensors[f"{name}.lora_B.weight"] = (torch.randn(out_f, rank, generator=g, device=device)
                                                * std).to(dtype).cpu()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
                   "target_modules": list(targets), "bias": "none", "use_rslora": False}, f)
    return path
