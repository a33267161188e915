"""Attention backends, registered by name and imported lazily so optional kernels stay optional."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.layers.attention.base_attn_backend import AttentionBackend
    from radixserve.model_executor.model_runner import ModelRunner

# name -> "module:class"; also --attention-backend's choices (ServerArgs reads the names)
ATTENTION_BACKENDS: dict[str, str] = {
    "cpu": "radixserve.layers.attention.cpu_backend:CpuAttnBackend",
    "double_sparsity": "radixserve.layers.attention.double_sparsity_backend:DoubleSparseAttnBackend",
    "flex": "radixserve.layers.attention.flex_attention_backend:FlexAttnBackend",
    "torch_native": "radixserve.layers.attention.torch_native_backend:TorchNativeAttnBackend",
    "triton": "radixserve.layers.attention.triton_backend:TritonAttnBackend",
}
# optional dependency (pip install flashinfer-python): a choice only where the package is installed
if importlib.util.find_spec("flashinfer") is not None:
    ATTENTION_BACKENDS["flashinfer"] = "radixserve.layers.attention.flashinfer_backend:FlashInferAttnBackend"


def create_attention_backend(name: str, model_runner: ModelRunner) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    module, cls = ATTENTION_BACKENDS[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} is not available: {e}") from e
    return getattr(mod, cls)(model_runner)
