"""IBM Granite 4.0's hybrid models (`GraniteMoeHybridForCausalLM`, model_type `granitemoehybrid`): Mamba2 layers
(`layers/mamba2.py`: a recurrent state per request) beside attention layers, as `layer_types` (or the released
configs' `layers_block_type`) says ("mamba" / "attention", which transformers 5 renames "linear_attention" /
"full_attention"). Only the attention layers hold KV: they take attention layer ids 0, 1, .. (`ModelConfig.
kv_layer_count`).

Granite's multipliers as in `granitemoe.py` (embeddings times `embedding_multiplier`, attention scores scaled by
`attention_multiplier`, each mixer and feed-forward output times `residual_multiplier`, logits divided by
`logits_scaling`). The attention layers rotate q and k only where `position_embedding_type` is "rope" (the released
models use none). The feed-forward block is `shared_mlp` (`shared_intermediate_size`), plus the routed experts of
`block_sparse_moe` where `num_local_experts` > 0 (the MoE variants; 0: the dense ones): GraniteMoeShared's block.

Serving constraints are the hybrid models' (`configs/hybrid.py`). Tensor parallelism splits the Mamba2 layers'
heads and groups (`layers/mamba2.py`), the attention heads and the feed-forward blocks as elsewhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.configs.hybrid import linear_attention_layers
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.mamba2 import Mamba2Mixer
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.granitemoe import GraniteMoeBlock, GraniteMoeForCausalLM, _shared_size
from radixserve.models.llama import (
    LlamaAttention,
    LlamaMLP,
    check_hidden_act,
    input_embedding,
    load_plain,
    model_rotary,
)
from radixserve.models.recurrent_state import RecurrentStates

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

_MAMBA = ".mamba."
_MAMBA_NAMES = {"conv1d.weight": "conv_weight", "conv1d.bias": "conv_bias", "norm.weight": "norm_weight"}


class GraniteHybridAttention(LlamaAttention):
    """Llama's attention with Granite's score scale; the rotation only where the model has one."""

    def __init__(self, config: PretrainedConfig, kv_layer_id: int, rotary: RotaryEmbedding | None, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        scaling = getattr(config, "attention_multiplier", None)
        super().__init__(config, kv_layer_id, tp_rank, tp_size, rotary,
                         qkv_bias=bool(getattr(config, "attention_bias", False)),
                         scaling=None if scaling is None else float(scaling))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self._out(self.attn(q, k, v, forward_batch))


class GraniteSharedMLP(nn.Module):
    """The dense variants' feed-forward block: the shared MLP alone (named as in the MoE block, for the loader)."""

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.shared_expert = LlamaMLP(config.hidden_size, _shared_size(config), False, tp_rank, tp_size)

    @property
    def output_scale(self) -> float:
        return self.shared_expert.output_scale

    @output_scale.setter
    def output_scale(self, value: float) -> None:
        self.shared_expert.output_scale = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x)


class GraniteHybridDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, kv_layer_id: int | None, rotary: RotaryEmbedding | None,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if kv_layer_id is None:
            self.mamba = Mamba2Mixer(config, tp_rank=tp_rank, tp_size=tp_size)
        else:
            self.self_attn = GraniteHybridAttention(config, kv_layer_id, rotary, tp_rank, tp_size)
        if (getattr(config, "num_local_experts", 0) or 0) > 0:
            self.mlp = GraniteMoeBlock(config, tp_rank, tp_size, shared_size=_shared_size(config))
        else:
            self.mlp = GraniteSharedMLP(config, tp_rank, tp_size)
        self.residual_scale = float(getattr(config, "residual_multiplier", 1.0))
        self.mlp.output_scale = self.residual_scale
        if hasattr(self, "self_attn"):
            self.self_attn.output_scale = self.residual_scale
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if hasattr(self, "mamba"):
            hidden = self.mamba(hidden, forward_batch)
            if self.residual_scale != 1.0:
                hidden = hidden * self.residual_scale
        else:
            hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class GraniteHybridModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        self.embed_scale = float(getattr(config, "embedding_multiplier", 1.0))
        kind = getattr(config, "position_embedding_type", None)
        if kind not in (None, "nope", "rope"):
            raise ValueError(f"GraniteMoeHybrid: position_embedding_type {kind!r} is not supported (rope or none)")
        rotary = model_rotary(config) if kind == "rope" else None
        recurrent = set(linear_attention_layers(config))
        kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
        if not kinds or len(kinds) != config.num_hidden_layers:
            raise ValueError("GraniteMoeHybrid: the config must list each layer's kind (layer_types or "
                             "layers_block_type, one per hidden layer)")
        attention = [i for i in range(config.num_hidden_layers) if i not in recurrent]
        kv_ids = {layer: i for i, layer in enumerate(attention)}
        self.layers = nn.ModuleList(GraniteHybridDecoderLayer(config, kv_ids.get(i), rotary, tp_rank, tp_size)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale != 1.0:
            hidden = hidden * self.embed_scale
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def mixers(self) -> list[Mamba2Mixer]:
        return [layer.mamba for layer in self.layers if hasattr(layer, "mamba")]


class GraniteMoeHybridForCausalLM(RecurrentStates, GraniteMoeForCausalLM):
    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        return GraniteHybridModel(config, tp_rank, tp_size)

    def state_layers(self) -> list:  # (RecurrentStates: what ModelRunner sizes and allocates)
        return self.model.mixers()

    # ------------------------------------------------------------------ weights
    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if _MAMBA not in name:
            return super().load_weight(params, name, tensor)
        prefix, leaf = name.split(_MAMBA, 1)
        target = f"{prefix}{_MAMBA}{_MAMBA_NAMES.get(leaf, leaf)}"
        if target not in params:
            raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
        if leaf == "conv1d.weight":  # [C, 1, K] -> [C, K]
            tensor = tensor.reshape(tensor.shape[0], -1)
        load_plain(params[target], name, tensor)
        return target
