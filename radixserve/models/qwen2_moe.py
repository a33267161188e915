"""Qwen2-MoE: the Qwen2 attention (q/k/v bias) with sparse MoE blocks: softmax top-k routing and a shared expert
whose output is gated by sigmoid(shared_expert_gate(x)). Layers listed in `mlp_only_layers`, or off the
`decoder_sparse_step` grid, keep a dense MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from radixserve.layers.linear import ReplicatedLinear
from radixserve.layers.moe import FusedMoE, MoEGate, RouterConfig, load_expert_weight
from radixserve.layers.moe.activation import SILU, ExpertActivation
from radixserve.models.llama import LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ an optional shared expert, optionally sigmoid-gated), one all-reduce at the end."""

    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, renormalize: bool,
                 shared_size: int = 0, shared_gate: bool = False, biased: bool = False,
                 activation: ExpertActivation = SILU) -> None:
        """`biased`: the router and the experts carry biases; `activation`: the experts' (both GPT-OSS)."""
        super().__init__()
        hidden, num_experts = config.hidden_size, _num_experts(config)
        self.tp_size = tp_size
        self.gate = MoEGate(hidden, num_experts, bias=biased)
        router = RouterConfig(num_experts, config.num_experts_per_tok, "softmax", renormalize)
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # Mixtral: the latter
        self.experts = FusedMoE(router, hidden, inter, tp_rank, tp_size, reduce_results=False,
                                activation=activation, bias=biased)
        self.shared_expert = LlamaMLP(hidden, shared_size, False, tp_rank, tp_size, reduce_results=False) \
            if shared_size else None
        self.shared_expert_gate = ReplicatedLinear(hidden, 1) if shared_size and shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish(x, self.experts.forward_gated(x, self.gate))

    def forward_norm(self, hidden: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block(norm(hidden + residual)), hidden + residual): for a few tokens the residual add, the norm, the
        router's linear layer and the top-k are one launch."""
        return norm_then_moe(self, hidden, residual, norm)

    def _finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


def norm_then_moe(block: nn.Module, hidden: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`x, residual = norm(hidden, residual); return block(x), residual` for an MoE block with `gate`, `experts`
    and `_finish(x, routed_out)`, with the norm folded into the router's launch where it can be."""
    routed = block.gate.route(hidden, block.experts.router, (residual, norm))
    if routed is None:
        x, residual = norm(hidden, residual)
        return block(x), residual
    weights, ids, x, new_residual = routed
    return block._finish(x, block.experts.run_experts(x, weights, ids)), new_residual


def _num_experts(config: PretrainedConfig) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    raise ValueError("the MoE config names no expert count (num_experts / num_local_experts / n_routed_experts)")


def is_sparse_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """Qwen-MoE's rule for which layers hold experts."""
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_id not in only_mlp and _num_experts(config) > 0 and (layer_id + 1) % step == 0


def qwen2_moe_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    if not is_sparse_layer(config, layer_id):
        return LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size)
    return SparseMoeBlock(config, tp_rank, tp_size, bool(getattr(config, "norm_topk_prob", False)),
                          getattr(config, "shared_expert_intermediate_size", 0) or 0, shared_gate=True)


class MoECausalLM(LlamaForCausalLM):
    """A Llama-family model whose feed-forward blocks may be sparse: expert tensors load into stacked parameters.
    `decode_gemv_attention`: q/k/v (with the input norm) and o_proj of one row through the one-row GEMV
    (`triton_ops.gemv`; families whose attention projections are a few MB, where cuBLAS splits K at batch 1)."""

    decode_gemv_attention = False

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        if self.decode_gemv_attention:
            for layer in self.model.layers:
                layer.self_attn.qkv_proj.decode_gemv = layer.self_attn.o_proj.decode_gemv = True

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        target = load_expert_weight(params, name, tensor)
        return target if target is not None else super().load_weight(params, name, tensor)


class Qwen2MoeForCausalLM(MoECausalLM):
    mlp_factory = staticmethod(qwen2_moe_mlp)

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.qkv_bias = bool(getattr(config, "qkv_bias", True))
        super().__init__(config, tp_rank, tp_size)
