"""Quantization methods, one file each, behind a registry (imported only when asked for; the names feed
`ServerArgs --quantization`).

`resolve_quant_config(name, hf_quant_config, ...)` picks the method from `--quantization` or the checkpoint's
`quantization_config`; `apply_quantization(model, config)` gives each layer that the method quantizes its
`quant_method` (and that method's parameters) before the weights load; `finish_quantization(model)` runs each
method's `process_weights_after_loading` once they have."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from radixserve.layers.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)

# name -> (module, config class)
QUANTIZATION_METHODS: dict[str, tuple[str, str]] = {
    "fp8": ("radixserve.layers.quantization.fp8", "Fp8Config"),
    # fp8 checkpoints in llm-compressor's and NVIDIA ModelOpt's formats
    "compressed-tensors": ("radixserve.layers.quantization.compressed_tensors", "CompressedTensorsConfig"),
    "modelopt": ("radixserve.layers.quantization.modelopt", "ModelOptConfig"),
    # 4-bit weight-only checkpoints
    "gptq": ("radixserve.layers.quantization.int4", "Int4Config"),
    "awq": ("radixserve.layers.quantization.int4", "Int4Config"),
    "gguf": ("radixserve.layers.quantization.gguf", "GGUFConfig"),
    # a 16/32-bit checkpoint quantised online to a packed GGUF format
    "q8_0": ("radixserve.layers.quantization.gguf", "GGUFConfig"),
    "q4_k": ("radixserve.layers.quantization.gguf", "GGUFConfig"),
}
# checkpoint quant_method values that mean one of ours
_ALIASES = {"fp8": "fp8", "gguf": "gguf", "compressed-tensors": "compressed-tensors",
            "compressed_tensors": "compressed-tensors", "modelopt": "modelopt", "gptq": "gptq", "awq": "awq"}
# checkpoint formats that the model's loader widens to the model dtype itself (GPT-OSS's MXFP4 experts,
# `models/gpt_oss.py`): served as an unquantized model
WIDENED_AT_LOAD = ("mxfp4",)
# what of an fp8 checkpoint's quantization_config dummy weights keep (its scales are not there: activations
# dynamic); the other checkpoint formats read only their layout when not serialized
_LAYOUT_KEYS = ("weight_block_size", "ignored_layers", "modules_to_not_convert")


def get_quantization_config_class(name: str) -> type[QuantizationConfig]:
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {name!r}; supported: {', '.join(sorted(QUANTIZATION_METHODS))}")
    module, cls = QUANTIZATION_METHODS[name]
    return getattr(importlib.import_module(module), cls)


def resolve_quant_config(name: str | None, hf_quant_config: dict[str, Any] | None, *,
                         load_format: str = "auto", is_gguf: bool = False, gguf_path: str | None = None,
                         packed_default: bool = True) -> QuantizationConfig | None:
    """The quantization of a model: `name` (`--quantization`) or the checkpoint's `quantization_config`.

    A checkpoint's method wins when no name is given; a name that contradicts the checkpoint is a ValueError.
    With dummy weights the checkpoint's layout (fp8 blocks, ignored layers) is quantised online instead (there is
    nothing on disk; activation scales dynamic). A GGUF
    file keeps its Q8_0/Q4_K layers packed with `gguf` (by default only where `packed_default`: on GPUs); so does a
    4-bit GPTQ / AWQ / W4A16 checkpoint (elsewhere its layers are dequantised once loaded, unless the method is
    named)."""
    if is_gguf and (name == "gguf" or (name is None and packed_default)):
        if gguf_path is None:
            raise ValueError("gguf quantization needs the GGUF file's path")
        return get_quantization_config_class("gguf").from_file(gguf_path)
    if is_gguf and name is None:
        return None
    if is_gguf:
        raise ValueError(f"--quantization {name} cannot be applied to a GGUF file (its weights are quantized "
                         f"already; leave --quantization unset or use gguf)")
    ckpt_method = None
    if hf_quant_config:
        raw = str(hf_quant_config.get("quant_method", "")).lower()
        if raw in WIDENED_AT_LOAD:
            if name is not None:
                raise ValueError(f"--quantization {name}: this checkpoint's {raw} experts are widened to the model "
                                 f"dtype at load (leave --quantization unset)")
            return None
        ckpt_method = _ALIASES.get(raw)
        if ckpt_method is None:
            raise ValueError(f"checkpoint quantization_config.quant_method {raw!r} is not supported; supported: "
                             f"{', '.join(sorted(QUANTIZATION_METHODS))}")
    if name is None and ckpt_method is None:
        return None
    if name is not None and ckpt_method is not None and name != ckpt_method:
        raise ValueError(f"--quantization {name} contradicts the checkpoint's quantization_config "
                         f"(quant_method {ckpt_method})")
    method = name or ckpt_method
    if method == "gguf":
        raise ValueError("--quantization gguf needs a .gguf model file")
    if method in ("q8_0", "q4_k"):
        if ckpt_method is not None:
            raise ValueError(f"--quantization {method} quantises a 16/32-bit checkpoint; this one is {ckpt_method}")
        return get_quantization_config_class(method).from_config({"online_type": method.upper()}, serialized=False)
    serialized = ckpt_method is not None and load_format != "dummy"
    config = hf_quant_config if serialized else {}
    if ckpt_method == "fp8" and not serialized:  # dummy weights: quantised online to the checkpoint's layout
        config = {key: hf_quant_config[key] for key in _LAYOUT_KEYS if key in hf_quant_config}
    elif ckpt_method is not None:
        config = hf_quant_config
    quant = get_quantization_config_class(method).from_config(dict(config or {}), serialized=serialized)
    if hasattr(quant, "keep_packed"):  # 4-bit layers on the CPU: dequantised once unless the method was named
        quant.keep_packed(packed_default or name is not None)
    return quant


# Linear layers whose weight a model reads as a matrix (MLA's kv_b_proj, absorbed into the attention): they stay in
# the model dtype (a quantized checkpoint's are dequantised once loaded: the config's `matrix_method`).
READ_AS_MATRIX = ("kv_b_proj",)


def apply_quantization(model: nn.Module, config: QuantizationConfig) -> int:
    """Give every layer that `config` quantizes its method and parameters (linear layers, and the MoE layers'
    stacked experts where the method has a MoE form that serves them; not the layers whose names end as the
    model's `kept_unquantized(config)` says); a model's `checkpoint_prefix(name)` gives the checkpoint's name of a
    layer, which an ignore list may use as well as ours. Returns how many layers changed."""
    from radixserve.layers.moe.layer import FusedMoE

    count, experts_kept = 0, 0
    kept = getattr(model, "kept_unquantized", None)  # layers a model loads in 16 bits whatever the checkpoint
    kept = tuple(kept(config)) if kept is not None else ()
    # a model whose checkpoint names its layers otherwise (Nemotron-H's `backbone.`): ignore lists may use either
    ckpt_name = getattr(model, "checkpoint_prefix", None)
    for prefix, module in model.named_modules():
        if not hasattr(module, "set_quant_method") or (kept and prefix.endswith(kept)):
            continue
        name = ckpt_name(prefix) if ckpt_name is not None else prefix
        if prefix.rsplit(".", 1)[-1] in READ_AS_MATRIX:  # the model dtype; a quantized checkpoint's dequantised
            matrix = getattr(config, "matrix_method", None)
            method = matrix(module, name) if matrix is not None else None
            if method is not None:
                module.set_quant_method(method)
            continue
        method = config.get_quant_method(module, name)
        if method is not None and name != prefix and config.get_quant_method(module, prefix) is None:
            method = None  # ignored under our name (an ignore list written from in-memory names)
        if isinstance(module, FusedMoE) and method is not None and not method.serves(module):
            method = None  # (GPT-OSS's experts with biases: served in the model dtype)
        if method is not None:
            module.set_quant_method(method)
            count += 1
        elif isinstance(module, FusedMoE):
            experts_kept += 1
    if experts_kept:
        logger.warning("%s quantization: %d MoE expert layers stay in the model dtype (%s has no MoE form for "
                       "them, e.g. experts with biases, or they are in the ignore list)", config.name, experts_kept,
                       config.name)
    logger.info("%s quantization on %d layers", config.name, count)
    if hasattr(config, "log_summary"):
        config.log_summary()
    return count


def finish_quantization(model: nn.Module) -> None:
    """Each quantized layer's `process_weights_after_loading` (online quantisation, scale merging, repacking)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
