"""Apertus (`ApertusForCausalLM`: Swiss AI's Apertus-8B / 70B, base and Instruct-2509).

Llama's RMSNorm layer (LlamaDecoderLayer and LlamaModel) with Apertus's differences:
- the MLP is not gated: up_proj -> xIELU -> down_proj, no biases (`models/ungated.py`: UngatedMLP). xIELU
  (`layers/activation.XIELU`) has two learned scalars a layer (`mlp.act_fn.alpha_p` / `alpha_n`, whole on every TP
  rank) and two constants the checkpoints store too (`beta`, `eps`: read at load). Another `hidden_act` is taken by
  name where the ungated MLPs know it (transformers applies the config's), else refused;
- q and k are RMS-normed per head before the rotation (Qwen3's: LlamaAttention's qk_norm, fused into the rotary
  kernel on CUDA); `attention_bias` biases q/k/v and o_proj as Llama's;
- its norms are named `attention_layernorm` / `feedforward_layernorm` (Llama's input_layernorm /
  post_attention_layernorm: renamed at load);
- Llama 3 rope scaling (factor 8 over 8,192 original positions in the releases), the rotary module's.
transformers' Apertus attends over the whole sequence: a `sliding_window` in the config is refused, and so are GGUF
files of the architecture (`configs/model_config.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.activation import XIELU
from radixserve.models.llama import LlamaForCausalLM, LlamaModel
from radixserve.models.ungated import QKV_STACKED, UngatedMLP, refuse_sliding_window

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_NORM_NAMES = ((".attention_layernorm.", ".input_layernorm."),
               (".feedforward_layernorm.", ".post_attention_layernorm."))
_XIELU_CONSTANTS = (".act_fn.beta", ".act_fn.eps")


def apertus_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    """An MLPFactory (models/llama.py): up -> the config's activation (xIELU in the releases) -> down, unbiased."""
    act = getattr(config, "hidden_act", None)
    return UngatedMLP(config.hidden_size, config.intermediate_size, False, act, tp_rank, tp_size,
                      act_fn=XIELU() if act == "xielu" else None)


class ApertusForCausalLM(LlamaForCausalLM):
    stacked_params = QKV_STACKED
    qk_norm = True

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        refuse_sliding_window(config, "Apertus")
        return LlamaModel(config, tp_rank, tp_size, bool(getattr(config, "attention_bias", False)), self.qk_norm,
                          mlp_factory=apertus_mlp)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if name.endswith(_XIELU_CONSTANTS):
            owner, leaf = name.rsplit(".", 1)
            act = self.get_submodule(owner)
            if not isinstance(act, XIELU):
                raise ValueError(f"weight {name!r}: this layer's activation is not xIELU")
            act.set_constant(leaf, tensor)
            return None
        for theirs, ours in _NORM_NAMES:
            name = name.replace(theirs, ours)
        return super().load_weight(params, name, tensor)
