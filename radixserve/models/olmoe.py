"""OLMoE (`OlmoeForCausalLM`: OLMoE-1B-7B-0924 and its Instruct / 0125 versions): Llama's pre-norm layer with

- q and k RMS-normed over their whole projected width (hidden_size for q, kv_heads * head_dim for k), as OLMo 2
  (`olmo2.OlmoAttention`: under tensor parallelism the ranks all-reduce the sums of squares). transformers' OLMoE
  norm rounds to the activations' dtype before the weight multiplies (OLMo 2's multiplies in float32 first): the
  norms here do the same (`OlmoeQKNorm`);
- `clip_qkv`: q and k (after their norms) and v clamped to [-clip_qkv, clip_qkv] before the rotation;
- a sparse MoE block in every layer: softmax over `num_experts` (64) router logits, the top `num_experts_per_tok`
  (8), renormalised to sum to 1 when `norm_topk_prob` (the released configs: false), no shared expert.

Checkpoints store the experts one by one (`mlp.experts.<e>.{gate,up,down}_proj.weight`); transformers 5's in-memory
stacked names (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) load too, whole through
the experts' loader. q/k norms are as wide as the model (transformers builds q_norm over hidden_size): a `head_dim`
other than hidden_size / num_attention_heads is refused, as is a `sliding_window` (transformers' eager and SDPA
attention leave it out, its flash attention applies it). OLMoE GGUF files are refused (`configs/model_config.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.llama import LlamaDecoderLayer, LlamaModel, check_hidden_act
from radixserve.models.olmo2 import OlmoAttention, WholeWidthRMSNorm
from radixserve.models.qwen2_moe import MoECausalLM, SparseMoeBlock

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

# transformers 5's in-memory names of the stacked experts -> FusedMoE's
STACKED_EXPERTS = {"experts.gate_up_proj": "experts.w13_weight", "experts.down_proj": "experts.w2_weight"}


def load_stacked_experts(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
    """A whole stacked expert tensor under transformers 5's name (gate_up [E, 2I, H], gate rows first; down
    [E, H, I]) into its FusedMoE parameter (this rank's slice or experts taken by the loader); None if `name` is
    not one."""
    for theirs, ours in STACKED_EXPERTS.items():
        if name.endswith(f".mlp.{theirs}"):
            target = name[:-len(theirs)] + ours
            if target not in params:
                raise ValueError(f"weight {name!r} has no stacked expert parameter {target!r}")
            try:
                params[target].weight_loader(params[target], tensor, None)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
            return target
    return None


def clip_value(config: PretrainedConfig) -> float | None:
    clip = getattr(config, "clip_qkv", None)
    if clip is None:
        return None
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
        raise ValueError(f"clip_qkv must be a positive number or null; got {clip!r}")
    return float(clip)


def check_config(config: PretrainedConfig) -> None:
    check_hidden_act(config)
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None)
    if hidden % heads or (head_dim is not None and head_dim != hidden // heads):
        raise ValueError(f"OLMoE's q norm is hidden_size ({hidden}) wide: head_dim {head_dim} with "
                         f"{heads} heads is not supported (head_dim must be hidden_size / num_attention_heads)")
    if getattr(config, "sliding_window", None):
        raise ValueError("sliding_window is not supported for OLMoE (transformers applies it with flash attention "
                         "only; the released models attend over the whole context)")
    if not getattr(config, "num_experts", None):
        raise ValueError("OlmoeForCausalLM needs num_experts > 0 in its config")
    clip_value(config)


class OlmoeQKNorm(WholeWidthRMSNorm):
    """The whole-width RMSNorm with transformers' OlmoeRMSNorm rounding: normed in float32, rounded to x's dtype,
    then times the weight."""

    def forward(self, x: torch.Tensor, sum_sq: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        var = x.pow(2).mean(-1, keepdim=True) if sum_sq is None else sum_sq / self.full_width
        return self.weight * (x * torch.rsqrt(var + self.eps)).to(dtype)


class OlmoeAttention(OlmoAttention):
    """OLMo's whole-width q/k norm (OLMoE's rounding), then `clip_qkv`; the signature LlamaDecoderLayer builds
    its attention with (the per-head q/k norm and sink flags are not OLMoE's and must be off)."""

    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding, qkv_bias: bool = False, qk_norm: bool = False, sinks: bool = False
                 ) -> None:
        if qk_norm or sinks:
            raise ValueError("OLMoE has no per-head q/k norm nor attention sinks")
        super().__init__(config, layer_id, tp_rank, tp_size, rotary)  # biases: the config's attention_bias
        for attr in ("q_norm", "k_norm"):
            old = getattr(self, attr)
            setattr(self, attr, OlmoeQKNorm(old.full_width, old.weight.shape[0], old.offset, old.eps))
        self.clip = clip_value(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | None, forward_batch: ForwardBatch,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        if qkv is None:
            if hidden is None:
                raise ValueError("OlmoeAttention needs the hidden states or their q/k/v projection")
            qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q, k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        kv_write = self._kv_write(q, k, v, forward_batch)
        q, k = self.rotary_emb(positions, q, k, kv_write)
        return self._out(self.attn(q, k, v, forward_batch, save_kv_cache=kv_write is None))


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoeAttention


class OlmoeModel(LlamaModel):
    layer_cls = OlmoeDecoderLayer


def olmoe_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    return SparseMoeBlock(config, tp_rank, tp_size, renormalize=bool(getattr(config, "norm_topk_prob", False)))


class OlmoeForCausalLM(MoECausalLM):
    mlp_factory = staticmethod(olmoe_mlp)

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        check_config(config)
        super().__init__(config, tp_rank, tp_size)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        return OlmoeModel(config, tp_rank, tp_size, mlp_factory=self.mlp_factory)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        target = load_stacked_experts(params, name, tensor)
        return target if target is not None else super().load_weight(params, name, tensor)  # (+ per-expert)
