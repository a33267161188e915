"""NanoChat (`NanoChatForCausalLM`: karpathy/nanochat-d20 / d32 and their conversions).

Llama's q/k/v and rotary around NanoChat's differences:
- every norm is an RMSNorm without a weight (llama4.WeightlessRMSNorm: no checkpoint tensor), and the embeddings
  are normed once before the first layer by the same norm as the final one;
- the rotation turns the other way (transformers' NanoChat rotate_half is (x2, -x1)): turning the pair (x1, x2) by
  -theta is our +theta turn of (x2, x1), so q and k rows swap the halves of each head at load (glm4.GlmLayout with
  that order, LoRA B included); q.k is unchanged by one order of both;
- q and k are RMS-normed per head *after* the rotation, so the K store follows the norm (the rotary kernel is
  given no KV write, and LlamaAttention's fused q/k/v + rotation paths are never taken: the layer calls this
  attention's own forward);
- the MLP is not gated: fc1 -> `hidden_act` (relu2 in the releases) -> fc2, unbiased (`models/ungated.py`'s
  UngatedMLP, fc1 / fc2 loaded as its up_proj / down_proj); `attention_bias` biases q/k/v and o_proj;
- the logits are soft-capped: cap * tanh(logits / cap), `final_logit_softcapping` (15 in the releases).
llama.cpp has no NanoChat architecture; the layer norms and projects itself, so no RMSNorm-fused path runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.logits_processor import LogitsProcessor
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.glm4 import GlmLayout
from radixserve.models.llama import LlamaAttention, LlamaForCausalLM, input_embedding, model_rotary
from radixserve.models.llama4 import WeightlessRMSNorm
from radixserve.models.ungated import QKV_STACKED, UngatedMLP, refuse_sliding_window

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

_MLP_NAMES = ((".mlp.fc1.", ".mlp.up_proj."), (".mlp.fc2.", ".mlp.down_proj."))


class NanoChatNorm(WeightlessRMSNorm):
    def prefetch_next(self, module: nn.Module | None) -> None:
        """RMSNorm's hook for its fused all-reduce, which never runs on this norm: nothing to prefetch."""


class NanoChatAttention(LlamaAttention):
    """q/k/v, the rotation, then the weightless per-head q/k norms; the attention backend stores K/V."""

    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, tp_rank, tp_size, rotary,
                         qkv_bias=bool(getattr(config, "attention_bias", False)))
        self.q_norm = NanoChatNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = NanoChatNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | None, forward_batch: ForwardBatch,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        if qkv is None:
            if hidden is None:
                raise ValueError("NanoChatAttention needs the hidden states or their q/k/v projection")
            qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)  # no KV write: k is stored after its norm
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return self._out(self.attn(q, k, v, forward_batch))


class NanoChatDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = NanoChatAttention(config, layer_id, tp_rank, tp_size, rotary)
        self.mlp = UngatedMLP(config.hidden_size, config.intermediate_size, False,
                              getattr(config, "hidden_act", None), tp_rank, tp_size)
        self.input_layernorm = NanoChatNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = NanoChatNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """hidden: the residual stream; returned with this layer's attention and MLP outputs added."""
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), forward_batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class NanoChatModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        rotary = model_rotary(config)
        self.layers = nn.ModuleList(NanoChatDecoderLayer(config, i, tp_rank, tp_size, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = NanoChatNorm(config.hidden_size, config.rms_norm_eps)  # before the layers and after them

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.norm(self.embed_tokens(input_ids))
        for layer in self.layers:
            hidden = layer(positions, hidden, forward_batch)
        return self.norm(hidden)


class NanoChatForCausalLM(GlmLayout, LlamaForCausalLM):
    stacked_params = QKV_STACKED

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        cap = getattr(config, "final_logit_softcapping", None)
        self.logits_processor = LogitsProcessor(config.vocab_size, None if cap is None else float(cap))
        if len(self.model.layers):  # q/k rows: each head's halves swapped (the rotation turning the other way)
            self.head_dim = self.model.layers[0].self_attn.head_dim
            half = self.head_dim // 2
            cpu = torch.device("cpu")  # (it indexes checkpoint tensors, whatever device the model is built on)
            self.dim_order = torch.cat([torch.arange(half, self.head_dim, device=cpu), torch.arange(half, device=cpu)])

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        refuse_sliding_window(config, "NanoChat")
        return NanoChatModel(config, tp_rank, tp_size)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        for theirs, ours in _MLP_NAMES:
            name = name.replace(theirs, ours)
        return super().load_weight(params, name, self._laid_out(name, tensor))
