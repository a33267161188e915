"""dots.llm1 (`Dots1ForCausalLM`: dots.llm1.base, dots.llm1.inst; 142 B parameters, 14 B active): Qwen3's attention
(per-head q/k RMSNorm, in the rotary kernel on CUDA; `attention_bias` on all four projections; sliding layers from
`layer_types`) with DeepSeek-V3's MoE (`deepseek_v2.DeepseekMoE`):

- sigmoid router scores (float32 logits, as transformers keeps the gate in float32); the experts are chosen by
  scores + `e_score_correction_bias` within the `topk_group` best of `n_group` groups (each ranked by the sum of
  its two best corrected scores); the chosen uncorrected scores weigh them, renormalised when `norm_topk_prob`, times
  `routed_scaling_factor`;
- `n_shared_experts` shared experts (one MLP of n_shared_experts * moe_intermediate_size) added unweighted;
- the first `first_k_dense_replace` layers dense (`intermediate_size`).

Checkpoints store the experts one by one; transformers 5's in-memory stacked names load too. Config values
transformers' dots1 would not compute as they say (another `scoring_func`, `moe_layer_freq` other than 1, sliding
layers with `use_sliding_window` false) and GGUF files are refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.models.deepseek_v2 import DeepseekMoE
from radixserve.models.llama import LlamaMLP, load_plain
from radixserve.models.olmoe import load_stacked_experts
from radixserve.models.qwen2_moe import MoECausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _int(config: PretrainedConfig, key: str, low: int) -> int:
    value = getattr(config, key, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Dots1ForCausalLM needs {key} >= {low} (an integer) in its config; got {value!r}")
    return value


def check_config(config: PretrainedConfig) -> None:
    experts = _int(config, "n_routed_experts", 1)
    _int(config, "n_shared_experts", 0)
    _int(config, "first_k_dense_replace", 0)
    groups = _int(config, "n_group", 1)
    if experts % groups or experts // groups < 2:
        raise ValueError(f"n_group {groups} must split the {experts} experts into groups of at least 2 (each group "
                         f"is ranked by its two best scores)")
    scoring = getattr(config, "scoring_func", None)
    if scoring not in (None, "sigmoid"):
        raise ValueError(f"scoring_func {scoring!r} is not supported for dots.llm1 (its router is sigmoid)")
    freq = getattr(config, "moe_layer_freq", None)
    if freq not in (None, 1):
        raise ValueError(f"moe_layer_freq {freq!r} is not supported for dots.llm1 (every layer past "
                         f"first_k_dense_replace is sparse)")
    types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in types and getattr(config, "use_sliding_window", None) is False:
        raise ValueError("layer_types names sliding layers while use_sliding_window is false: transformers' dots1 "
                         "slides them; drop one of the two")
    scale = getattr(config, "routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"routed_scaling_factor must be a number; got {scale!r}")


def dots1_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    if layer_id < config.first_k_dense_replace:
        return LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size)
    return DeepseekMoE(config, tp_rank, tp_size, v3=True)


class Dots1ForCausalLM(MoECausalLM):
    qk_norm = True
    mlp_factory = staticmethod(dots1_mlp)

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        check_config(config)
        super().__init__(config, tp_rank, tp_size)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if name.endswith(".e_score_correction_bias"):  # [E], kept in float32 as transformers does
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for Dots1ForCausalLM")
            load_plain(params[name], name, tensor.float())
            return name
        target = load_stacked_experts(params, name, tensor)
        return target if target is not None else super().load_weight(params, name, tensor)  # (+ per-expert)
