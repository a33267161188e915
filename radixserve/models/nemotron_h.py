"""NVIDIA Nemotron-H's hybrid models (`NemotronHForCausalLM`, model_type `nemotron_h`: Nemotron-H 8B / 47B,
NVIDIA-Nemotron-Nano-9B-v2 / 12B-v2).

Each layer is one block, h + mixer(RMSNorm(h)), whose mixer is one of (the config's `hybrid_override_pattern`, or
`layers_block_type` as transformers 5 keeps it, `configs/hybrid.py` layer_kinds):
- "M": Mamba2 (`layers/mamba2.py`, NEMOTRON_H's config names: inner width `mamba_num_heads` x `mamba_head_dim`,
  the gated RMSNorm in `n_groups` groups after the SiLU gate): a recurrent state per request;
- "*": attention without any rotation (no position embedding at all), no biases;
- "-": a non-gated MLP, up_proj -> `mlp_hidden_act` (relu2: relu(x) ** 2) -> down_proj;
- "E" (MoE, Nemotron 3) is refused.
Only the "*" layers hold KV: they take attention layer ids 0, 1, .. (`ModelConfig.kv_layer_count`). The checkpoint's
names are `backbone.embeddings`, `backbone.layers.N.norm` / `.mixer.*`, `backbone.norm_f`, `lm_head` (untied by
default). Serving constraints are the hybrid models' (`configs/hybrid.py`). Tensor parallelism splits the Mamba2
layers' heads and groups (`layers/mamba2.py`), the attention heads and the MLPs' intermediate width."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.configs.hybrid import layer_kinds
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.mamba2 import NEMOTRON_H, Mamba2Mixer
from radixserve.models.llama import LlamaAttention, LlamaForCausalLM, input_embedding, load_plain
from radixserve.models.recurrent_state import RecurrentStates
from radixserve.models.ungated import QKV_STACKED, UngatedMLP

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

# a layer kind as the configs spell it -> its pattern letter
_LETTERS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}
_MAMBA_NAMES = {"conv1d.weight": "conv_weight", "conv1d.bias": "conv_bias", "norm.weight": "norm_weight"}


def layer_pattern(config: PretrainedConfig) -> str:
    """The config's layers as pattern letters (M, *, -, E); ValueError for a kind this model does not serve."""
    kinds = layer_kinds(config)
    if not kinds:
        raise ValueError("NemotronH: the config must list its layers (hybrid_override_pattern or layers_block_type)")
    letters = []
    for kind in kinds:
        letter = _LETTERS.get(kind)
        if letter is None:
            raise ValueError(f"NemotronH: layer kind {kind!r} is not supported (M, *, -)")
        if letter == "E":
            raise ValueError("NemotronH: MoE layers (pattern letter 'E', layer kind 'moe') are not supported")
        letters.append(letter)
    return "".join(letters)


class NemotronHAttention(LlamaAttention):
    """Attention of q, k, v as projected: no rotation, no bias (transformers' NemotronHAttention has none)."""

    def __init__(self, config: PretrainedConfig, kv_layer_id: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, kv_layer_id, tp_rank, tp_size, None, qkv_bias=False, o_bias=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self._out(self.attn(q, k, v, forward_batch))


class NemotronHBlock(nn.Module):
    """One layer: its norm, then its mixer (Mamba2, attention or MLP by `letter`), added to the residual stream."""

    def __init__(self, config: PretrainedConfig, letter: str, kv_layer_id: int | None, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        self.letter = letter
        self.norm = RMSNorm(config.hidden_size, float(config.layer_norm_epsilon))
        if letter == "M":
            self.mixer: nn.Module = Mamba2Mixer(config, NEMOTRON_H, tp_rank, tp_size)
        elif letter == "*":
            if kv_layer_id is None:
                raise ValueError("NemotronH: an attention layer needs a KV layer id")
            self.mixer = NemotronHAttention(config, kv_layer_id, tp_rank, tp_size)
        else:
            self.mixer = UngatedMLP(config.hidden_size, config.intermediate_size,
                                    bool(getattr(config, "mlp_bias", False)),
                                    getattr(config, "mlp_hidden_act", None) or "relu2", tp_rank, tp_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's mixer output, the residual stream before it): the next layer's norm adds the two."""
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        if self.letter == "M":
            return self.mixer(hidden, forward_batch), residual
        if self.letter == "*":
            return self.mixer(positions, hidden, forward_batch), residual
        return self.mixer(hidden), residual


class NemotronHModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        pattern = layer_pattern(config)
        if len(pattern) != config.num_hidden_layers:
            raise ValueError(f"NemotronH: the layer pattern {pattern!r} has {len(pattern)} layers, "
                             f"num_hidden_layers {config.num_hidden_layers}")
        if getattr(config, "sliding_window", None):
            raise ValueError("NemotronH: sliding_window is not supported (its attention layers see every token)")
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        kv_ids = {layer: i for i, layer in enumerate(i for i, letter in enumerate(pattern) if letter == "*")}
        self.layers = nn.ModuleList(NemotronHBlock(config, letter, kv_ids.get(i), tp_rank, tp_size)
                                    for i, letter in enumerate(pattern))
        self.norm = RMSNorm(config.hidden_size, float(config.layer_norm_epsilon))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def mixers(self) -> list[Mamba2Mixer]:
        return [layer.mixer for layer in self.layers if layer.letter == "M"]


class NemotronHForCausalLM(RecurrentStates, LlamaForCausalLM):
    stacked_params = QKV_STACKED  # (the MLP's up_proj is its own weight, not half of a gate_up)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        return NemotronHModel(config, tp_rank, tp_size)

    def state_layers(self) -> list:  # (RecurrentStates: what ModelRunner sizes and allocates)
        return self.model.mixers()

    # ------------------------------------------------------------------ weights
    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if name.startswith("mtp."):  # multi-token prediction layers (Nemotron 3): not served
            return None
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        name = name.replace("model.embeddings.", "model.embed_tokens.").replace("model.norm_f.", "model.norm.")
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "mixer" and parts[2].isdigit():
            layer = self.model.layers[int(parts[2])]
            leaf = ".".join(parts[4:])
            if layer.letter == "M":
                target = ".".join(parts[:4] + [_MAMBA_NAMES.get(leaf, leaf)])
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
                if leaf == "conv1d.weight":  # [C, 1, K] -> [C, K]
                    tensor = tensor.reshape(tensor.shape[0], -1)
                load_plain(params[target], name, tensor)
                return target
        return super().load_weight(params, name, tensor)
