"""Tencent Hunyuan dense (`HunYuanDenseV1ForCausalLM`: Hunyuan-7B / 4B / 1.8B / 0.5B) and MoE
(`HunYuanMoEV1ForCausalLM`: Hunyuan-A13B): Llama's layer (pre-norms, GQA, SwiGLU) with

- q and k RMS-normed per head *after* the rotation (`query_layernorm` / `key_layernorm`, weights of head_dim): the
  weight does not commute with the rotation, so the norm cannot move before it or into the rotary kernel, and the
  KV store follows the norm (the fused q/k/v + rotary + KV-store paths are not taken);
- rotary scaling "dynamic" with an `alpha` (the releases' NTK-alpha): a fixed base theta * alpha ** (d / (d - 2)),
  d the head dim, the frequencies then computed as plain RoPE's (transformers' `compute_ntk_alpha_rope_parameters`;
  not sequence-length dependent). A "dynamic" scaling without alpha (length-dependent NTK) is refused;
- MoE (every layer): a float32 router `mlp.gate.wg`, softmax over the experts, the top `moe_topk` (an int or one per
  layer) renormalised to sum to 1, experts of intermediate_size, plus `mlp.shared_mlp` (one MLP of
  intermediate_size) added unweighted.

Fields of the original (remote-code) configs that transformers does not read are checked, so that a checkpoint
built with another setting is refused rather than served as something else: use_qk_norm, use_rotary_pos_emb and
use_mixed_mlp_moe must be true (or absent), use_cla / use_mla false, moe_intermediate_size and num_shared_expert
per layer equal to intermediate_size and 1, moe_layer_num_skipped 0, routed_scaling_factor 1, mlp_bias false.
GGUF files of Hunyuan are refused (`configs/model_config.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.layers.moe import FusedMoE, MoEGate, RouterConfig
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    attention_head_dim,
    check_hidden_act,
    rope_params,
)
from radixserve.models.qwen2_moe import MoECausalLM, SparseMoeBlock

if TYPE_CHECKING:
    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
    from radixserve.model_executor.forward_batch_info import ForwardBatch

# checkpoint names -> ours
_RENAMES = ((".self_attn.query_layernorm.", ".self_attn.q_norm."), (".self_attn.key_layernorm.", ".self_attn.k_norm."),
            (".mlp.gate.wg.", ".mlp.gate."), (".mlp.shared_mlp.", ".mlp.shared_expert."))


def _per_layer(config: Any, key: str, layer_id: int, default: Any) -> Any:
    """`key`'s value for layer `layer_id`: an int for every layer, or a list with one per layer."""
    value = getattr(config, key, None)
    value = default if value is None else value
    if isinstance(value, (list, tuple)):
        if len(value) < config.num_hidden_layers:
            raise ValueError(f"Hunyuan config field {key} lists {len(value)} values for {config.num_hidden_layers} "
                             f"layers")
        value = value[layer_id]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"Hunyuan config field {key} must be an integer or a list of them; got {value!r}")
    return value


def check_config(config: Any) -> None:
    """Refuse the original configs' settings that transformers' Hunyuan does not implement (see the module's note)."""
    for key, want in (("use_qk_norm", True), ("use_rotary_pos_emb", True), ("use_cla", False), ("use_mla", False),
                      ("mlp_bias", False)):
        value = getattr(config, key, None)
        if value is not None and bool(value) != want:
            raise ValueError(f"Hunyuan config {key}={value!r} is not supported (only {want})")
    check_hidden_act(config)


def check_moe_config(config: Any) -> None:
    experts = getattr(config, "num_experts", None)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"HunYuanMoEV1ForCausalLM needs num_experts, one positive integer for every layer (as "
                         f"transformers); got {experts!r}")
    if getattr(config, "use_mixed_mlp_moe", True) is False:
        raise ValueError("Hunyuan config use_mixed_mlp_moe=False (no shared MLP) is not supported")
    if getattr(config, "moe_layer_num_skipped", 0):
        raise ValueError(f"Hunyuan config moe_layer_num_skipped={config.moe_layer_num_skipped} is not supported (0)")
    scale = getattr(config, "routed_scaling_factor", None)
    if scale is not None and float(scale) != 1.0:
        raise ValueError(f"Hunyuan config routed_scaling_factor={scale} is not supported (1.0)")
    for layer in range(config.num_hidden_layers):
        inter = _per_layer(config, "moe_intermediate_size", layer, config.intermediate_size)
        if inter != config.intermediate_size:
            raise ValueError(f"Hunyuan moe_intermediate_size {inter} (layer {layer}) differs from intermediate_size "
                             f"{config.intermediate_size}, which transformers sizes the experts with")
        shared = _per_layer(config, "num_shared_expert", layer, 1)
        if shared != 1:
            raise ValueError(f"Hunyuan num_shared_expert {shared} (layer {layer}) is not supported (1)")


def hunyuan_rotary(config: Any, table_positions: int | None = None) -> RotaryEmbedding:
    """The rotary tables: NTK-alpha ("dynamic" with alpha) as a fixed base, else what RotaryEmbedding implements;
    plain "dynamic" (length-dependent) is refused."""
    theta, scaling = rope_params(config)
    head_dim = attention_head_dim(config)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "dynamic":
        alpha = scaling.get("alpha")
        if not alpha:
            raise ValueError("Hunyuan rope scaling 'dynamic' without alpha (length-dependent NTK) is not supported; "
                             "the releases' 'dynamic' carries an alpha")
        if head_dim <= 2:
            raise ValueError(f"NTK-alpha rope needs head_dim > 2; got {head_dim}")
        theta = theta * float(alpha) ** (head_dim / (head_dim - 2))
        scaling = None
    if getattr(config, "partial_rotary_factor", None) not in (None, 1, 1.0):
        raise ValueError("Hunyuan does not support partial_rotary_factor")
    return RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling, table_positions=table_positions)


class HunyuanAttention(LlamaAttention):
    """Rotation, then the per-head q/k RMSNorms, then attention (the KV store after the norm)."""

    def __init__(self, config: Any, layer_id: int, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 qkv_bias: bool = False, qk_norm: bool = False, sinks: bool = False) -> None:
        super().__init__(config, layer_id, tp_rank, tp_size, rotary, qkv_bias, True, sinks=sinks)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | None, forward_batch: ForwardBatch,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        if qkv is None:
            qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotate_then_norm(positions, q, k)
        return self._out(self.attn(q, k, v, forward_batch))

    def rotate_then_norm(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.rotary_emb(positions, q, k)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape[0], -1)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape[0], -1)
        return q, k

    def _qkv_rope(self, positions: torch.Tensor, hidden: torch.Tensor | None,
                  forward_batch: ForwardBatch) -> torch.Tensor | None:
        return None

    def _rope_args(self, positions: torch.Tensor, hidden: torch.Tensor,
                   forward_batch: ForwardBatch) -> RopeArgs | None:
        return None


class HunyuanDecoderLayer(LlamaDecoderLayer):
    attention_cls = HunyuanAttention


class HunyuanModel(LlamaModel):
    layer_cls = HunyuanDecoderLayer

    def build_rotary(self, config: Any) -> RotaryEmbedding:
        return hunyuan_rotary(config, self.table_positions)


class HunyuanMoE(SparseMoeBlock):
    """Router (float32 softmax, top-k renormalised), routed experts and the shared MLP (unweighted), one all-reduce
    at the end: SparseMoeBlock's forward with Hunyuan's per-layer fields."""

    def __init__(self, config: Any, layer_id: int, tp_rank: int, tp_size: int) -> None:
        nn.Module.__init__(self)
        hidden, experts, inter = config.hidden_size, int(config.num_experts), config.intermediate_size
        self.tp_size = tp_size
        self.gate = MoEGate(hidden, experts)
        router = RouterConfig(experts, _per_layer(config, "moe_topk", layer_id, 1), "softmax", renormalize=True)
        self.experts = FusedMoE(router, hidden, inter, tp_rank, tp_size, reduce_results=False)
        self.shared_expert = LlamaMLP(hidden, inter, False, tp_rank, tp_size, reduce_results=False)
        self.shared_expert_gate = None


def hunyuan_moe_mlp(config: Any, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    return HunyuanMoE(config, layer_id, tp_rank, tp_size)


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    def build_model(self, config: Any, tp_rank: int, tp_size: int) -> nn.Module:
        check_config(config)
        return HunyuanModel(config, tp_rank, tp_size, bool(getattr(config, "attention_bias", False)), True,
                            self.mlp_factory)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return super().load_weight(params, name, tensor)


class HunYuanMoEV1ForCausalLM(HunYuanDenseV1ForCausalLM, MoECausalLM):
    mlp_factory = staticmethod(hunyuan_moe_mlp)

    def build_model(self, config: Any, tp_rank: int, tp_size: int) -> nn.Module:
        check_moe_config(config)
        return super().build_model(config, tp_rank, tp_size)
