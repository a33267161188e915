"""GGUF weights kept quantized: Q8_0 and Q4_K linear layers hold their packed fields (`gguf_formats`) and multiply
through Triton kernels that dequantise in registers (`gguf_kernels`, `gguf_gemm`); on the CPU the dequantising torch
reference runs. Every other tensor type (F16/F32, Q6_K, Q5_0, ...), and a stacked layer whose parts differ in type,
is dequantised at load as before, with one log line saying which.

Two ways in: a .gguf file (`GGUFConfig.from_file`: each layer's format is its tensors' type in the file), or
`--quantization q8_0 | q4_k` on a 16/32-bit checkpoint (quantised online after loading; what the benchmarks use
with dummy weights)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.layers.quantization import gguf_formats as fmts
from radixserve.layers.quantization.base import (
    LinearMethodBase,
    NormedProduct,
    QuantizationConfig,
    QuantizeMethodBase,
    new_param,
)

if TYPE_CHECKING:
    from radixserve.layers.linear import _LinearBase
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs

logger = logging.getLogger(__name__)

PACKED_TYPES = (fmts.Q8_0, fmts.Q4_K)
_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stacked_members(prefix: str) -> list[str]:
    """The HF names of the matrices a layer named `prefix` holds (q/k/v for qkv_proj, gate/up for gate_up_proj)."""
    head, _, leaf = prefix.rpartition(".")
    parts = _STACKED.get(leaf)
    return [f"{head}.{p}" if head else p for p in parts] if parts else [prefix]


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, tensor_types: dict[str, str] | None = None, online_type: str | None = None) -> None:
        if online_type is not None and online_type not in PACKED_TYPES:
            raise ValueError(f"online GGUF quantization must be one of {', '.join(PACKED_TYPES)}, got {online_type}")
        self.tensor_types = dict(tensor_types or {})
        self.online_type = online_type
        self.packed: set[str] = set()  # HF weight names the loader must hand over packed
        self._dequantized: Counter[str] = Counter()
        self._q8_0_rows: Counter[int] = Counter()  # online Q4_K: layers whose rows take Q8_0, by row length

    @classmethod
    def from_config(cls, config: dict[str, Any], *, serialized: bool) -> GGUFConfig:
        return cls(config.get("tensor_types"), config.get("online_type"))

    @classmethod
    def from_file(cls, path: str) -> GGUFConfig:
        from radixserve.model_loader.gguf_loader import gguf_to_hf_name, open_gguf

        reader = open_gguf(path)
        types = {}
        for t in reader.tensors:
            try:
                hf = gguf_to_hf_name(t.name)
            except ValueError:
                continue  # the loader reports unknown tensors
            if hf is not None:
                types[hf] = t.tensor_type.name
        return cls(types)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from radixserve.layers.linear import _LinearBase

        if not isinstance(layer, _LinearBase):
            return None
        members = stacked_members(prefix)
        if self.online_type is not None:
            fmt = self.online_type
        else:
            kinds = {self.tensor_types.get(m + ".weight", "missing") for m in members}
            fmt = kinds.pop() if len(kinds) == 1 else None
            if fmt not in PACKED_TYPES:
                self._dequantized["+".join(sorted(kinds | ({fmt} if fmt else set())))] += 1
                return None
        if layer.input_size % fmts.BLOCK[fmt]:
            if self.online_type == "Q4_K" and layer.input_size % fmts.BLOCK["Q8_0"] == 0:
                # rows that are not whole 256-weight super-blocks: llama.cpp falls back to Q5_0 there; Q8_0 is
                # the nearest format these kernels keep packed
                self._q8_0_rows[layer.input_size] += 1
                return GGUFLinearMethod("Q8_0", online=True)
            self._dequantized[f"{fmt} with rows of {layer.input_size}"] += 1
            return None
        if self.online_type is None:
            self.packed.update(m + ".weight" for m in members)
        return GGUFLinearMethod(fmt, online=self.online_type is not None)

    def log_summary(self) -> None:
        if self._q8_0_rows:
            rows = ", ".join(f"{n} layers with rows of {k}" for k, n in sorted(self._q8_0_rows.items()))
            logger.warning("--quantization q4_k: Q8_0 for %s (Q4_K packs rows of whole 256-weight super-blocks)",
                           rows)
        if not self._dequantized:
            return
        kinds = ", ".join(f"{k} ({n} layers)" for k, n in sorted(self._dequantized.items()))
        if self.online_type is not None:
            logger.warning("--quantization %s: these linear layers stay in the model dtype: %s",
                           self.online_type.lower(), kinds)
        else:
            logger.info("GGUF: Q8_0/Q4_K linear layers stay packed; dequantised at load: %s", kinds)


class GGUFLinearMethod(LinearMethodBase):
    def __init__(self, fmt: str, online: bool) -> None:
        self.fmt = fmt
        self.online = online

    def create_weights(self, layer: _LinearBase) -> None:
        n, k = layer.output_size, layer.input_size
        if self.online:
            layer.weight = new_param((n, k), layer.params_dtype, {"output_dim": 0, "input_dim": 1})
            return
        for field in fmts.FIELDS[self.fmt]:
            param = new_param(fmts.field_shape(self.fmt, field, n, k), fmts.field_dtype(self.fmt, field),
                              {"output_dim": 0, "input_dim": 1,
                               "input_block": fmts.field_input_block(self.fmt, field)}, fill=0)
            setattr(layer, field, param)

    def process_weights_after_loading(self, layer: _LinearBase) -> None:
        if not self.online:
            return
        fields = fmts.quantize(self.fmt, layer.weight.data)
        del layer.weight
        for name, value in fields.items():
            setattr(layer, name, nn.Parameter(value, requires_grad=False))

    def fields(self, layer: _LinearBase) -> dict[str, torch.Tensor]:
        return {f: getattr(layer, f) for f in fmts.FIELDS[self.fmt]}

    def apply(self, layer: _LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from radixserve.layers.triton_ops import use_fused

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if use_fused(x2):
            from radixserve.layers.quantization.gguf_gemm import gguf_gemm
            from radixserve.layers.quantization.gguf_kernels import gemv_max_m, gguf_gemv

            x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
            out = gguf_gemv(x2, self.fmt, self.fields(layer), layer.output_size, bias) \
                if x2.shape[0] <= gemv_max_m(self.fmt) else None
            if out is None:
                out = gguf_gemm(x2, self.fmt, self.fields(layer), layer.output_size, bias)
        else:  # the dequantised weight through the same CPU product as an unquantized layer (same numerics)
            from radixserve.layers import cpu_ops

            out = cpu_ops.linear(x2, fmts.dequantize(self.fmt, self.fields(layer)).to(x.dtype), bias)
        return out.view(*shape[:-1], out.shape[-1])

    def _dp4c(self, layer: _LinearBase, x: torch.Tensor, k: int) -> GemvConfig | None:
        """The dp4c tiles when this layer's product of the one row `x` runs through dp4c, else None."""
        from radixserve.layers.triton_ops import use_fused

        if self.fmt != fmts.Q4_K or x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1 or not use_fused(x) \
                or k != layer.input_size:
            return None
        from radixserve.layers.quantization.gguf_kernels import dp4c_config

        return dp4c_config(layer.output_size, k, self.fields(layer), x.is_cuda)

    def apply_normed(self, layer: _LinearBase, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, bias: torch.Tensor | None, rope: RopeArgs | None = None) -> NormedProduct | None:
        """RMSNorm(x + residual) * weight through this layer, with the norm and x's quantisation in one launch
        before dp4c (`gguf_prologue`), for one row; with `rope` (a q/k/v layer) q and k rotated and k / v stored in
        dp4c's epilogue where its tiles pair the rotary halves (`gguf_chunk_rope`). None where dp4c does not serve
        the product."""
        cfg = self._dp4c(layer, x, x.shape[-1])
        if cfg is None:
            return None
        from radixserve.layers.quantization.gguf_chunk_rope import dp4c_qkv_rope, rope_rows
        from radixserve.layers.quantization.gguf_kernels import dp4c_gemv
        from radixserve.layers.quantization.gguf_prologue import q8_1_blocks_normed

        xw, f, new_res = q8_1_blocks_normed(x, residual, weight, eps)
        out = x.new_empty((1, layer.output_size))
        residual = x if new_res is None else new_res
        if rope is not None and rope_rows(cfg, rope.head_dim):
            return NormedProduct(dp4c_qkv_rope(xw, f, self.fields(layer), layer.output_size, bias, cfg, rope, out),
                                 residual, True)
        return NormedProduct(dp4c_gemv(xw, f, self.fields(layer), layer.output_size, bias, cfg, out), residual, False)

    def apply_gated(self, layer: _LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """silu(gate) * up of x = [gate | up] through this layer, the activation and x's quantisation in one
        launch before dp4c (`gguf_prologue`), for one row; None where dp4c does not serve the product."""
        cfg = self._dp4c(layer, x, x.shape[-1] // 2)
        if cfg is None:
            return None
        from radixserve.layers.quantization.gguf_kernels import dp4c_gemv
        from radixserve.layers.quantization.gguf_prologue import q8_1_blocks_gated

        xw, f = q8_1_blocks_gated(x)
        out = x.new_empty((1, layer.output_size))
        return dp4c_gemv(xw, f, self.fields(layer), layer.output_size, bias, cfg, out)
