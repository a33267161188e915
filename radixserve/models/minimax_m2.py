"""MiniMax-M2 (`MiniMaxM2ForCausalLM`: MiniMax-M2, MiniMax-M2.1): Llama's pre-norm layer (GQA, SiLU experts) with

- q and k RMS-normed over their whole projected width (num_heads * head_dim, num_kv_heads * head_dim), not per
  head: OLMo's norm (`olmo2.OlmoAttention`: under tensor parallelism the ranks all-reduce the sums of squares), with
  no biases on any projection;
- partial rotation: the first `rotary_dim` (64 of 128) dims of each head, neox halves (i, i + rotary_dim / 2).
  Our kernels rotate (i, i + head_dim / 2) with the frequencies past rotary_dim / 2 zero, so q/k rows (the q/k
  norm weights too) are laid out per head at load (`glm4.GlmLayout`); the whole-width norm does not see the order;
- a sparse MoE block in every layer (`block_sparse_moe`, experts w1 / w3 / w2 = gate / up / down): sigmoid
  scores, the top `num_experts_per_tok` of scores + `e_score_correction_bias` chosen, the chosen uncorrected scores
  renormalised to sum to 1 as their weights; no shared expert, no scaling factor.

The released checkpoints' multi-token-prediction modules (`num_mtp_modules`, stored as layers num_hidden_layers
on) serve speculative decoding only and are skipped at load, as transformers does. Config values transformers'
MiniMax-M2 does not implement (softmax scoring, per-head or no q/k norm, shared experts, lightning-attention
layers, a sliding window, a routed scaling factor) are refused rather than served as another model."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import custom_all_reduce_fuses_norm
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.moe import FusedMoE, MoEGate, RouterConfig
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.glm4 import Glm4Model, GlmLayout, unbiased_o_proj
from radixserve.models.llama import LlamaDecoderLayer, attention_head_dim, check_hidden_act, load_plain, model_rotary
from radixserve.models.olmo2 import OlmoAttention
from radixserve.models.qwen2_moe import MoECausalLM, SparseMoeBlock

if TYPE_CHECKING:
    from transformers import PretrainedConfig


logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP = re.compile(r"^(model\.)?mtp[_.]")
_CORRECTION = re.compile(r"^(.*)\.(?:block_sparse_moe|mlp)(?:\.gate)?\.e_score_correction_bias$")


def num_experts(config: PretrainedConfig) -> int:
    value = getattr(config, "num_local_experts", None) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"MiniMaxM2ForCausalLM needs num_local_experts > 0 in its config; got {value!r}")
    return value


def uses_routing_bias(config: PretrainedConfig) -> bool:
    """The released configs set use_routing_bias; transformers always holds the bias (zeros when absent)."""
    return getattr(config, "use_routing_bias", None) is not False


def check_config(config: PretrainedConfig) -> None:
    """Refuse the config values whose model transformers' MiniMax-M2 would not compute as the checkpoint means."""
    check_hidden_act(config)
    num_experts(config)
    scoring = getattr(config, "scoring_func", None)
    if scoring not in (None, "sigmoid"):
        raise ValueError(f"scoring_func {scoring!r} is not supported for MiniMax-M2 (supported: sigmoid)")
    if getattr(config, "use_qk_norm", None) is False:
        raise ValueError("use_qk_norm false is not supported for MiniMax-M2 (its q/k are always RMS-normed)")
    norm_type = getattr(config, "qk_norm_type", None)
    if norm_type not in (None, "per_layer"):
        raise ValueError(f"qk_norm_type {norm_type!r} is not supported for MiniMax-M2 (supported: per_layer, "
                         f"q and k normed over all their heads)")
    shared = getattr(config, "shared_intermediate_size", None)
    if shared:
        raise ValueError(f"shared_intermediate_size {shared}: MiniMax-M2 shared experts are not supported")
    attn_types = getattr(config, "attn_type_list", None)
    if attn_types is not None and any(t != 1 for t in attn_types):
        raise ValueError("attn_type_list with entries other than 1 (lightning-attention layers) is not supported "
                         "for MiniMax-M2 (every layer is softmax attention)")
    if getattr(config, "sliding_window", None):
        raise ValueError("sliding_window is not supported for MiniMax-M2 (its attention is full in every layer)")
    scale = getattr(config, "routed_scaling_factor", None)
    if scale is not None and float(scale) != 1.0:
        raise ValueError(f"routed_scaling_factor {scale} is not supported for MiniMax-M2 (transformers' model "
                         f"weighs the experts by their renormalised scores alone)")


def minimax_rotary(config: PretrainedConfig) -> RotaryEmbedding:
    """The shared rotary tables over the first rotary_dim dims of each head (partial_rotary_factor = rotary_dim /
    head_dim in transformers 5's rope_parameters); a stated rotary_dim must agree with them."""
    stated = getattr(config, "rotary_dim", None)
    params = getattr(config, "rope_parameters", None) or {}
    if stated is not None and params.get("partial_rotary_factor") is None \
            and getattr(config, "partial_rotary_factor", None) is None:  # (transformers < 5.2x keeps rotary_dim only)
        config.partial_rotary_factor = int(stated) / attention_head_dim(config)
    rotary = model_rotary(config)
    if stated is not None and int(stated) != rotary.rotary_dim:
        raise ValueError(f"rotary_dim {stated} disagrees with partial_rotary_factor (rotary_dim "
                         f"{rotary.rotary_dim} of head_dim {rotary.head_dim})")
    return rotary


class MiniMaxM2Attention(OlmoAttention):
    """OLMo's whole-width q/k norm with no projection biased (transformers' MiniMax-M2 never biases them)."""

    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, tp_rank, tp_size, rotary, qkv_bias=False)
        unbiased_o_proj(self)


class MiniMaxM2MoE(SparseMoeBlock):
    """Router (sigmoid; the correction bias for the choice only; renormalised top-k) and the routed experts, one
    all-reduce at the end: SparseMoeBlock's forward, no shared expert."""

    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        nn.Module.__init__(self)
        hidden, experts = config.hidden_size, num_experts(config)
        self.tp_size = tp_size
        self.gate = MoEGate(hidden, experts, correction_bias=uses_routing_bias(config))
        router = RouterConfig(experts, config.num_experts_per_tok, "sigmoid", renormalize=True)
        self.experts = FusedMoE(router, hidden, config.intermediate_size, tp_rank, tp_size, reduce_results=False)
        self.shared_expert = None
        self.shared_expert_gate = None


class MiniMaxM2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its forward) with MiniMax-M2's attention and MoE block."""

    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        self.self_attn = MiniMaxM2Attention(config, layer_id, tp_rank, tp_size, rotary)
        self.mlp = MiniMaxM2MoE(config, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # as LlamaDecoderLayer: with the fused all-reduce + add + RMSNorm, o_proj's output comes unreduced and the
        # post-attention norm sums it over the ranks; the MoE block reduces its own output
        self.fuse_reduce = tp_size > 1 and custom_all_reduce_fuses_norm()
        self.mlp_partial = False
        self.input_partial = False
        if self.fuse_reduce:
            self.self_attn.o_proj.reduce_results = False


class MiniMaxM2Model(Glm4Model):
    layer_cls = MiniMaxM2DecoderLayer

    def build_rotary(self, config: PretrainedConfig) -> RotaryEmbedding:
        return minimax_rotary(config)


class MiniMaxM2ForCausalLM(GlmLayout, MoECausalLM):
    partial_rotary = True
    interleaved_rotary = False  # neox halves of the rotated dims

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        check_config(config)
        super().__init__(config, tp_rank, tp_size)
        self._init_layout(self.model)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        return MiniMaxM2Model(config, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        n = self.config.num_hidden_layers
        skipped = 0

        def served() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal skipped
            for name, tensor in weights:
                m = _LAYER.match(name)
                if _MTP.match(name) is not None or (m is not None and int(m.group(1)) >= n):
                    skipped += 1  # the multi-token-prediction modules: layers n.. (or model.mtp*)
                    continue
                yield name, tensor

        super().load_weights(served())
        if skipped:
            logger.info("MiniMax-M2: skipped %d multi-token-prediction weight(s) (layers %d and on; speculative "
                        "decoding from them is not supported)", skipped, n)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        m = _CORRECTION.match(name)
        if m is not None:  # [E], float32 as transformers keeps it
            target = f"{m.group(1)}.mlp.gate.e_score_correction_bias"
            if target in params:
                load_plain(params[target], name, tensor.float().reshape(-1))
                return target
            if not uses_routing_bias(self.config) and not bool(tensor.any()):
                return None  # use_routing_bias false: a zero bias changes nothing
            raise ValueError(f"{name}: a non-zero e_score_correction_bias with use_routing_bias false (transformers "
                             f"would route with it) is not supported")
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name.endswith(".weight_scale_inv") and (".q_proj." in name or ".k_proj." in name) \
                and self._scale_blocks_whole_heads(params, name):
            return super().load_weight(params, name, tensor)  # each scale row covers whole heads: no layout
        return super().load_weight(params, name, self._laid_out(name, tensor))

    def _scale_blocks_whole_heads(self, params: dict[str, nn.Parameter], name: str) -> bool:
        """A block-wise fp8 q/k scale whose row blocks are whole heads (MiniMax-M2's 128 x 128 blocks, head_dim
        128): the per-head layout moves rows within a head, so within one block, and leaves the scale as it is."""
        target = name.replace(".q_proj.", ".qkv_proj.").replace(".k_proj.", ".qkv_proj.")
        block = getattr(params.get(target), "output_block", None)
        return bool(block) and self.head_dim > 0 and block % self.head_dim == 0
