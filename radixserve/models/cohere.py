"""Cohere's Command-R family (`CohereForCausalLM`: Command-R, Command-R+, Aya 23 / Aya Expanse) and Command-R7B /
Command-A (`Cohere2ForCausalLM`).

- One norm a layer, a LayerNorm without bias (mean subtracted, `layer_norm_eps`), and the attention and the MLP run
  in parallel from its output: out = x + attn(norm(x)) + mlp(norm(x)); the final norm is the same LayerNorm. Under
  tensor parallelism o_proj and down_proj leave their partial sums unreduced and the layer all-reduces their sum
  once.
- Rotary turns *interleaved* pairs (2i, 2i + 1) of each head. Our kernels turn (i, i + head_dim / 2), so q and k
  rows (weights, biases, per-row scales, the q/k norms' weights) are laid out per head at load as GLM-4's are
  (`glm4.rotary_order`, `glm4.GlmLayout`, LoRA B included): q.k is the same sum in any order of a head's dims.
- The logits are multiplied by `logit_scale`; the embeddings are tied (as the released models).
- Command-R's `use_qk_norm` (Command-R+) norms each q and k head with a LayerNorm whose weight is per head
  ([heads, head_dim], split over the TP ranks with the heads), before the rotation.
- Cohere2's `layer_types` (from `sliding_window_pattern`: three sliding layers, then a full one) pick the window of
  each layer; only the sliding layers rotate, the full-attention layers use no position embedding (NoPE: a table
  with rotary_dim 0, cos 1 and sin 0, that every kernel path serves unchanged). As transformers, a config without
  a `sliding_window` leaves every layer unrotated.

The CUDA-only fused paths of LlamaAttention compute the right thing or are not taken: the decoder layer here norms
and projects itself, so LlamaDecoderLayer's RMSNorm-in-the-GEMV paths (`gemv_row_norm`, `normed_forward`) never
run; q/k/v with the rotation in one launch (`_qkv_rope`, `_rope_args`) rotate neox pairs, which the laid-out rows
make the checkpoint's interleaved ones, and are skipped (`qk_norm` set) where q/k need their LayerNorm first; the
rotary kernel's fused q/k norm (`QKNorm`, an RMSNorm) is never passed: the LayerNorms run before it. GGUF files of
these architectures are refused (`configs/model_config.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from radixserve.layers.layernorm import LayerNorm
from radixserve.layers.logits_processor import LogitsProcessor
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.glm4 import GlmLayout, rotary_order
from radixserve.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    attention_head_dim,
    check_hidden_act,
    input_embedding,
    model_rotary,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

_HEAD_NORMS = (".q_norm.weight", ".k_norm.weight")
_LAYER_TYPES = ("sliding_attention", "full_attention")


class HeadNorm(LayerNorm):
    """A per-head LayerNorm over this rank's `heads` heads, from `first_head` on of the model's `total_heads`: its
    weight loads the rank's rows of the checkpoint's [total_heads, head_dim]."""

    def __init__(self, heads: int, head_dim: int, eps: float, first_head: int, total_heads: int) -> None:
        super().__init__((heads, head_dim), eps)
        if not 0 <= first_head <= total_heads - heads:
            raise ValueError(f"q/k norm heads [{first_head}, {first_head + heads}) are outside the {total_heads}")
        self.first_head, self.total_heads = first_head, total_heads
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        full = self.checkpoint_shape("weight")
        if tuple(loaded.shape) != full:
            raise ValueError(f"q/k norm weight of shape {tuple(loaded.shape)}: expected [heads, {full[1]}] with "
                             f"{full[0]} heads")
        param.data.copy_(loaded.narrow(0, self.first_head, param.shape[0]))

    def checkpoint_shape(self, leaf: str) -> tuple[int, ...]:
        """The checkpoint tensor's shape (dummy weights generate it whole, then take this rank's heads)."""
        return (self.total_heads, self.weight.shape[1])


class CohereAttention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 qk_norm: bool) -> None:
        # LlamaAttention's own q/k norms are RMSNorms: built without them, its qk_norm set below for Cohere's
        super().__init__(config, layer_id, tp_rank, tp_size, rotary,
                         qkv_bias=bool(getattr(config, "attention_bias", False)))
        self.qk_norm = qk_norm  # True also turns off LlamaAttention's fused q/k/v + rotation (no norm in it)
        if qk_norm:
            eps = float(config.layer_norm_eps)
            kv_rank = tp_rank // self.qkv_proj.kv_replicas
            heads = config.num_attention_heads
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            self.q_norm = HeadNorm(self.num_heads, self.head_dim, eps, tp_rank * self.num_heads, heads)
            self.k_norm = HeadNorm(self.num_kv_heads, self.head_dim, eps, kv_rank * self.num_kv_heads, kv_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | None, forward_batch: ForwardBatch,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        if not self.qk_norm:
            return super().forward(positions, hidden, forward_batch, qkv)
        if qkv is None:
            qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(q.shape)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(k.shape)
        kv_write = self._kv_write(q, k, v, forward_batch)
        q, k = self.rotary_emb(positions, q, k, kv_write)  # no QKNorm: the (Layer)norms ran above
        return self._out(self.attn(q, k, v, forward_batch, save_kv_cache=kv_write is None))


class CohereDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = CohereAttention(config, layer_id, tp_rank, tp_size, rotary, qk_norm)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size)
        self.input_layernorm = LayerNorm(config.hidden_size, float(config.layer_norm_eps))
        self.reduce_once = tp_size > 1  # one all-reduce of attention + MLP partial sums
        if self.reduce_once:
            self.self_attn.o_proj.reduce_results = False
            self.mlp.down_proj.reduce_results = False

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(positions, normed, forward_batch)
        mlp = self.mlp(normed)
        if self.reduce_once:  # (o_proj's bias, where it has one, is rank 0's only: added once)
            return hidden + tensor_model_parallel_all_reduce(attn + mlp)
        return hidden + attn + mlp


def layer_rotaries(config: PretrainedConfig, sliding_nope: bool,
                   rotate_without_window: bool = False) -> list[RotaryEmbedding]:
    """Each layer's rotary table: the model's for every layer, or with `sliding_nope` (Cohere2, EXAONE 4) for the
    "sliding_attention" layers only, the full-attention ones sharing a table that turns nothing. A config without a
    `sliding_window` leaves every layer unrotated (Cohere2), or with `rotate_without_window` rotates every layer
    (EXAONE 4), as transformers does for each."""
    n = config.num_hidden_layers
    rotary = model_rotary(config)
    if not sliding_nope:
        return [rotary] * n
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != n or any(t not in _LAYER_TYPES for t in types):
        family = getattr(config, "model_type", None) or "this model"
        raise ValueError(f"{family} needs layer_types with {n} entries, each one of {', '.join(_LAYER_TYPES)}; "
                         f"got {types}")
    if getattr(config, "sliding_window", None) is None:
        return [rotary] * n if rotate_without_window else [_nope(config)] * n
    nope = _nope(config)
    return [rotary if t == "sliding_attention" else nope for t in types]


def _nope(config: PretrainedConfig) -> RotaryEmbedding:
    """A table that turns nothing (rotary_dim 0: cos 1, sin 0), served by every rotary kernel path unchanged."""
    return RotaryEmbedding(attention_head_dim(config), config.max_position_embeddings, 10000.0, rotary_dim=0)


class CohereModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, qk_norm: bool,
                 sliding_nope: bool) -> None:
        super().__init__()
        self.embed_tokens = input_embedding(config, tp_rank, tp_size, tied_default=True)
        rotaries = layer_rotaries(config, sliding_nope)
        self.layers = nn.ModuleList(CohereDecoderLayer(config, i, tp_rank, tp_size, rotaries[i], qk_norm)
                                    for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, float(config.layer_norm_eps))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, forward_batch)
        return self.norm(hidden)


class CohereForCausalLM(GlmLayout, LlamaForCausalLM):
    sliding_nope = False  # Cohere2: rotary on the sliding layers only

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        if getattr(config, "tie_word_embeddings", None) is None:
            config.tie_word_embeddings = True  # Cohere's default
        super().__init__(config, tp_rank, tp_size)
        scale = getattr(config, "logit_scale", 0.0625)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
            raise ValueError(f"logit_scale must be a positive number; got {scale!r}")
        self.logits_processor = LogitsProcessor(config.vocab_size, logit_scale=float(scale))
        # every layer's q/k rows laid out for the interleaved pairs (a NoPE layer's too: its q.k is unchanged)
        self.head_dim = attention_head_dim(config)
        self.dim_order = rotary_order(self.head_dim, self.head_dim, interleaved=True)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        qk_norm = bool(getattr(config, "use_qk_norm", False)) and not self.sliding_nope  # Cohere2 has none
        return CohereModel(config, tp_rank, tp_size, qk_norm, self.sliding_nope)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if name.endswith(_HEAD_NORMS):  # [heads, head_dim]: each head's dims in the order of its q/k rows
            if tensor.dim() != 2 or tensor.shape[-1] != self.head_dim:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected [heads, {self.head_dim}]")
            order = self.dim_order
            return super().load_weight(params, name, tensor if order is None else tensor[:, order].contiguous())
        return super().load_weight(params, name, self._laid_out(name, tensor))


class Cohere2ForCausalLM(CohereForCausalLM):
    sliding_nope = True
