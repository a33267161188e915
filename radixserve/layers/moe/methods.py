"""How the experts' weights are held and multiplied: the seam a quantization method plugs into.

`MoEMethod.create_weights` registers the layer's stacked parameters (and whatever scales a quantized format
needs); `apply` computes the routed experts' weighted sum for the tokens. `FusedMoE` does the routing, sharding and
reduction around it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.quantization.base import QuantizeMethodBase
from radixserve.layers.triton_ops import use_fused

if TYPE_CHECKING:
    from radixserve.layers.moe.layer import FusedMoE


class MoEMethod(QuantizeMethodBase, ABC):
    """`process_weights_after_loading(layer)` (from QuantizeMethodBase) runs once all weights have loaded."""

    @abstractmethod
    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,  # type: ignore[override]
                       inter_size: int) -> None:
        """Register `w13_weight` [E, 2I, H] (gate rows then up rows) and `w2_weight` [E, H, I] (or their
        quantized forms) on `layer`, each with `weight_loader = layer.weight_loader`."""

    @abstractmethod
    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) over the experts this rank holds."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Called once after every weight is loaded (quantization.finish_quantization); quantized formats
        repack or quantize here. Weights in the model dtype need nothing."""
        return None


class UnquantizedMoEMethod(MoEMethod):
    """Weights in the model dtype. The fused Triton kernel for CUDA tensors (`use_fused`), the per-expert torch
    reference elsewhere."""

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, inter_size: int) -> None:
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter_size, hidden_size), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter_size), requires_grad=False)
        layer.w13_weight.weight_loader = layer.weight_loader
        layer.w2_weight.weight_loader = layer.weight_loader

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            from radixserve.layers.moe import small_batch

            if x.shape[0] <= small_batch.SMALL_BATCH_TOKENS:
                shared = layer.folded_shared_weights(x)
                counters = layer.small_counters if layer.small_counters.device == x.device else None
                return small_batch.small_batch_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                                   layer.expert_offset, *(shared or (None, None)),
                                                   counters=counters)
            from radixserve.layers.moe.fused_moe import fused_moe

            return fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.expert_offset,
                             layer.num_experts)
        from radixserve.layers.moe.moe_torch import moe_forward_torch

        return moe_forward_torch(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.expert_offset)
