"""Phi-1 / Phi-1.5 / Phi-2 (`PhiForCausalLM`), and the LayerNorm stack StableLM shares (`models/stablelm.py`).

- One LayerNorm a layer, with a bias (`layer_norm_eps`), and the attention and the MLP run in parallel from its
  output: out = x + attn(norm(x)) + mlp(norm(x)). Under tensor parallelism o_proj and the MLP's down projection
  leave their partial sums unreduced and the layer all-reduces their sum once (their biases are rank 0's: added
  once). The final norm (`final_layernorm`) is the same biased LayerNorm;
- q/k/v, the attention's output projection (`dense`) and the ungated MLP (fc1 -> `hidden_act`, gelu_new in the
  releases -> fc2) are biased, and so is the LM head (untied; tied embeddings are refused: the head's bias would
  have no weight of its own);
- partial rotation: `partial_rotary_factor` of each head (0.5 for Phi-1 / 1.5, 0.4 for Phi-2), neox pairs of its
  first rotary_dim dims, laid out per head at load (glm4.GlmLayout, as Nemotron's) for our kernels;
- `qk_layernorm` (off in the releases) norms each q and k head with one biased LayerNorm over head_dim, before the
  rotation (its weight and bias laid out as the q/k rows).
The layers norm and project themselves: none of LlamaDecoderLayer's RMSNorm-fused paths runs. GGUF files of the
architecture (llama.cpp's phi2) are refused (`configs/model_config.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from radixserve.layers.layernorm import LayerNorm
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead
from radixserve.models.glm4 import GlmLayout
from radixserve.models.llama import LlamaAttention, LlamaForCausalLM, input_embedding, model_rotary
from radixserve.models.ungated import QKV_STACKED, UngatedMLP, refuse_sliding_window

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

_RENAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.up_proj."),
            (".mlp.fc2.", ".mlp.down_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."), ("model.final_layernorm.", "model.norm."))
LayerFactory = Callable[["PretrainedConfig", int, int, int, RotaryEmbedding], nn.Module]


class NormedQKAttention(LlamaAttention):
    """LlamaAttention whose q and k heads may be LayerNormed before the rotation (`q_norm` / `k_norm`, set by the
    family: Phi's one biased norm over head_dim, StableLM's per-head weights). Without them it is Llama's."""

    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool) -> None:
        super().__init__(config, layer_id, tp_rank, tp_size, rotary, qkv_bias=qkv_bias, o_bias=o_bias)
        self.q_norm: nn.Module | None = None  # (instance attributes: a module assigned later is registered)
        self.k_norm: nn.Module | None = None
        self.qk_norm = False  # LlamaAttention's RMSNorm flag: never set here

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | None, forward_batch: ForwardBatch,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        if self.q_norm is None:
            return super().forward(positions, hidden, forward_batch, qkv)
        if qkv is None:
            if hidden is None:
                raise ValueError("the attention needs the hidden states or their q/k/v projection")
            qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(q.shape)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(k.shape)
        kv_write = self._kv_write(q, k, v, forward_batch)
        q, k = self.rotary_emb(positions, q, k, kv_write)  # no QKNorm: the LayerNorms ran above
        return self._out(self.attn(q, k, v, forward_batch, save_kv_cache=kv_write is None))


class LayerNormDecoderLayer(nn.Module):
    """`parallel`: x + attn(norm(x)) + mlp(norm(x)), the two partial sums all-reduced once under TP; otherwise
    x + attn(norm(x)), then + mlp(post_attention_layernorm(.)). Norms are biased LayerNorms."""

    def __init__(self, config: PretrainedConfig, attn: NormedQKAttention, mlp: nn.Module, eps: float,
                 parallel: bool, tp_size: int) -> None:
        super().__init__()
        self.self_attn, self.mlp, self.parallel = attn, mlp, parallel
        self.input_layernorm = LayerNorm(config.hidden_size, eps, bias=True)
        if not parallel:
            self.post_attention_layernorm = LayerNorm(config.hidden_size, eps, bias=True)
        self.reduce_once = parallel and tp_size > 1
        if self.reduce_once:
            self.self_attn.o_proj.reduce_results = False
            self.mlp.down_proj.reduce_results = False

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(positions, normed, forward_batch)
        if not self.parallel:
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        mlp = self.mlp(normed)
        return hidden + (tensor_model_parallel_all_reduce(attn + mlp) if self.reduce_once else attn + mlp)


class LayerNormStack(nn.Module):
    """Embeddings, the layers `layer_factory` builds (sharing one rotary table), a final biased LayerNorm."""

    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, eps: float,
                 layer_factory: LayerFactory) -> None:
        super().__init__()
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        rotary = model_rotary(config)
        self.layers = nn.ModuleList(layer_factory(config, i, tp_rank, tp_size, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, eps, bias=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, forward_batch)
        return self.norm(hidden)


def phi_layer(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
              rotary: RotaryEmbedding) -> nn.Module:
    eps = float(config.layer_norm_eps)
    attn = NormedQKAttention(config, layer_id, tp_rank, tp_size, rotary, qkv_bias=True, o_bias=True)
    if getattr(config, "qk_layernorm", False):
        attn.q_norm = LayerNorm(attn.head_dim, eps, bias=True)
        attn.k_norm = LayerNorm(attn.head_dim, eps, bias=True)
    mlp = UngatedMLP(config.hidden_size, config.intermediate_size, True, getattr(config, "hidden_act", None),
                     tp_rank, tp_size)
    return LayerNormDecoderLayer(config, attn, mlp, eps, parallel=True, tp_size=tp_size)


class PartialRotaryCausalLM(GlmLayout, LlamaForCausalLM):
    """Phi's and StableLM's: q/k/v stacked, q/k rows (and q/k norm weights) laid out for the partial rotation,
    Phi's names (`_RENAMES`) mapped to ours."""

    partial_rotary = True
    stacked_params = QKV_STACKED

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        self._init_layout(self.model)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return super().load_weight(params, name, self._laid_out(name, tensor))


class PhiForCausalLM(PartialRotaryCausalLM):
    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError(f"tied word embeddings are not supported for {type(self).__name__} (its LM head is "
                             f"biased)")
        super().__init__(config, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size, bias=True)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        refuse_sliding_window(config, "Phi")
        return LayerNormStack(config, tp_rank, tp_size, float(config.layer_norm_eps), phi_layer)
