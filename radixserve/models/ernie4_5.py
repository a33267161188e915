"""Baidu ERNIE 4.5 (`Ernie4_5ForCausalLM`: ERNIE-4.5-0.3B) and ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`:
ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B, the text models): Llama's layer (pre-norms, GQA, SwiGLU) with

- rotary embedding over *interleaved* pairs (2i, 2i + 1) of the whole head (transformers' `rotate_half` there
  takes the even / odd dims): q and k rows are laid out per head at load in `glm4.rotary_order` (`GlmLayout`, the
  LoRA B rows included), so that our kernels' pairs (i, i + head_dim / 2) are the checkpoint's pairs;
- `use_bias`: a bias on q/k/v, o_proj and every MLP projection (shared experts too; never the routed experts);
- MoE layers where (layer + 1) % moe_layer_interval == 0 and moe_layer_start_index <= layer <= moe_layer_end_index
  (-1: the last layer), the others dense (intermediate_size). The router: softmax over the float32 logits, the
  top moe_k of softmax + `e_score_correction_bias` (stored as `mlp.moe_statics.e_score_correction_bias` [1, E])
  chosen, the chosen softmax scores as weights over max(their sum, moe_norm_min); plus moe_num_shared_experts
  shared experts as one MLP of moe_num_shared_experts * moe_intermediate_size, added unweighted.

The checkpoints' multi-token-prediction weights (`model.mtp_*`) serve speculative decoding only and are skipped,
as transformers does. A non-zero `lm_head.bias` (the MoE class with use_bias) is refused."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.linear import RowParallelLinear
from radixserve.layers.moe import FusedMoE, MoEGate, RouterConfig
from radixserve.models.deepseek_v2 import DeepseekMoE
from radixserve.models.glm4 import GlmLayout
from radixserve.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel, check_hidden_act, load_plain
from radixserve.models.qwen2_moe import MoECausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_MTP = re.compile(r"^(model\.)?mtp[_.]")
_CORRECTION = re.compile(r"^(.*\.mlp)\.(?:gate\.)?moe_statics\.e_score_correction_bias$")


def use_bias(config: PretrainedConfig) -> bool:
    return bool(getattr(config, "use_bias", False))


def _int_field(config: PretrainedConfig, key: str, default: int) -> int:
    """An integer MoE field; the multimodal models' per-modality lists are refused."""
    value = getattr(config, key, None)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ERNIE 4.5 config field {key} must be an integer (the text models'); got {value!r}")
    return value


def num_experts(config: PretrainedConfig) -> int:
    return _int_field(config, "moe_num_experts", 0)


def is_moe_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """transformers' rule: every moe_layer_interval-th layer from moe_layer_start_index to moe_layer_end_index
    (-1: the last layer), both included."""
    if num_experts(config) <= 0:
        return False
    interval = _int_field(config, "moe_layer_interval", 1)
    if interval < 1:
        raise ValueError(f"moe_layer_interval must be >= 1, got {interval}")
    start = _int_field(config, "moe_layer_start_index", 0)
    end = _int_field(config, "moe_layer_end_index", -1)
    end = config.num_hidden_layers - 1 if end == -1 else end
    return (layer_id + 1) % interval == 0 and start <= layer_id <= end


def ernie_dense_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    return LlamaMLP(config.hidden_size, config.intermediate_size, use_bias(config), tp_rank, tp_size)


class ErnieMoE(DeepseekMoE):
    """Router (softmax; the correction bias for the choice only; weights over max(sum, moe_norm_min)), routed experts
    and the shared experts, one all-reduce at the end: DeepseekMoE's forward with ERNIE's fields."""

    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        nn.Module.__init__(self)
        hidden, experts = config.hidden_size, num_experts(config)
        top_k = _int_field(config, "moe_k", 0)
        inter = _int_field(config, "moe_intermediate_size", 0)
        if inter <= 0:
            raise ValueError(f"ERNIE 4.5 MoE needs a positive moe_intermediate_size, got {inter}")
        norm_min = getattr(config, "moe_norm_min", None)
        norm_min = 1e-12 if norm_min is None else float(norm_min)
        self.tp_size = tp_size
        self.reduce_results = True
        router = RouterConfig(experts, top_k, "softmax", renormalize=True, renorm_min=norm_min)
        self.gate = MoEGate(hidden, experts, correction_bias=True)
        self.experts = FusedMoE(router, hidden, inter, tp_rank, tp_size, reduce_results=False)
        shared = _int_field(config, "moe_num_shared_experts", 0)
        if shared < 0:
            raise ValueError(f"moe_num_shared_experts must be >= 0, got {shared}")
        self.shared_experts = LlamaMLP(hidden, shared * inter, use_bias(config), tp_rank, tp_size,
                                       reduce_results=False) if shared else None
        if self.shared_experts is not None:  # small batches: in the experts' launches (where unbiased)
            self.experts.attach_shared_experts(self.shared_experts)


def ernie_moe_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    if is_moe_layer(config, layer_id):
        return ErnieMoE(config, tp_rank, tp_size)
    return ernie_dense_mlp(config, layer_id, tp_rank, tp_size)


def _biased_o_proj(attn: nn.Module, tp_rank: int, tp_size: int) -> None:
    """use_bias puts a bias on o_proj too (LlamaAttention gives it one only under attention_bias)."""
    old = attn.o_proj
    attn.o_proj = RowParallelLinear(old.weight.shape[1] * tp_size, old.weight.shape[0], True, tp_rank, tp_size,
                                    reduce_results=old.reduce_results)


class Ernie4_5ForCausalLM(GlmLayout, LlamaForCausalLM):
    interleaved_rotary = True
    mlp_factory = staticmethod(ernie_dense_mlp)

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        self._init_layout(self.model)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        model = LlamaModel(config, tp_rank, tp_size, qkv_bias=use_bias(config), mlp_factory=self.mlp_factory)
        if use_bias(config):
            for layer in model.layers:
                _biased_o_proj(layer.self_attn, tp_rank, tp_size)
        return model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, t) for name, t in weights if _MTP.match(name) is None)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if name == "lm_head.bias":
            if bool(tensor.any()):
                raise ValueError("lm_head.bias: a non-zero bias on the LM head (ERNIE 4.5 MoE with use_bias) is not "
                                 "supported")
            return None
        return super().load_weight(params, name, self._laid_out(name, tensor))


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM, MoECausalLM):  # noqa: N801 (transformers' class name)
    mlp_factory = staticmethod(ernie_moe_mlp)

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        if num_experts(config) <= 0:
            raise ValueError("Ernie4_5_MoeForCausalLM needs moe_num_experts > 0 in its config")
        super().__init__(config, tp_rank, tp_size)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        m = _CORRECTION.match(name)
        if m is not None:  # [1, E] in the checkpoint, [E] here; float32 as transformers keeps it
            target = f"{m.group(1)}.gate.e_score_correction_bias"
            if target not in params:
                raise ValueError(f"unexpected weight {name!r}: layer has no MoE router")
            load_plain(params[target], name, tensor.float().reshape(-1))
            return target
        return super().load_weight(params, name, tensor)
