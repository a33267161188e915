"""Which base linear layers carry LoRA, and how an adapter's A/B shard to match them under tensor parallelism.

The model stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; a LoRA group is one such base layer with its
sub-projections. Column-parallel layers (qkv, gate_up) keep A whole (their input is whole) and split B's output rows
like the base weight; row-parallel layers (o, down) split A's input columns like the base weight and keep B whole:
their LoRA delta is a partial sum, added before the layer's all-reduce."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.layers.linear import QKVParallelLinear, RowParallelLinear

GROUPS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                                      "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
GROUP_OF: dict[str, str] = {sub: g for g, subs in GROUPS.items() for sub in subs}
_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(GROUPS) + r")$")


@dataclass
class LoRATarget:
    """One base linear layer that carries LoRA."""

    layer_id: int
    group: str
    base: nn.Module
    in_local: int  # the base layer's (sharded) input size
    out_slices: list[tuple[int, int]]  # (offset, size) of each sub-projection in the local output
    row_parallel: bool

    @property
    def subs(self) -> tuple[str, ...]:
        return GROUPS[self.group]

    def shard_a(self, a: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full A [r, in]."""
        if self.row_parallel:
            return a.narrow(1, self.base.tp_rank * self.in_local, self.in_local)
        return a

    def full_shape(self, sub: str) -> tuple[int, int]:
        """(out, in) of the unsharded projection `sub`."""
        n = self.out_slices[self.subs.index(sub)][1]
        tp = self.base.tp_size
        if self.row_parallel:
            return n, self.in_local * tp
        if isinstance(self.base, QKVParallelLinear) and sub != "q_proj":
            return n * tp // self.base.kv_replicas, self.in_local
        return n * tp, self.in_local

    def shard_b(self, sub: str, b: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full B [out, r]."""
        if self.row_parallel:
            return b
        j = self.subs.index(sub)
        size = self.out_slices[j][1]
        rank = self.base.tp_rank
        if isinstance(self.base, QKVParallelLinear) and sub != "q_proj":
            rank //= self.base.kv_replicas
        return b.narrow(0, rank * size, size)


def find_lora_targets(model: nn.Module, groups: set[str]) -> list[LoRATarget]:
    """The base layers of `model` in the LoRA groups `groups`, in layer order."""
    out = []
    for name, module in model.named_modules():
        m = _NAME.search(name)
        if m is None or m.group(2) not in groups:
            continue
        group = m.group(2)
        out_features, in_features = module.output_size, module.input_size  # quantized layers may hold no .weight
        if group == "qkv_proj":
            q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
            slices = [(0, q), (q, kv), (q + kv, kv)]
        elif group == "gate_up_proj":
            n = module.shard_sizes[0]
            slices = [(0, n), (n, module.shard_sizes[1])]
        else:
            slices = [(0, out_features)]
        out.append(LoRATarget(int(m.group(1)), group, module, in_features, slices,
                              isinstance(module, RowParallelLinear)))
    out.sort(key=lambda t: (t.layer_id, list(GROUPS).index(t.group)))
    return out
