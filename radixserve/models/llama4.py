"""Llama 4 (Scout 17B-16E, Maverick 17B-128E): `Llama4ForConditionalGeneration` served as text, and the text-only
`Llama4ForCausalLM`.

- Layers alternate two kinds of attention (`no_rope_layers`: 1 rotates, 0 does not; by default every fourth layer
  is NoPE). A rotating layer attends within chunks of `attention_chunk_size` tokens (`layer_types`
  "chunked_attention": a query at position p sees the keys (p // C) * C .. p; `RadixAttention.attention_chunk_size`)
  and L2-normalises its q and k heads (`use_qk_norm`, an RMSNorm without weight: after the rotation in
  transformers, before it here, the same thing since a rotation keeps each pair's norm). A NoPE layer attends to the
  whole context and, with `attn_temperature_tuning`, scales its queries by log(floor((p + 1) / floor_scale) + 1) *
  attn_scale + 1 at position p.
- Rotary turns interleaved pairs (2i, 2i + 1): q/k rows are laid out at load as GLM-4's and Cohere's are
  (`glm4.GlmLayout`), so that the neox kernels turn the same pairs.
- MoE layers (`moe_layers`, from `interleave_moe_layer_step`: every layer for Scout, every other for Maverick) hold
  a router whose top-k logits pass through a sigmoid, experts that take the token *times its score* (the weight is
  applied to the input, not the output), and a shared expert; the other layers a dense MLP of
  `intermediate_size_mlp`. The experts are stored stacked (`experts.gate_up_proj` [E, H, 2I], gate then up;
  `experts.down_proj` [E, I, H]) and load into FusedMoE's layout without per-expert modules.
- The rotary tables are built for at most TABLE_POSITIONS positions (Scout's max_position_embeddings is 10M) and
  extended by the loader to the served context. A 10M-token default context also sizes the request table: serve
  with `--context-length`.

The CUDA-only fused paths of LlamaAttention (q/k/v with the rotation and the KV store in one launch) rotate neox
pairs, which the laid-out rows make the checkpoint's; on NoPE layers with temperature tuning they are not taken
(the queries are scaled before attention). GGUF files of Llama 4 are refused (`configs/model_config.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from radixserve.layers.moe import FusedMoE, MoEGate, RouterConfig
from radixserve.layers.moe.router import select_experts
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.glm4 import GlmLayout, rotary_order
from radixserve.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    attention_head_dim,
    check_hidden_act,
)
from radixserve.models.multimodal_text import TextOfMultimodal

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
    from radixserve.model_executor.forward_batch_info import ForwardBatch

TABLE_POSITIONS = 1 << 17
_LAYER_TYPES = ("chunked_attention", "full_attention")


def rope_layers(config: PretrainedConfig) -> list[bool]:
    """Whether each layer rotates q and k (`no_rope_layers`, or transformers' default from no_rope_layer_interval:
    every interval-th layer is NoPE)."""
    n = config.num_hidden_layers
    flags = getattr(config, "no_rope_layers", None)
    if not flags:
        interval = int(getattr(config, "no_rope_layer_interval", 4) or 4)
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) < n or any(f not in (0, 1, True, False) for f in flags[:n]):
        raise ValueError(f"no_rope_layers must hold a 0 or 1 for each of the {n} layers; got {flags}")
    return [bool(f) for f in flags[:n]]


def layer_chunks(config: PretrainedConfig) -> list[int]:
    """Each layer's attention chunk (-1: full attention), from `layer_types` or, as transformers derives it, from
    the rotating layers when attention_chunk_size is set."""
    n, chunk = config.num_hidden_layers, getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None) or [
        "chunked_attention" if rope and chunk is not None else "full_attention" for rope in rope_layers(config)]
    if len(types) < n or any(t not in _LAYER_TYPES for t in types[:n]):
        raise ValueError(f"Llama 4 layer_types must name one of {', '.join(_LAYER_TYPES)} for each of the {n} "
                         f"layers; got {types}")
    if "chunked_attention" in types[:n] and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"chunked_attention layers need a positive attention_chunk_size; got {chunk!r}")
    return [chunk if t == "chunked_attention" else -1 for t in types[:n]]


def moe_layer_ids(config: PretrainedConfig) -> set[int]:
    layers = getattr(config, "moe_layers", None)
    if layers is None:
        step = int(getattr(config, "interleave_moe_layer_step", 1) or 1)
        layers = range(step - 1, config.num_hidden_layers, step)
    return set(layers)


class WeightlessRMSNorm(nn.Module):
    """An RMSNorm without a learned weight (Llama 4's q/k L2 norm): `weight` is a constant ones buffer, so the
    fused rotary kernel's q/k norm (which multiplies by a weight) serves it, and no checkpoint tensor is expected."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


class Llama4Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 qkv_bias: bool = False, qk_norm: bool = False, sinks: bool = False) -> None:
        self.rotates = rotates = rope_layers(config)[layer_id]  # (NoPE layers: Llama4Model gives their table)
        qk_norm = bool(getattr(config, "use_qk_norm", True)) and rotates
        super().__init__(config, layer_id, tp_rank, tp_size, rotary, qkv_bias, qk_norm, sinks=sinks,
                         attention_chunk_size=layer_chunks(config)[layer_id])
        if qk_norm:
            self.q_norm = WeightlessRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = WeightlessRMSNorm(self.head_dim, config.rms_norm_eps)
        # NoPE layers' query temperature: q * (log1p(floor((p + 1) / floor_scale)) * attn_scale + 1)
        self.temperature = None
        if not rotates and getattr(config, "attn_temperature_tuning", True):
            floor_scale, attn_scale = getattr(config, "floor_scale", 8192), getattr(config, "attn_scale", 0.1)
            if not floor_scale > 0:
                raise ValueError(f"floor_scale must be positive; got {floor_scale!r}")
            self.temperature = (float(floor_scale), float(attn_scale))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | None, forward_batch: ForwardBatch,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        if self.temperature is None:
            return super().forward(positions, hidden, forward_batch, qkv)
        if qkv is None:
            qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        floor_scale, attn_scale = self.temperature
        scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        q = (q * scale[:, None]).to(q.dtype)  # (NoPE: nothing to rotate; the backend stores k and v)
        return self._out(self.attn(q, k, v, forward_batch))

    def _qkv_rope(self, positions: torch.Tensor, hidden: torch.Tensor | None,
                  forward_batch: ForwardBatch) -> torch.Tensor | None:
        return None if self.temperature is not None else super()._qkv_rope(positions, hidden, forward_batch)

    def _rope_args(self, positions: torch.Tensor, hidden: torch.Tensor,
                   forward_batch: ForwardBatch) -> RopeArgs | None:
        return None if self.temperature is not None else super()._rope_args(positions, hidden, forward_batch)


class Llama4MoE(nn.Module):
    """Router (sigmoid of the top-k logits), routed experts fed the token times its score, a shared expert; one
    all-reduce at the end under tensor parallelism."""

    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, int(config.num_local_experts)
        self.tp_size = tp_size
        self.router = MoEGate(hidden, num_experts)
        # the weights are plain sigmoids of the chosen logits (no renormalisation), applied to the input below
        routing = RouterConfig(num_experts, int(config.num_experts_per_tok), "sigmoid", renormalize=False)
        self.experts = FusedMoE(routing, hidden, config.intermediate_size, tp_rank, tp_size, reduce_results=False)
        self.shared_expert = LlamaMLP(hidden, config.intermediate_size, False, tp_rank, tp_size, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.router(x), self.experts.router)
        ones = torch.ones_like(weights[:, :1])
        out = self.shared_expert(x)
        for j in range(weights.shape[1]):  # each choice's expert on x * its score (top-1 in the releases)
            out = out + self.experts.run_experts(x * weights[:, j:j + 1].to(x.dtype), ones, ids[:, j:j + 1])
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


def llama4_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    if layer_id in moe_layer_ids(config):
        return Llama4MoE(config, tp_rank, tp_size)
    return LlamaMLP(config.hidden_size, config.intermediate_size_mlp, False, tp_rank, tp_size)


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Llama4Attention


class Llama4Model(LlamaModel):
    layer_cls = Llama4DecoderLayer
    table_positions = TABLE_POSITIONS

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        # the NoPE layers share one table that turns nothing (rotary_dim 0: cos 1, sin 0 on every kernel path),
        # extended with the rope table to the served positions
        nope = None
        for layer in self.layers:
            if not layer.self_attn.rotates:
                if nope is None:
                    nope = RotaryEmbedding(layer.self_attn.head_dim, 1, 10000.0, rotary_dim=0)
                layer.self_attn.rotary_emb = nope


# checkpoint names -> ours: the feed-forward block is `mlp` here; stacked experts transposed to [E, out, in]
_EXPERTS = {"experts.gate_up_proj": "experts.w13_weight", "experts.down_proj": "experts.w2_weight"}


class Llama4ForCausalLM(GlmLayout, LlamaForCausalLM):
    mlp_factory = staticmethod(llama4_mlp)

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        # every layer's q/k rows laid out for the interleaved pairs (a NoPE layer's too: its q.k is unchanged)
        self.head_dim = attention_head_dim(config)
        self.dim_order = rotary_order(self.head_dim, self.head_dim, interleaved=True)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        return Llama4Model(config, tp_rank, tp_size, bool(getattr(config, "attention_bias", False)), False,
                           self.mlp_factory)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        name = name.replace(".feed_forward.", ".mlp.")
        for hf, ours in _EXPERTS.items():
            if name.endswith(f".mlp.{hf}"):
                target = name[:-len(hf)] + ours
                if target not in params:
                    raise ValueError(f"weight {name!r} has no stacked expert parameter {target!r}")
                if tensor.dim() != 3 or not tensor.dtype.is_floating_point or tensor.element_size() < 2:
                    raise ValueError(f"{name}: expected a 16/32-bit stacked expert tensor [E, in, out], got "
                                     f"{tensor.dtype} {tuple(tensor.shape)} (quantized Llama 4 experts are not "
                                     f"supported; serve the 16-bit checkpoint, with --quantization fp8 to quantize)")
                params[target].weight_loader(params[target], tensor.transpose(1, 2), None)
                return target
        return super().load_weight(params, name, self._laid_out(name, tensor))


class Llama4ForConditionalGeneration(TextOfMultimodal, Llama4ForCausalLM):
    """Llama 4 Scout / Maverick served as text (`models/multimodal_text.py`): the vision encoder is skipped."""
