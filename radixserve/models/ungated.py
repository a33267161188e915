"""Blocks shared by the families whose MLP is not gated (up -> activation -> down): StarCoder2, Nemotron, Arcee.

- `UngatedMLP`: up_proj (column-parallel) -> the config's `hidden_act` (`layers.activation.ACTIVATIONS`:
  gelu_pytorch_tanh, gelu, relu2, silu; others refused) -> down_proj (row-parallel), biases optional.
- `LayerNormDecoderLayer` / `LayerNormModel`: Llama's pre-norm layer and stack with LayerNorms (a weight and a
  bias) in place of the RMSNorms (StarCoder2, Nemotron). The layer is its own, not LlamaDecoderLayer: that one's
  fused paths (the residual add and the RMSNorm inside the one-row GEMV, inside a quantization method's product, or
  inside the custom all-reduce) compute an RMSNorm and would be wrong here. Under tensor parallelism o_proj and
  down_proj all-reduce their own outputs. The attention is LlamaAttention, whose own fused paths (q/k/v with the
  rotation and the KV store in one launch) take the biases and the neox rotation these families use.

Arcee keeps Llama's RMSNorm layer (LlamaDecoderLayer) with an UngatedMLP: the layer's MLP-fused paths are for
LlamaMLP only, so they are not taken for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.activation import activation_fn
from radixserve.layers.layernorm import LayerNorm
from radixserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.llama import LlamaAttention, input_embedding, model_rotary

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

# the only stacked projection of these families (their MLP has no gate to stack with up)
QKV_STACKED = [("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v")]


class UngatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, hidden_act: str | None, tp_rank: int,
                 tp_size: int, act_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 reduce_results: bool = True) -> None:
        """act_fn: the activation where it is not one of `ACTIVATIONS` by name (Apertus's xIELU, a module with
        learned parameters); hidden_act is then not looked up. reduce_results False: each rank returns its partial
        sum (Nemotron 3's shared expert, reduced with the routed experts' sums)."""
        super().__init__()
        # (first: an unsupported activation refused before any weight)
        self.act_fn = act_fn if act_fn is not None else activation_fn(hidden_act)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp_rank, tp_size, reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


def ungated_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    """An MLPFactory (models/llama.py) for an RMSNorm Llama layer with an ungated MLP (Arcee): `mlp_bias` on both."""
    return UngatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                      getattr(config, "hidden_act", None), tp_rank, tp_size)


class PreNormForward:
    """The plain pre-norm layer's forward, for a layer whose norms take RMSNorm's (x, residual) convention but that
    must not take LlamaDecoderLayer's RMSNorm-fused paths (LayerNorm layers: StarCoder2, Nemotron, DBRX,
    Phi-3.5-MoE): h + attn(norm1(h)), then + mlp(norm2(.))."""

    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    self_attn: nn.Module
    mlp: nn.Module

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's MLP output, not yet added to `residual` (None at the first layer)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LayerNormDecoderLayer(PreNormForward, nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 eps: float, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp_rank, tp_size, rotary, qkv_bias=qkv_bias, o_bias=o_bias)
        self.mlp = UngatedMLP(config.hidden_size, config.intermediate_size, mlp_bias,
                              getattr(config, "hidden_act", None), tp_rank, tp_size)
        self.input_layernorm = LayerNorm(config.hidden_size, eps, bias=True)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps, bias=True)


class LayerNormModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, eps: float, qkv_bias: bool,
                 o_bias: bool, mlp_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        rotary = model_rotary(config)
        self.layers = nn.ModuleList(LayerNormDecoderLayer(config, i, tp_rank, tp_size, rotary, eps, qkv_bias, o_bias,
                                                          mlp_bias)
                                    for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, eps, bias=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        if residual is None:  # (no layers)
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def refuse_sliding_window(config: PretrainedConfig, family: str) -> None:
    """transformers' Nemotron and Arcee attend causally over the whole sequence whatever the config says: a
    `sliding_window` there is refused rather than served as a window (our attention would slide it)."""
    if getattr(config, "sliding_window", None):
        raise ValueError(f"sliding_window is not supported for {family} (its attention is full in every layer)")
