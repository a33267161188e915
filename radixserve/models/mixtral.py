"""Mixtral: Mistral attention with a sparse MoE block in every layer (softmax over the experts, top-k renormalised
to sum to 1). Hugging Face names the block `block_sparse_moe` and the experts' matrices w1 (gate), w3 (up) and w2
(down); here the block is `mlp` like every other family's feed-forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.models.qwen2_moe import MoECausalLM, SparseMoeBlock

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def mixtral_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    return SparseMoeBlock(config, tp_rank, tp_size, renormalize=True)


class MixtralForCausalLM(MoECausalLM):
    mlp_factory = staticmethod(mixtral_mlp)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        return super().load_weight(params, name.replace(".block_sparse_moe.", ".mlp."), tensor)
