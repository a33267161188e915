"""Qwen3-MoE: the Qwen3 attention (per-head q/k RMSNorm) with sparse MoE blocks (softmax top-k, renormalised when
`norm_topk_prob`), no shared expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from radixserve.models.llama import LlamaMLP
from radixserve.models.qwen2_moe import MoECausalLM, SparseMoeBlock, is_sparse_layer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def qwen3_moe_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    if not is_sparse_layer(config, layer_id):
        return LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size)
    return SparseMoeBlock(config, tp_rank, tp_size, bool(getattr(config, "norm_topk_prob", False)))


class Qwen3MoeForCausalLM(MoECausalLM):
    qk_norm = True
    decode_gemv_attention = True  # 30B-A3B: qkv 21 MB, o_proj 17 MB
    mlp_factory = staticmethod(qwen3_moe_mlp)
