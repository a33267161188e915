"""StableLM 2 and StableLM-3B-4E1T (`StableLmForCausalLM`: stablelm-2-1_6b / 12b and their chat versions,
stablelm-3b-4e1t, stable-code-3b).

Phi's LayerNorm stack (`models/phi.py`) with StableLM's choices:
- biased LayerNorms (`layer_norm_eps`) before the attention and the MLP, sequential, or one norm feeding both in
  parallel under `use_parallel_residual` (StableLM 2 12B; its partial sums all-reduced once under TP);
- the gated SiLU MLP (Llama's, unbiased); `use_qkv_bias` biases q/k/v (o_proj never is);
- partial rotation, `partial_rotary_factor` (0.25) of each head, laid out per head at load as Phi's;
- `qk_layernorm` (StableLM 2 12B) norms each q and k head with its own bias-free LayerNorm
  (`q_layernorm.norms.<h>.weight`: one row each of cohere.HeadNorm's per-head weight, this rank's heads kept).
Embeddings are untied unless the config ties them. GGUF files of the architecture are refused
(`configs/model_config.py`)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.cohere import HeadNorm
from radixserve.models.llama import LlamaForCausalLM, LlamaMLP, check_hidden_act
from radixserve.models.phi import LayerNormDecoderLayer, LayerNormStack, NormedQKAttention, PartialRotaryCausalLM
from radixserve.models.ungated import refuse_sliding_window

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_HEAD_NORM = re.compile(r"(.*\.self_attn\.)([qk])_layernorm\.norms\.(\d+)\.weight$")


def stablelm_layer(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                   rotary: RotaryEmbedding) -> nn.Module:
    eps = float(config.layer_norm_eps)
    attn = NormedQKAttention(config, layer_id, tp_rank, tp_size, rotary,
                             qkv_bias=bool(getattr(config, "use_qkv_bias", False)), o_bias=False)
    if getattr(config, "qk_layernorm", False):
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        kv_rank = tp_rank // attn.qkv_proj.kv_replicas
        attn.q_norm = HeadNorm(attn.num_heads, attn.head_dim, eps, tp_rank * attn.num_heads, heads)
        attn.k_norm = HeadNorm(attn.num_kv_heads, attn.head_dim, eps, kv_rank * attn.num_kv_heads, kv_heads)
    mlp = LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size)
    return LayerNormDecoderLayer(config, attn, mlp, eps, bool(getattr(config, "use_parallel_residual", False)),
                                 tp_size)


class StableLmForCausalLM(PartialRotaryCausalLM):
    stacked_params = LlamaForCausalLM.stacked_params  # q/k/v, and gate/up of its gated MLP

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        refuse_sliding_window(config, "StableLM")
        return LayerNormStack(config, tp_rank, tp_size, float(config.layer_norm_eps), stablelm_layer)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        match = _HEAD_NORM.match(name)
        if match is None:
            return super().load_weight(params, name, tensor)
        target = f"{match[1]}{match[2]}_norm.weight"  # one head's row of the per-head weight
        if target not in params:
            raise ValueError(f"unexpected weight {name!r}: qk_layernorm is off in the config")
        norm = self.get_submodule(target.rsplit(".", 1)[0])
        head, row = int(match[3]), int(match[3]) - norm.first_head
        if tensor.shape != (self.head_dim,) or head >= norm.total_heads:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} for head {head}; expected ({self.head_dim},) "
                             f"for one of {norm.total_heads} heads")
        if 0 <= row < params[target].shape[0]:  # this rank's heads only
            params[target].data[row].copy_(tensor if self.dim_order is None else tensor[self.dim_order])
        return target
