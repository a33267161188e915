"""StarCoder2 (`Starcoder2ForCausalLM`: starcoder2-3b, -7b, -15b and their fine-tunes).

Llama's pre-norm layer (`models/ungated.py`: LayerNormDecoderLayer) with StarCoder2's differences:
- its norms are torch LayerNorms, each with a weight and a bias (`norm_epsilon`), the final one too;
- `use_bias` (on in the releases) puts a bias on q/k/v, on o_proj and on both MLP projections;
- the MLP is not gated: c_fc -> `hidden_act` (gelu_pytorch_tanh in the releases) -> c_proj, loaded as the
  UngatedMLP's up_proj / down_proj;
- every layer attends within `sliding_window` (4,096 in the releases), as transformers' mask does;
- the embeddings are tied by default (`tie_word_embeddings`, transformers' default True).
Neox rotary over the whole head (transformers' default rope ignores a `partial_rotary_factor`: one is refused), and
dropouts act in training only. GGUF files of the architecture are refused (`configs/model_config.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.ungated import QKV_STACKED, LayerNormModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_MLP_NAMES = ((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))


class Starcoder2ForCausalLM(LlamaForCausalLM):
    stacked_params = QKV_STACKED

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        if getattr(config, "tie_word_embeddings", None) is None:
            config.tie_word_embeddings = True  # transformers' StarCoder2 default
        super().__init__(config, tp_rank, tp_size)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        bias = bool(getattr(config, "use_bias", True))
        eps = float(getattr(config, "norm_epsilon", 1e-5))
        return LayerNormModel(config, tp_rank, tp_size, eps, qkv_bias=bias, o_bias=bias, mlp_bias=bias)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        for hf_part, ours in _MLP_NAMES:
            name = name.replace(hf_part, ours)
        return super().load_weight(params, name, tensor)
