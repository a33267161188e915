"""LG AI Research's EXAONE 4.0 (`Exaone4ForCausalLM`: EXAONE-4.0-32B, EXAONE-4.0-1.2B and their later releases):
Llama's q/k/v (GQA, no biases) and SiLU MLP, with

- OLMo 2's layer: no input norms, the attention's and the MLP's *outputs* are RMS-normed before their residual add
  (post_attention_layernorm, post_feedforward_layernorm): h + norm(attn(h)), then h + norm(mlp(h))
  (`olmo2.OlmoDecoderLayer`, given Llama's attention);
- Qwen3's per-head q/k RMSNorm (one weight of head_dim for every head) between the projection and the rotation:
  LlamaAttention's `qk_norm`, which on CUDA runs inside the rotary kernel (`QKNorm`) and keeps the fused one-token
  q/k/v + rotation off (no norm in it);
- hybrid attention (`layer_types`, from `sliding_window_pattern` in the config: three sliding layers of four in
  EXAONE-4.0-32B): the sliding layers attend over `sliding_window` tokens and rotate; the full-attention layers use
  no position embedding (NoPE: a table with rotary_dim 0, cos 1 and sin 0, that every kernel path serves
  unchanged). As transformers, a config without a `sliding_window` (EXAONE-4.0-1.2B) rotates every layer and
  slides none. The rotation takes the config's rope scaling (llama3 in the released models).

A partial rotation is refused (transformers' default EXAONE 4 rotary turns the whole head; its scaled ones would
read `partial_rotary_factor`), and so are GGUF files of the architecture (transformers' reader has no EXAONE 4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from radixserve.layers.layernorm import RMSNorm
from radixserve.models.cohere import layer_rotaries
from radixserve.models.llama import LlamaAttention, LlamaForCausalLM, check_hidden_act, input_embedding
from radixserve.models.olmo2 import OlmoDecoderLayer, OlmoModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Exaone4Model(OlmoModel):
    """OlmoModel's stack (embeddings, post-norm layers, final norm) with EXAONE's attention and rotary tables."""

    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        # the sliding layers rotate, the full ones do not; without a window every layer rotates
        rotaries = layer_rotaries(config, sliding_nope=True, rotate_without_window=True)
        for rotary in rotaries:
            if 0 < rotary.rotary_dim < rotary.head_dim:
                raise ValueError(f"Exaone4ForCausalLM does not support partial_rotary_factor (rotary_dim "
                                 f"{rotary.rotary_dim} of head_dim {rotary.head_dim})")
        self.layers = nn.ModuleList(
            OlmoDecoderLayer(config, i, tp_rank, tp_size, rotaries[i],
                             attention=LlamaAttention(config, i, tp_rank, tp_size, rotaries[i], qk_norm=True))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Exaone4ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        return Exaone4Model(config, tp_rank, tp_size)
