"""compressed-tensors checkpoints (llm-compressor's format: the FP8-dynamic / FP8 / FP8-block and W4A16 releases of
RedHatAI and neuralmagic): 8-bit float weights served through the fp8 layers (`fp8.py`, `fp8_moe.py`), 4- and
8-bit integer weight-only groups (`pack-quantized`, symmetric) through the integer layers (`int4.py`).

The checkpoint's `quantization_config` lists `config_groups`, each naming its `targets` (`Linear`: every linear
layer; `re:<regex>` or a layer name) and a scheme: `weights` {num_bits 8, type float, strategy tensor | channel |
block (`block_structure`)} and `input_activations` (dynamic: scales per token, per token and group, or per tensor
computed on the fly; static per tensor: the checkpoint's `input_scale`; null: weight-only, the activations stay
16-bit). A layer no group targets, or one the `ignore` list names, stays unquantized. Each group becomes an
`Fp8Config`, with the checkpoint's tensor names: `weight` (float8_e4m3fn), `weight_scale` ([1], [N, 1] or the
block grid), `input_scale`. Dynamic activations are quantised per token (and 128-column group for block weights)
whatever granularity the group names: a per-tensor dynamic scale is never finer, so the product is at least as
exact. A KV-cache scheme's `k_scale` / `v_scale` load as any fp8 checkpoint's (`kv_cache.py`) and take effect
with `--kv-cache-dtype fp8_e4m3`.

A W4A16 / W8A16 group (`weights` {num_bits 4 or 8, type int, symmetric, strategy group or channel}, no input
activations) holds `weight_packed` / `weight_scale` / `weight_shape` (actorder "weight" / "static" stores that
plain layout). Integer W8A8, asymmetric or group-activation-ordered (`weight_g_idx`) integer weights, NVFP4 and
other schemes, sparsity and transforms are refused with the scheme named (their weights would load as something
else). With `--load-format dummy` each group's layers are quantised online to its layout."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from radixserve.layers.quantization.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    hf_parts,
    is_ignored,
)
from radixserve.layers.quantization.fp8 import Fp8Config, Fp8DequantizedMethod, Fp8LinearMethod
from radixserve.layers.quantization.int4 import Int4Config, Int4DequantizedMethod, Int4LinearMethod

_FORMATS = (None, "float-quantized", "naive-quantized", "mixed-precision", "pack-quantized")
# the HF names of an expert's three matrices, in the two spellings MoE checkpoints use
_EXPERT_PARTS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def ct_name_matches(name: str, pattern: str) -> bool:
    """compressed-tensors' rule for a `targets` / `ignore` entry naming a layer: `re:<regex>` matched from the
    name's start (re.match), anything else the layer's whole name (llm-compressor writes the full names of the
    layers it left alone; a short name such as `down_proj` names no layer)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


@dataclass(frozen=True)
class SchemeGroup:
    """One `config_groups` entry: what it targets and the fp8 or integer layers it gives them."""
    name: str
    targets: tuple[str, ...]
    scheme: Fp8Config | Int4Config

    def linear_method(self) -> QuantizeMethodBase:
        if isinstance(self.scheme, Int4Config):
            return Int4LinearMethod(self.scheme)
        return Fp8LinearMethod(self.scheme)

    def matrix_method(self) -> QuantizeMethodBase | None:
        if not self.scheme.serialized:
            return None
        if isinstance(self.scheme, Int4Config):
            return Int4DequantizedMethod(self.scheme)
        return Fp8DequantizedMethod(self.scheme)

    def specificity(self, layer_name: str) -> int:
        """How precisely this group targets the layer (0: not at all): its name 3, a regex 2, `Linear` 1."""
        best = 0
        for target in self.targets:
            if target == "Linear":
                best = max(best, 1)
            elif target.startswith("re:"):
                best = max(best, 2 if ct_name_matches(layer_name, target) else 0)
            elif layer_name == target:
                best = 3
        return best


def _bits(args: dict[str, Any], what: str, group: str) -> None:
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ValueError(f"compressed-tensors group {group}: {what} of {args.get('num_bits')}-bit "
                         f"{args.get('type')} type are not supported (only 8-bit float, FP8)")
    if args.get("symmetric") is False:
        raise ValueError(f"compressed-tensors group {group}: asymmetric {what} are not supported")


def _wna16(name: str, group: dict[str, Any], fmt: str | None, serialized: bool) -> Int4Config:
    """A pack-quantized 4- or 8-bit integer group (W4A16 / W8A16) as the integer layers' config."""
    weights = group["weights"]
    bits = weights.get("num_bits")
    if bits not in (4, 8):
        raise ValueError(f"compressed-tensors group {name}: {bits}-bit int weights are not supported (4 or 8, "
                         f"weight-only)")
    if fmt not in (None, "pack-quantized", "mixed-precision"):
        raise ValueError(f"compressed-tensors group {name}: {bits}-bit int weights in format {fmt!r} are not "
                         f"supported (pack-quantized)")
    if weights.get("symmetric") is False:
        raise ValueError(f"compressed-tensors group {name}: asymmetric {bits}-bit weights are not supported")
    # actorder "weight" (and its alias "static") orders the columns during calibration only: the stored layout is
    # the plain one, without g_idx; "group" (alias "dynamic", True in older releases) stores weight_g_idx
    if weights.get("actorder") not in (None, False, "weight", "static"):
        raise ValueError(f"compressed-tensors group {name}: activation-ordered {bits}-bit weights (actorder "
                         f"{weights.get('actorder')!r}, with weight_g_idx) are not supported")
    if group.get("input_activations") is not None:
        raise ValueError(f"compressed-tensors group {name}: {bits}-bit int weights with quantized activations are "
                         f"not supported")
    strategy = weights.get("strategy")
    if strategy == "group":
        size = int(weights.get("group_size") or 0)
    elif strategy == "channel":
        size = -1
    else:
        raise ValueError(f"compressed-tensors group {name}: {bits}-bit weight strategy {strategy!r} is not "
                         f"supported (group or channel)")
    return Int4Config("compressed-tensors", size, sym=True, serialized=serialized, bits=bits)


def parse_group(name: str, group: dict[str, Any], top_format: str | None, serialized: bool) -> SchemeGroup:
    """One config group as an fp8 or a 4-bit weight-only scheme; ValueError naming what is neither."""
    fmt = group.get("format") or top_format
    if fmt not in _FORMATS:
        raise ValueError(f"compressed-tensors group {name}: format {fmt!r} is not supported (FP8 checkpoints are "
                         f"float-quantized, W4A16 ones pack-quantized)")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"compressed-tensors group {name}: no weight scheme")
    targets = group.get("targets") or []
    if isinstance(targets, str):
        targets = [targets]
    if not targets:
        raise ValueError(f"compressed-tensors group {name}: no targets")
    if weights.get("type") == "int":
        return SchemeGroup(name, tuple(str(t) for t in targets), _wna16(name, group, fmt, serialized))
    if fmt == "pack-quantized":
        raise ValueError(f"compressed-tensors group {name}: pack-quantized {weights.get('num_bits')}-bit "
                         f"{weights.get('type')} weights are not supported (4- or 8-bit int)")
    _bits(weights, "weights", name)
    if weights.get("dynamic"):
        raise ValueError(f"compressed-tensors group {name}: dynamically quantized weights are not supported")
    strategy = weights.get("strategy")
    block = None
    if strategy == "block":
        block = weights.get("block_structure")
        if not isinstance(block, (list, tuple)) or len(block) != 2:
            raise ValueError(f"compressed-tensors group {name}: block strategy without a [rows, columns] "
                             f"block_structure (got {block!r})")
    elif strategy not in ("tensor", "channel"):
        raise ValueError(f"compressed-tensors group {name}: FP8 weight strategy {strategy!r} is not supported "
                         f"(tensor, channel or block)")
    if group.get("output_activations"):
        raise ValueError(f"compressed-tensors group {name}: quantized output activations are not supported")
    acts = group.get("input_activations")
    if acts is None:
        scheme = "none"
    else:
        _bits(acts, "input activations", name)
        if acts.get("dynamic") is True:
            scheme = "dynamic"
        elif acts.get("strategy") == "tensor":
            scheme = "static" if serialized else "dynamic"  # dummy weights have no input scales
        else:
            raise ValueError(f"compressed-tensors group {name}: static input activations with strategy "
                             f"{acts.get('strategy')!r} are not supported (only per tensor)")
    fp8 = Fp8Config(serialized=serialized, activation_scheme=scheme, weight_block_size=block,
                    weight_strategy=strategy if serialized else None, block_scale_name="weight_scale")
    return SchemeGroup(name, tuple(str(t) for t in targets), fp8)


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[SchemeGroup], ignore: list[str]) -> None:
        if not groups:
            raise ValueError("compressed-tensors: the quantization_config has no config_groups")
        self.groups = groups
        self.ignore = list(ignore)

    @classmethod
    def from_config(cls, config: dict[str, Any], *, serialized: bool) -> CompressedTensorsConfig:
        if not config:
            raise ValueError("compressed-tensors quantization reads the checkpoint's quantization_config; this "
                             "checkpoint has none (for online fp8, use --quantization fp8)")
        status = config.get("quantization_status")
        if serialized and status not in (None, "compressed"):
            raise ValueError(f"compressed-tensors quantization_status {status!r} is not supported (the weights must "
                             f"be stored compressed)")
        sparsity = config.get("sparsity_config")
        if sparsity and (sparsity.get("format") not in (None, "dense") or sparsity.get("sparsity_structure")):
            raise ValueError(f"compressed-tensors sparsity ({sparsity.get('format')}, "
                             f"{sparsity.get('sparsity_structure')}) is not supported")
        if config.get("transform_config"):
            raise ValueError("compressed-tensors transforms (transform_config) are not supported")
        top_format = config.get("format")
        groups = [parse_group(name, group, top_format, serialized)
                  for name, group in (config.get("config_groups") or {}).items()]
        return cls(groups, config.get("ignore") or [])

    def keep_packed(self, packed: bool) -> None:
        """The 4-bit groups' `Int4Config.keep_packed` (fp8 layers keep their form everywhere)."""
        for group in self.groups:
            if isinstance(group.scheme, Int4Config):
                group.scheme.keep_packed(packed)

    def _group(self, names: list[str], prefix: str) -> SchemeGroup | None:
        """The group that quantizes every one of `names` (a layer's checkpoint names), None if none does; a
        ValueError if they fall into different groups (our stacked layer cannot hold both)."""
        chosen = []
        for layer_name in names:
            ranked = [(g.specificity(layer_name), i) for i, g in enumerate(self.groups)]
            best = max(ranked)
            chosen.append(self.groups[best[1]] if best[0] else None)
        if any(g is not chosen[0] for g in chosen):
            raise ValueError(f"layer {prefix}: its stacked matrices {names} fall into different compressed-tensors "
                             f"groups ({[g.name if g else None for g in chosen]})")
        return chosen[0]

    def _linear_group(self, prefix: str) -> SchemeGroup | None:
        if is_ignored(prefix, self.ignore, ct_name_matches):
            return None
        return self._group(hf_parts(prefix), prefix)

    def _expert_group(self, prefix: str) -> SchemeGroup | None:
        for parts in _EXPERT_PARTS:  # the spelling whose names the targets know (both alike for `Linear`)
            names = [f"{prefix}.0.{p}" for p in parts]
            hits = [any(ct_name_matches(n, i) for i in self.ignore) for n in names]
            if any(hits) and not all(hits):
                raise ValueError(f"MoE layer {prefix}: some of its experts' matrices are ignored and some are not")
            if all(hits):
                return None
            group = self._group(names, prefix)
            if group is not None:
                return group
        return None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from radixserve.layers.linear import _LinearBase
        from radixserve.layers.moe.layer import FusedMoE

        if isinstance(layer, _LinearBase):
            group = self._linear_group(prefix)
            return None if group is None else group.linear_method()
        if isinstance(layer, FusedMoE):
            group = self._expert_group(prefix)
            if group is None:
                return None
            if isinstance(group.scheme, Int4Config):
                return group.scheme.get_quant_method(layer, prefix)  # (dequantised once loaded)
            from radixserve.layers.quantization.fp8_moe import Fp8MoEMethod

            return Fp8MoEMethod(group.scheme)
        return None

    def matrix_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """A layer the model reads as a matrix (MLA's kv_b_proj): loaded as stored, dequantised once."""
        from radixserve.layers.linear import _LinearBase

        if not isinstance(layer, _LinearBase):
            return None
        group = self._linear_group(prefix)
        return None if group is None else group.matrix_method()
