"""FlexOlmo (`FlexOlmoForCausalLM`: allenai/FlexOlmo-7x7B-1T and its RT / a4 versions).

OLMo 2's layer (`models/olmo2.py`: no input norms, the attention's and the MLP's outputs RMS-normed before the
residual add; q and k RMS-normed over their whole projected width, the ranks all-reducing the sums of squares under
tensor parallelism) with OLMoE's sparse MoE block in place of the dense MLP (`models/olmoe.py`: a softmax over
`num_experts` (7) router logits, the top `num_experts_per_tok` (5), renormalised under `norm_topk_prob` (false in the
releases), no shared expert). Experts load one by one or stacked as OLMoE's. transformers' FlexOlmo attends over
the whole sequence: a `sliding_window` in the config is refused; llama.cpp has no FlexOlmo architecture."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.models.llama import check_hidden_act
from radixserve.models.olmo2 import OlmoModel
from radixserve.models.olmoe import load_stacked_experts, olmoe_mlp
from radixserve.models.qwen2_moe import MoECausalLM
from radixserve.models.ungated import refuse_sliding_window

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class FlexOlmoForCausalLM(MoECausalLM):
    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        refuse_sliding_window(config, "FlexOlmo")
        if not getattr(config, "num_experts", None):
            raise ValueError("FlexOlmoForCausalLM needs num_experts > 0 in its config")
        return OlmoModel(config, tp_rank, tp_size, olmo3=False, mlp_factory=olmoe_mlp)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        target = load_stacked_experts(params, name, tensor)
        return target if target is not None else super().load_weight(params, name, tensor)  # (+ per-expert)
