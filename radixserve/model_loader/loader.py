"""get_model: build the model class for a ModelConfig on a device and fill its weights."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from radixserve.model_loader.dummy import initialize_dummy_weights
from radixserve.model_loader.gguf_loader import count_gguf_tensors, gguf_weights_iterator, open_gguf
from radixserve.model_loader.weight_utils import (
    checkpoint_format,
    count_pt_tensors,
    count_safetensors_tensors,
    list_pt_files,
    list_safetensors_files,
    pt_weights_iterator,
    safetensors_weights_iterator,
)

if TYPE_CHECKING:
    from radixserve.configs.model_config import ModelConfig

logger = logging.getLogger(__name__)

_LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_load_format(model_config: ModelConfig, load_format: str) -> str:
    """"auto" becomes "gguf" for a GGUF file and, for a folder, "safetensors" (or "pt" for a folder of PyTorch .bin
    files only); mismatches raise ValueError."""
    if load_format not in _LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(_LOAD_FORMATS)}, got {load_format!r}")
    if load_format == "auto":
        return "gguf" if model_config.is_gguf else checkpoint_format(model_config.model_path)
    if load_format == "gguf" and not model_config.is_gguf:
        raise ValueError(f"load_format 'gguf' needs a .gguf file, got the folder {model_config.model_path}")
    if load_format in ("safetensors", "pt") and model_config.is_gguf:
        raise ValueError(f"load_format {load_format!r} needs a folder, got the GGUF file {model_config.model_path}")
    return load_format


def _weights(model_config: ModelConfig, load_format: str,
             packed: set[str] | None = None) -> tuple[Iterable[tuple[str, torch.Tensor]], int]:
    if load_format == "gguf":
        reader = open_gguf(model_config.model_path)
        return gguf_weights_iterator(model_config.model_path, reader, packed), count_gguf_tensors(reader)
    if load_format == "pt":
        files = list_pt_files(model_config.model_path)
        return pt_weights_iterator(files), count_pt_tensors(files)
    files = list_safetensors_files(model_config.model_path)
    return safetensors_weights_iterator(files), count_safetensors_tensors(files)


def _hf_quant_config(model_config: ModelConfig) -> dict | None:
    """The checkpoint's `quantization_config`; for an older NVIDIA ModelOpt export without one, its
    `hf_quant_config.json`."""
    qc = getattr(model_config.hf_config, "quantization_config", None)
    if qc is None and not model_config.is_gguf:
        path = os.path.join(model_config.model_path, "hf_quant_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
                raise ValueError(f"{path}: expected a ModelOpt quantization file with a 'quantization' section")
            return {"quant_method": "modelopt", **data}
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def cover_context(model: nn.Module, context_len: int) -> None:
    """Extend every rotary table of `model` to `context_len` positions: a `--context-length` past the config's
    max_position_embeddings (allowed, with a warning) would otherwise index past the tables' end."""
    from radixserve.layers.rotary_embedding import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cover(context_len)


def get_model(
    model_config: ModelConfig,
    *,
    load_format: str,
    dtype: torch.dtype,
    device: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    seed: int = 42,
    quantization: str | None = None,
    cover_positions: int | None = None,
    quantize_lm_head: bool = False,
) -> nn.Module:
    """The model of `model_config`, built on `device` in `dtype`, with weights from safetensors, GGUF or random
    ("dummy"). `quantization` (`--quantization`) or the checkpoint's `quantization_config` picks a method from
    `layers.quantization`. The rotary tables cover `cover_positions` positions (default the served context; 0: as
    built, for a caller that covers them itself once it knows how long a request can be). `quantize_lm_head`: the
    LM head in int8 rows (`lm_head_int8`). Raises ValueError for an unsupported architecture or
    unreadable weights."""
    from radixserve.layers.quantization import apply_quantization, finish_quantization, resolve_quant_config
    from radixserve.models.registry import get_model_class

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is out of range for tp_size {tp_size}")
    load_format = resolve_load_format(model_config, load_format)
    model_class = get_model_class(model_config.architectures)
    torch_device = torch.device(device)
    quant_config = resolve_quant_config(quantization, _hf_quant_config(model_config), load_format=load_format,
                                        is_gguf=model_config.is_gguf, gguf_path=model_config.model_path,
                                        packed_default=torch_device.type == "cuda")

    start = time.perf_counter()
    with _default_dtype(dtype), torch_device:
        model = model_class(model_config.hf_config, tp_rank=tp_rank, tp_size=tp_size)
        cover_context(model, model_config.context_len if cover_positions is None else cover_positions)
        if quant_config is not None:
            apply_quantization(model, quant_config)

    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
    else:
        weights, total = _weights(model_config, load_format, getattr(quant_config, "packed", None))
        bar = tqdm(weights, total=total, desc=f"Loading {load_format} weights", unit="tensor",
                   disable=tp_rank != 0, dynamic_ncols=True)
        with torch.no_grad():
            model.load_weights(bar)
        bar.close()
    with torch.no_grad():
        finish_quantization(model)
        for module in model.modules():  # forms of weights derived once they are in (e.g. MoEGate's half copy)
            hook = getattr(module, "after_weights_loaded", None)
            if hook is not None:
                hook()
        if quantize_lm_head:
            from radixserve.layers.quantization.lm_head_int8 import quantize_lm_head as quantize_head

            quantize_head(model)
    model.eval()
    if torch_device.type == "cuda":
        torch.cuda.synchronize(torch_device)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s (%s, %.1fM params/rank, %s%s, %s) in %.1fs", type(model).__name__, load_format,
                n_params / 1e6, dtype, f", {quant_config.name}" if quant_config else "", torch_device,
                time.perf_counter() - start)
    return model
