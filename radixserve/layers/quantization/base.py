"""What a quantization method is: a config read from the checkpoint (or `--quantization`) that hands each layer
a method; the method creates the layer's parameters, finishes them after loading and runs the layer's product.

A layer that can be quantized (the linear layers; MoE layers when they exist) holds `quant_method` and calls
`quant_method.create_weights(layer)` and `quant_method.apply(layer, x, bias)`. A method's parameters carry the
sharding attributes the linear loaders read (see `layers/linear.py`)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from radixserve.layers import cpu_ops

if TYPE_CHECKING:
    from radixserve.layers.linear import _LinearBase


class NormedProduct(NamedTuple):
    """What a method's `apply_normed` returns: the product of the normed x, the new residual, and whether the
    q/k/v rotation and KV store it was asked for (a `RopeArgs`) were done in the same launch."""
    out: torch.Tensor
    residual: torch.Tensor
    rotated: bool


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


def new_param(shape: tuple[int, ...], dtype: torch.dtype, attrs: dict[str, Any] | None = None,
              fill: float | None = None) -> nn.Parameter:
    data = torch.empty(shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    param = nn.Parameter(data, requires_grad=False)
    set_weight_attrs(param, attrs or {})
    return param


class QuantizeMethodBase:
    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every weight of the model has loaded (quantise online, merge scales, repack)."""

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes a forward reads for this layer's weights (parameters held on the device)."""
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


class LinearMethodBase(QuantizeMethodBase):
    def apply(self, layer: _LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(self, layer: _LinearBase) -> None:
        layer.weight = new_param((layer.output_size, layer.input_size), layer.params_dtype,
                                 {"output_dim": 0, "input_dim": 1})

    def apply(self, layer: _LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # F.linear, but on every core for a few CPU rows, and with the weight reordered once for oneDNN above those
        return cpu_ops.linear(x, layer.weight, bias, persistent=True)


class QuantizationConfig:
    """One quantization method's settings. Subclasses set `name` and implement `from_config` and
    `get_quant_method`."""

    name: str = ""

    @classmethod
    def from_config(cls, config: dict[str, Any], *, serialized: bool) -> QuantizationConfig:
        """From the checkpoint's `quantization_config` (`serialized`: the weights on disk are quantized), or from
        an empty dict for `--quantization NAME` on an unquantized checkpoint."""
        raise NotImplementedError

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for `layer` (named `prefix` in the model), or None to leave it unquantized."""
        raise NotImplementedError


STACKED_PARTS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")),
                 # the DeltaNet's projections (Qwen3.5's separate matrices; Qwen3-Next's are stacked as ours)
                 ("in_proj_qkvz", ("in_proj_qkv", "in_proj_z")), ("in_proj_ba", ("in_proj_b", "in_proj_a")))


def hf_parts(prefix: str) -> list[str]:
    """The checkpoint's names of a layer: its own, or its members' for our stacked layers (qkv_proj, gate_up_proj)."""
    for stacked, members in STACKED_PARTS:
        if prefix.endswith(stacked):
            return [prefix[: -len(stacked)] + m for m in members]
    return [prefix]


def name_matches(name: str, pattern: str) -> bool:
    """Whether a layer name matches one entry of a checkpoint's ignore or target list: `re:<regex>` (matched from
    the name's start, as compressed-tensors does), a shell wildcard (`*`, `?`: ModelOpt's `exclude_modules`), or a
    plain name equal to the layer's, to a dotted suffix of it, or to one of its components."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern) or pattern in name.split(".")


def is_ignored(prefix: str, ignored: list[str] | tuple[str, ...],
               matches: Callable[[str, str], bool] = name_matches) -> bool:
    """Whether a layer is in a checkpoint's ignore list (HF names; our stacked layers match by their own name or
    by all of their parts), each entry tested with `matches` (the format's rule)."""
    if not ignored:
        return False
    if any(matches(prefix, pattern) for pattern in ignored):  # a checkpoint whose layer is stacked as ours
        return True
    parts = hf_parts(prefix)
    hits = [any(matches(p, pattern) for pattern in ignored) for p in parts]
    if any(hits) and not all(hits):
        raise ValueError(f"layer {prefix}: some of its stacked matrices are quantized and some are not")
    return all(hits)
