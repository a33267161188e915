"""An adapter's configuration, read from a PEFT folder's `adapter_config.json`."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

# the projections a LoRA adapter may target, by their Hugging Face names
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    path: str
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # the subset of TARGET_MODULES named in the config (or all for "all-linear")

    @property
    def scaling(self) -> float:
        """The factor PEFT multiplies lora_B(lora_A(x)) by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_folder(cls, path: str) -> LoRAConfig:
        file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(file):
            raise ValueError(f"LoRA adapter {path!r}: no adapter_config.json (a PEFT adapter folder is expected)")
        with open(file) as f:
            raw = json.load(f)
        peft_type = str(raw.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not supported (only LORA)")
        unsupported = []
        if raw.get("use_dora"):
            unsupported.append("use_dora")
        if raw.get("bias", "none") != "none":
            unsupported.append(f"bias={raw.get('bias')!r}")
        if raw.get("modules_to_save"):
            unsupported.append("modules_to_save")
        if raw.get("fan_in_fan_out"):
            unsupported.append("fan_in_fan_out")
        if raw.get("target_parameters"):  # LoRA on stacked expert parameters (PEFT's MoE form: GPT-OSS, GLM-4.5)
            unsupported.append(f"target_parameters {raw.get('target_parameters')!r} (LoRA on MoE experts)")
        if raw.get("rank_pattern") or raw.get("alpha_pattern"):
            unsupported.append("rank_pattern/alpha_pattern")
        if unsupported:
            raise ValueError(f"LoRA adapter {path!r}: {', '.join(unsupported)} not supported")
        r = raw.get("r")
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"LoRA adapter {path!r}: rank r must be a positive integer; got {r!r}")
        targets = raw.get("target_modules") or ()
        if targets == "all-linear":
            targets = TARGET_MODULES
        elif isinstance(targets, str):  # a regex over module names: the weights decide what is really there
            targets = tuple(t for t in TARGET_MODULES if t in targets)
        else:  # names, or dotted suffixes of module paths ("feed_forward.down_proj": PEFT matches the path's end)
            targets = tuple(t.rsplit(".", 1)[-1] if isinstance(t, str) else t for t in targets)
        bad = sorted(str(t) for t in set(targets) - set(TARGET_MODULES))
        if bad:
            raise ValueError(f"LoRA adapter {path!r}: target module(s) {', '.join(bad)} not supported (supported: "
                             f"{', '.join(TARGET_MODULES)})")
        alpha = raw.get("lora_alpha", r)
        return cls(path=path, r=r, lora_alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)),
                   target_modules=tuple(t for t in TARGET_MODULES if t in targets))
