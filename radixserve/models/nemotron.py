"""Nemotron (`NemotronForCausalLM`: Minitron-4B / 8B, Nemotron-Mini-4B, Nemotron-4-340B and their conversions).

Llama's pre-norm layer (`models/ungated.py`: LayerNormDecoderLayer) with Nemotron's differences:
- its norms are NemotronLayerNorm1P: a LayerNorm with a bias whose scale is (1 + weight) (`norm_eps`). The
  checkpoint's weights get 1 added at load (as Gemma's), so the plain biased LayerNorm serves them; dummy weights
  then draw the scale itself (near 1);
- the MLP is not gated: up_proj -> `hidden_act` (relu2: relu(x) ** 2) -> down_proj, biased under `mlp_bias`;
- `attention_bias` puts a bias on q/k/v and o_proj;
- partial rotation: `partial_rotary_factor` (0.5, transformers' default for Nemotron) of each head is turned, neox
  pairs (i, i + rotary_dim / 2) of its first rotary_dim dims; q and k rows are laid out per head at load
  (`rotary_embedding.partial_rotary_order`, through glm4.GlmLayout, LoRA B included) so our kernels turn them;
- an explicit `head_dim` (Minitron-8B: 48 heads of 128 over a 4,096-wide model); untied embeddings by default.
transformers' Nemotron attends over the whole sequence: a `sliding_window` in the config is refused. GGUF files of
the architecture are refused (llama.cpp folds the + 1 into its norm weights; this loader does not map them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.models.glm4 import GlmLayout
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.ungated import QKV_STACKED, LayerNormModel, refuse_sliding_window

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class NemotronForCausalLM(GlmLayout, LlamaForCausalLM):
    partial_rotary = True
    interleaved_rotary = False
    stacked_params = QKV_STACKED

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        self._init_layout(self.model)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        refuse_sliding_window(config, "Nemotron")
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LayerNormModel(config, tp_rank, tp_size, float(getattr(config, "norm_eps", 1e-5)),
                              qkv_bias=attention_bias, o_bias=attention_bias,
                              mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if name.endswith("norm.weight"):  # NemotronLayerNorm1P scales by (1 + weight)
            tensor = tensor.float() + 1.0
        return super().load_weight(params, name, self._laid_out(name, tensor))
