"""OLMo 2 (`Olmo2ForCausalLM`: OLMo-2-0425-1B, OLMo-2-1124-7B/13B, OLMo-2-0325-32B) and OLMo 3 (`Olmo3ForCausalLM`:
Olmo-3-1025-7B, Olmo-3-1125-32B and their Instruct / Think versions): Llama's q/k/v, rotary and SiLU MLP, with
OLMo's differences:

- no input norms: the attention's and the MLP's *outputs* are normed before the residual add
  (post_attention_layernorm, post_feedforward_layernorm), so each layer is h + norm(attn(h)), then h + norm(mlp(h));
- q and k are RMS-normed over their whole projected width (num_heads * head_dim for q, num_kv_heads * head_dim for
  k), not per head (Qwen3's): one mean of squares a token over all of q. Under tensor parallelism each rank holds
  its heads' slice of q, k and of the norm weights; the sums of squares (q's and k's, one float each a token) are
  all-reduced over the ranks (k's divided by the KV-head replication where ranks outnumber the KV heads). The norm
  multiplies in float32 and rounds after, as transformers' Olmo2RMSNorm does;
- OLMo 3 slides some layers (`layer_types`: "sliding_attention" over `sliding_window` tokens, three of every four
  in the released models) and rotates each layer type with its own parameters: the full-attention layers take the
  config's rope scaling (YaRN in the released 7B / 32B), the sliding ones plain RoPE.

The per-head fused paths of LlamaAttention (q/k/v + rotation in one GEMV launch, the rotary kernel's QKNorm) would
skip or misapply the whole-width norm: `OlmoAttention` never takes them (see its forward)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    MLPFactory,
    attention_head_dim,
    check_hidden_act,
    input_embedding,
    model_rotary,
    rope_params,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
    from radixserve.model_executor.forward_batch_info import ForwardBatch

LAYER_TYPES = ("sliding_attention", "full_attention")


class WholeWidthRMSNorm(nn.Module):
    """RMSNorm over a width that tensor parallelism splits by heads: `weight` is this rank's slice (`width` /
    `offset` in the checkpoint's whole weight of `full_width`), and forward takes the mean of squares over the whole
    width from the caller where the width is split (`sum_sq`, already summed over the ranks)."""

    def __init__(self, full_width: int, width: int, offset: int, eps: float) -> None:
        super().__init__()
        if not 0 <= offset <= full_width - width:
            raise ValueError(f"norm slice [{offset}, {offset + width}) is outside its width {full_width}")
        self.full_width, self.offset, self.eps = full_width, offset, eps
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if tuple(loaded.shape) != (self.full_width,):
            raise ValueError(f"q/k norm weight of shape {tuple(loaded.shape)}; expected ({self.full_width},) "
                             f"(q and k are normed over all their heads)")
        param.data.copy_(loaded.narrow(0, self.offset, param.shape[0]))

    def checkpoint_shape(self, leaf: str) -> tuple[int, ...]:
        """The checkpoint tensor's shape (dummy weights generate it whole, then take this rank's slice)."""
        return (self.full_width,)

    def forward(self, x: torch.Tensor, sum_sq: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, width] → normed, x's dtype. sum_sq: [T, 1] float32 sums of squares over the whole width (TP);
        None when this rank holds the whole width."""
        dtype = x.dtype
        x = x.float()
        var = x.pow(2).mean(-1, keepdim=True) if sum_sq is None else sum_sq / self.full_width
        return (self.weight * (x * torch.rsqrt(var + self.eps))).to(dtype)


class OlmoAttention(LlamaAttention):
    """LlamaAttention with OLMo's whole-width q/k norm between the projection and the rotation."""

    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding, qkv_bias: bool | None = None) -> None:
        """qkv_bias: None takes the config's attention_bias (OLMo); MiniMax-M2 passes False (never biased)."""
        qkv_bias = bool(getattr(config, "attention_bias", False)) if qkv_bias is None else qkv_bias
        # qk_norm=False: no per-head norm modules of Llama's; ours are built below
        super().__init__(config, layer_id, tp_rank, tp_size, rotary, qkv_bias=qkv_bias, qk_norm=False)
        proj = self.qkv_proj
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        eps = config.rms_norm_eps
        self.tp_size, self.kv_replicas = tp_size, proj.kv_replicas
        self.q_norm = WholeWidthRMSNorm(num_heads * self.head_dim, self.q_size, tp_rank * self.q_size, eps)
        kv_rank = tp_rank // proj.kv_replicas  # ranks past the KV heads' count share (replicate) one KV head
        self.k_norm = WholeWidthRMSNorm(num_kv_heads * self.head_dim, self.kv_size, kv_rank * self.kv_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | None, forward_batch: ForwardBatch,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        """Llama's forward without its one-token fused q/k/v + rotation (`_qkv_rope`: no norm between them) and
        without the rotary kernel's per-head QKNorm: q and k are normed here, whole-width, then rotated (the rotary
        kernel may still store K/V, `_kv_write`: that is norm-free)."""
        if qkv is None:
            if hidden is None:
                raise ValueError("OlmoAttention needs the hidden states or their q/k/v projection")
            qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q, k)
        kv_write = self._kv_write(q, k, v, forward_batch)
        q, k = self.rotary_emb(positions, q, k, kv_write)
        return self._out(self.attn(q, k, v, forward_batch, save_kv_cache=kv_write is None))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, q_size] and k [T, kv_size] RMS-normed over all their heads. With TP, one all-reduce of [T, 2]
        float32 sums of squares gives the whole width's (k's counted kv_replicas times where KV heads are
        replicated)."""
        if self.tp_size == 1:
            return self.q_norm(q), self.k_norm(k)
        sums = torch.stack((q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)), dim=-1)
        sums = tensor_model_parallel_all_reduce(sums.contiguous())
        k_sum = sums[:, 1:] if self.kv_replicas == 1 else sums[:, 1:] / self.kv_replicas
        return self.q_norm(q, sums[:, :1]), self.k_norm(k, k_sum)

    # The fused one-token paths Llama's layers may ask for: none here (they leave out the whole-width norm).
    def normed_forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                       norm: RMSNorm, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def _rope_args(self, positions: torch.Tensor, hidden: torch.Tensor,
                   forward_batch: ForwardBatch) -> RopeArgs | None:
        return None

    def _qkv_rope(self, positions: torch.Tensor, hidden: torch.Tensor | None,
                  forward_batch: ForwardBatch) -> torch.Tensor | None:
        return None


class OlmoDecoderLayer(nn.Module):
    """Post-norms only: h + norm(attn(h)), then h + norm(mlp(h)). `attention`: the layer's attention module where
    it is not OLMo's (EXAONE 4 passes Llama's with its per-head q/k norm); `mlp`: its feed-forward block where it
    is not the dense SiLU MLP (FlexOlmo passes OLMoE's sparse MoE block)."""

    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding, attention: nn.Module | None = None, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attention if attention is not None else \
            OlmoAttention(config, layer_id, tp_rank, tp_size, rotary)
        self.mlp = mlp if mlp is not None else \
            LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """hidden: the residual stream; returned with this layer's normed attention and MLP outputs added."""
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, forward_batch))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


def layer_types(config: PretrainedConfig) -> list[str]:
    """Each layer's attention type; all full where the config names none (OLMo 2)."""
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
    return types


def olmo3_rotary(config: PretrainedConfig, layer_type: str) -> RotaryEmbedding:
    """The rotary tables of one OLMo 3 layer type: transformers 5 keeps per-type rope_parameters (the rope scaling
    in the full-attention ones); a transformers-4 config keeps rope_theta / rope_scaling flat, and its sliding layers
    rotate unscaled (as transformers 4's Olmo3 does)."""
    params = getattr(config, "rope_parameters", None) or {}
    per_type = isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())
    if per_type:
        own = params.get(layer_type)
        if not isinstance(own, dict) or "rope_theta" not in own:
            raise ValueError(f"OLMo 3 config has no rope_parameters[{layer_type!r}] with a rope_theta")
        theta = float(own["rope_theta"])
        scaling = None if own.get("rope_type", "default") in ("default", None) else dict(own)
    else:
        theta, scaling = rope_params(config)
        if layer_type == "sliding_attention":
            scaling = None
    if scaling is not None and scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor is not supported for OLMo")
    return RotaryEmbedding(attention_head_dim(config), config.max_position_embeddings, theta, scaling)


class OlmoModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, olmo3: bool,
                 mlp_factory: MLPFactory | None = None) -> None:
        """mlp_factory: each layer's feed-forward block where it is not the dense SiLU MLP (FlexOlmo's MoE)."""
        super().__init__()
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        types = layer_types(config)
        if olmo3:  # one table per layer type, shared by its layers
            rotary = {t: olmo3_rotary(config, t) for t in sorted(set(types))}
        else:
            shared = model_rotary(config)
            rotary = {t: shared for t in set(types)}
        self.layers = nn.ModuleList(
            OlmoDecoderLayer(config, i, tp_rank, tp_size, rotary[types[i]],
                             mlp=None if mlp_factory is None else mlp_factory(config, i, tp_rank, tp_size))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, forward_batch)
        return self.norm(hidden)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Both generations; `olmo3` picks the sliding layers and per-type rotary tables."""
    olmo3 = False

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        return OlmoModel(config, tp_rank, tp_size, self.olmo3)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    olmo3 = True
