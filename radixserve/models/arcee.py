"""Arcee (`ArceeForCausalLM`: AFM-4.5B and its base model).

Llama's layer (RMSNorms, LlamaDecoderLayer and LlamaModel) with an ungated MLP (`models/ungated.py`: up_proj ->
`hidden_act`, relu2 in the release -> down_proj, biased under `mlp_bias`); `attention_bias` biases q/k/v and
o_proj as Llama's. The release's YaRN rope scaling (factor 20 over 4,096 original positions) is the rotary
module's. transformers' Arcee attends over the whole sequence: a `sliding_window` in the config is refused, and so
are GGUF files of the architecture (`configs/model_config.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from radixserve.models.llama import LlamaForCausalLM, LlamaModel, MLPFactory
from radixserve.models.ungated import QKV_STACKED, refuse_sliding_window, ungated_mlp

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class ArceeForCausalLM(LlamaForCausalLM):
    stacked_params = QKV_STACKED
    mlp_factory: MLPFactory = staticmethod(ungated_mlp)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        refuse_sliding_window(config, "Arcee")
        return LlamaModel(config, tp_rank, tp_size, bool(getattr(config, "attention_bias", False)),
                          mlp_factory=self.mlp_factory)
