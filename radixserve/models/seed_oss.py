"""ByteDance Seed-OSS (`SeedOssForCausalLM`: Seed-OSS-36B-Base, Seed-OSS-36B-Instruct): Llama's layer (pre-norms,
GQA, SiLU MLP, neox rotary over the whole head) with its own bias flags and an explicit head_dim (128, so 80 heads
project 5,120 wide to 10,240):

- `attention_bias`: a bias on q/k/v (on by default and in the releases);
- `attention_out_bias`: a bias on o_proj, its own flag (off by default and in the releases; Llama's attention_bias
  would put one there too);
- `mlp_bias`: biases on gate/up/down (off in the releases).

Its attention and residual dropouts act in training only. transformers' Seed-OSS rotates the whole head and slides
no window: a partial_rotary_factor or a sliding_window in the config is refused rather than served differently."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from radixserve.layers.linear import RowParallelLinear
from radixserve.models.llama import LlamaForCausalLM, LlamaModel, check_hidden_act

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _o_proj_bias(attn: nn.Module, bias: bool, tp_rank: int, tp_size: int) -> None:
    """Give o_proj a bias exactly when `attention_out_bias` says (LlamaAttention follows attention_bias)."""
    old = attn.o_proj
    if (old.bias is not None) == bias:
        return
    attn.o_proj = RowParallelLinear(old.weight.shape[1] * tp_size, old.weight.shape[0], bias, tp_rank, tp_size,
                                    reduce_results=old.reduce_results)


class SeedOssForCausalLM(LlamaForCausalLM):
    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        if getattr(config, "sliding_window", None):
            raise ValueError("sliding_window is not supported for Seed-OSS (its attention is full in every layer)")
        qkv_bias = bool(getattr(config, "attention_bias", True))
        model = LlamaModel(config, tp_rank, tp_size, qkv_bias=qkv_bias, mlp_factory=self.mlp_factory)
        out_bias = bool(getattr(config, "attention_out_bias", False))
        for layer in model.layers:
            _o_proj_bias(layer.self_attn, out_bias, tp_rank, tp_size)
        return model
