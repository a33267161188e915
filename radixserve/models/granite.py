"""IBM Granite 3.x (`GraniteForCausalLM`): Llama's blocks with four multipliers, applied where transformers applies
them: the embeddings times `embedding_multiplier`, attention scores scaled by `attention_multiplier` (in place of
head_dim ** -0.5), each attention and MLP output times `residual_multiplier` before its residual add, the logits
divided by `logits_scaling`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from radixserve.layers.logits_processor import LogitsProcessor
from radixserve.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        self.logits_processor = LogitsProcessor(config.vocab_size,
                                                logits_scaling=float(getattr(config, "logits_scaling", 1.0)))

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        model = super().build_model(config, tp_rank, tp_size)
        model.embed_scale = float(getattr(config, "embedding_multiplier", 1.0))
        residual = float(getattr(config, "residual_multiplier", 1.0))
        scaling = getattr(config, "attention_multiplier", None)
        for layer in model.layers:
            layer.self_attn.output_scale = residual
            layer.mlp.output_scale = residual
            if scaling is not None:
                layer.self_attn.attn.scaling = float(scaling)
        return model
