"""How the experts' weights are held and multiplied: the seam a quantization method plugs into.

`MoEMethod.create_weights` registers the layer's stacked parameters (and whatever scales a quantized format
needs, which `expert_scales` hands to the kernels); `apply` computes the routed experts' weighted sum for the
tokens. `FusedMoE` does the routing, sharding and reduction around it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.quantization.base import QuantizeMethodBase
from radixserve.layers.triton_ops import use_fused

if TYPE_CHECKING:
    from radixserve.layers.moe.layer import FusedMoE


@dataclass(frozen=True)
class ExpertScales:
    """The float32 scales of fp8 expert weights, one per (group_n rows x group_k columns) block of each expert's
    matrix: w13 [E, ceil(2I / group_n), ceil(H / group_k13)], w2 [E, ceil(H / group_n), ceil(I / group_k2)],
    contiguous. Per output channel: group_n 1 and group_k the whole row (H, I); block-wise checkpoints: their block.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    group_n: int
    group_k13: int
    group_k2: int


class MoEMethod(QuantizeMethodBase, ABC):
    """`process_weights_after_loading(layer)` (from QuantizeMethodBase) runs once all weights have loaded."""

    @abstractmethod
    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,  # type: ignore[override]
                       inter_size: int) -> None:
        """Register `w13_weight` [E, 2I, H] (gate rows then up rows; [E, I, H] for non-gated experts,
        `layer.activation.gated` False) and `w2_weight` [E, H, I] (or their quantized forms) on `layer`, each with
        `weight_loader = layer.weight_loader`."""

    def serves(self, layer: FusedMoE) -> bool:
        """Whether this method holds `layer`'s experts: by default SiLU experts without biases
        (`FusedMoE.plain_experts`); a method that takes other activations or biases says so."""
        return layer.plain_experts

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Called once after every weight is loaded (quantization.finish_quantization); quantized formats
        repack or quantize here. Weights in the model dtype need nothing."""
        return None

    def expert_scales(self, layer: FusedMoE) -> ExpertScales | None:
        """The scales the fused kernels widen `w13_weight` / `w2_weight` with; None for weights in the model
        dtype."""
        return None

    def activations_fp8(self, layer: FusedMoE) -> bool | None:
        """`fused_moe`'s act_fp8 for this layer (None: its default, W8A8 where the scales allow)."""
        return None

    def small_batch_tokens(self, layer: FusedMoE) -> int:
        """The most tokens a call sends through the small-batch kernels (more: the grouped GEMMs)."""
        from radixserve.layers.moe import small_batch

        return small_batch.SMALL_BATCH_TOKENS

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              ) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) over the experts this rank holds, through the
        layer's stacked `w13_weight` / `w2_weight` and `expert_scales`: the small-batch kernels for a few tokens
        and the grouped GEMMs for more on the GPU (the small-batch path also computes an attached shared MLP,
        `FusedMoE.folded_shared_weights`, SiLU experts without biases only; both paths take GPT-OSS's activation
        and biases and Nemotron 3's non-gated relu2 experts), the per-expert torch reference elsewhere."""
        scales = self.expert_scales(layer)
        act, bias = layer.activation, layer.expert_bias()
        if use_fused(x):
            from radixserve.layers.moe import small_batch

            if x.shape[0] <= self.small_batch_tokens(layer):
                shared = layer.folded_shared_weights(x)
                counters = layer.small_counters if layer.small_counters.device == x.device else None
                return small_batch.small_batch_moe(
                    x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.expert_offset,
                    *(shared[:2] if shared else (None, None)), counters=counters, scales=scales,
                    shared_scales=shared[2:] if shared and shared.s13 is not None else None, act=act, bias=bias)
            from radixserve.layers.moe.fused_moe import fused_moe

            return fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.expert_offset,
                             layer.num_experts, scales=scales, act_fp8=self.activations_fp8(layer), act=act,
                             bias=bias)
        from radixserve.layers.moe.moe_torch import moe_forward_torch

        return moe_forward_torch(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.expert_offset,
                                 scales, act=act, bias=bias)


class UnquantizedMoEMethod(MoEMethod):
    """Weights in the model dtype: every activation, with or without biases."""

    def serves(self, layer: FusedMoE) -> bool:
        return type(self) is UnquantizedMoEMethod or layer.plain_experts  # (subclasses: plain experts only)

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, inter_size: int) -> None:
        rows = layer.activation.w13_rows(inter_size)
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, rows, hidden_size), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter_size), requires_grad=False)
        layer.w13_weight.weight_loader = layer.weight_loader
        layer.w2_weight.weight_loader = layer.weight_loader
