"""SmolLM3 (`SmolLM3ForCausalLM`): Llama's blocks, where the layers that `no_rope_layers` marks 0 (every fourth by
default) use no position embedding. Those layers share a rotary table that turns nothing (rotary_dim 0: cos 1,
sin 0), so every kernel path, fused or not, serves them unchanged."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.llama import LlamaForCausalLM, attention_head_dim

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        model = super().build_model(config, tp_rank, tp_size)
        flags = list(getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers)
        if len(flags) != config.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for {config.num_hidden_layers} layers")
        if not all(flags):
            nope = RotaryEmbedding(attention_head_dim(config), config.max_position_embeddings, 10000.0, rotary_dim=0)
            for layer, use_rope in zip(model.layers, flags, strict=True):
                if not use_rope:
                    layer.self_attn.rotary_emb = nope
        return model
