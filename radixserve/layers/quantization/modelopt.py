"""NVIDIA ModelOpt FP8 checkpoints (the `nvidia/...-FP8` releases), served through the fp8 layers (`fp8.py`).

ModelOpt's unified checkpoint keeps the model's tensor names: each quantized linear layer has `weight`
(float8_e4m3fn), a per-tensor `weight_scale` and a static per-tensor `input_scale`; the KV cache's scales are
`k_proj.k_scale` / `v_proj.v_scale` (read by `kv_cache.py`, used with `--kv-cache-dtype fp8_e4m3`). The settings
are in config.json's `quantization_config` (`quant_method: modelopt`) or, in older exports, in
`hf_quant_config.json` beside it (`{"quantization": {...}}`; the loader reads it when config.json has none).
`quant_algo` FP8 is supported; `exclude_modules` / `ignore` (names or shell wildcards, the checkpoint's names: a
model that renames its layers gives them back, `apply_quantization`'s `checkpoint_prefix`) stay unquantized. MoE
experts take the fp8 experts' per-tensor form (`fp8_moe.py`, Nemotron 3's non-gated ones too). Other algorithms
(NVFP4, INT4-AWQ, per-block FP8) are refused with their name."""

from __future__ import annotations

from typing import Any

from radixserve.layers.quantization.base import QuantizationConfig
from radixserve.layers.quantization.fp8 import Fp8Config

SUPPORTED_ALGOS = ("FP8",)


def modelopt_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings of either layout: config.json's flat `quantization_config` or hf_quant_config.json's
    `quantization` section."""
    nested = config.get("quantization")
    return nested if isinstance(nested, dict) else config


class ModelOptConfig(QuantizationConfig):
    """Reads the checkpoint's settings and hands back the fp8 config they amount to (`from_config`)."""

    name = "modelopt"

    @classmethod
    def from_config(cls, config: dict[str, Any], *, serialized: bool) -> QuantizationConfig:  # type: ignore[override]
        if not config:
            raise ValueError("modelopt quantization reads the checkpoint's quantization_config or "
                             "hf_quant_config.json; this checkpoint has neither (for online fp8, use "
                             "--quantization fp8)")
        settings = modelopt_settings(config)
        algo = str(settings.get("quant_algo") or "").upper()
        if algo not in SUPPORTED_ALGOS:
            raise ValueError(f"modelopt quant_algo {settings.get('quant_algo')!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ALGOS)}")
        kv_algo = settings.get("kv_cache_quant_algo")
        if kv_algo not in (None, "FP8", "fp8"):
            raise ValueError(f"modelopt kv_cache_quant_algo {kv_algo!r} is not supported (FP8 or none)")
        exclude = settings.get("exclude_modules") or settings.get("ignore") or []
        # per-tensor weight scales and static per-tensor input scales; dummy weights: per row, dynamic
        return Fp8Config(serialized=serialized, activation_scheme="static" if serialized else "dynamic",
                         ignored_layers=list(exclude))
