"""Phi-3.5-MoE (`PhimoeForCausalLM`, and the hub checkpoints' remote-code name `PhiMoEForCausalLM`): Mixtral-like
layers (16 experts, 2 a token) with

- nn.LayerNorm with a bias for the input, post-attention and final norms (`layers.layernorm.LayerNorm(bias=True)`),
  eps from `rms_norm_eps`;
- a bias on q/k/v and o_proj (`attention_bias`) and on the LM head (`lm_head_bias`);
- LongRoPE whose cos/sin are scaled by the config's `short_mscale` / `long_mscale` (not LongRoPE's computed
  attention factor). The frequencies are divided by `short_factor` below `original_max_position_embeddings` and
  by `long_factor` from there on, each with its mscale, by position (as Phi-3's here: a cached key never depends on
  the batch it was computed in). transformers 5 recomputes the frequencies in each forward without the sequence
  length, so it turns every position with the short factors (and picks the mscale by the forward's longest
  position); Microsoft's reference code switches a whole forward to the long factors past the original context.
  Up to the original context (4,096 tokens for the release) all three agree;
- the sparsemixer router, at inference: the first expert is the top logit, weighted by the softmax over the logits
  within a relative distance 2 * `router_jitter_noise` of it ((top - s) / max(|s|, top) <= 2 eps; the others are
  masked out); the second is the top of the rest, weighted the same way over the rest within that distance of it.
  The weights are not renormalised. The fused top-k kernels do not express this selection: it runs as torch ops
  (`sparsemixer`), the experts through FusedMoE.run_experts (as ERNIE's and Llama 4's custom routers).
  `input_jitter_noise` and the router's sampling act in training only. num_experts_per_tok must be 2 (the router
  always picks two, whatever top_k says).

Checkpoints name the block `block_sparse_moe` (router `gate`, experts w1 / w3 / w2); transformers 5's
`mlp.router` / stacked names load too. GGUF files of Phi-3.5-MoE are refused (`configs/model_config.py`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from radixserve.layers.layernorm import LayerNorm
from radixserve.layers.moe import FusedMoE, MoEGate, RouterConfig
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead
from radixserve.models.llama import (
    LlamaDecoderLayer,
    LlamaModel,
    attention_head_dim,
    check_hidden_act,
    rope_params,
)
from radixserve.models.qwen2_moe import MoECausalLM
from radixserve.models.ungated import PreNormForward

if TYPE_CHECKING:
    pass

# checkpoint (and transformers 5) names -> ours
_RENAMES = ((".block_sparse_moe.", ".mlp."), (".mlp.router.", ".mlp.gate."))
_STACKED = {"experts.gate_up_proj": "experts.w13_weight", "experts.down_proj": "experts.w2_weight"}


def sparsemixer(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, 2] in the logits' dtype, expert ids int32 [T, 2]): transformers' `sparsemixer` at inference."""
    masked = float("-inf")
    top1, ind1 = logits.max(dim=-1, keepdim=True)
    far = (top1 - logits) / logits.abs().clamp(min=top1) > 2 * jitter_eps
    w1 = logits.masked_fill(far, masked).softmax(dim=-1).gather(-1, ind1)
    rest = logits.scatter(-1, ind1, masked)
    top2, ind2 = rest.max(dim=-1, keepdim=True)
    far = (top2 - logits) / logits.abs().clamp(min=top2) > 2 * jitter_eps
    w2 = rest.masked_fill(far, masked).softmax(dim=-1).gather(-1, ind2)
    return torch.cat((w1, w2), dim=-1), torch.cat((ind1, ind2), dim=-1).to(torch.int32)


class PhimoeMoE(nn.Module):
    """Router (float32 logits, sparsemixer), routed experts, one all-reduce at the end under tensor parallelism."""

    def __init__(self, config: Any, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, int(config.num_local_experts)
        self.tp_size = tp_size
        self.jitter_eps = float(getattr(config, "router_jitter_noise", 0.01))
        if not self.jitter_eps >= 0:
            raise ValueError(f"router_jitter_noise must be >= 0; got {self.jitter_eps}")
        self.gate = MoEGate(hidden, experts)
        router = RouterConfig(experts, 2, "softmax")  # (the routing is `sparsemixer`'s; this sizes the experts)
        self.experts = FusedMoE(router, hidden, config.intermediate_size, tp_rank, tp_size, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sparsemixer(self.gate(x), self.jitter_eps)
        out = self.experts.run_experts(x, weights.float(), ids)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


def phimoe_mlp(config: Any, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    return PhimoeMoE(config, tp_rank, tp_size)


def _longrope_regions(config: Any, scaling: dict[str, Any], theta: float, head_dim: int
                      ) -> list[tuple[int, torch.Tensor, float]]:
    """[(first position, frequencies, mscale)] of the short and the long region, the frequencies as transformers
    computes them (1 / (factor * theta ** (2i / d)), bit for bit). Checked in Python (no tensor is read: the model
    may be built on the meta device)."""
    original = scaling.get("original_max_position_embeddings") or \
        getattr(config, "original_max_position_embeddings", None)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"Phi-3.5-MoE longrope needs original_max_position_embeddings; got {original!r}")
    dims = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    regions = []
    for first, kind in ((0, "short"), (original, "long")):
        factors, mscale = scaling.get(f"{kind}_factor"), scaling.get(f"{kind}_mscale")
        if isinstance(mscale, bool) or not isinstance(mscale, (int, float)) or not mscale > 0:
            raise ValueError(f"Phi-3.5-MoE longrope needs a positive {kind}_mscale; got {mscale!r}")
        if not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2 or not all(
                isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in factors):
            raise ValueError(f"longrope {kind}_factor: expected {head_dim // 2} positive values (head_dim / 2)")
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** dims)
        regions.append((first, inv_freq, float(mscale)))
    return regions


class PhimoeRotaryEmbedding(RotaryEmbedding):
    """LongRoPE with the config's mscales: short_mscale below the original context, long_mscale from there on."""

    def __init__(self, config: Any, table_positions: int | None = None) -> None:
        theta, scaling = rope_params(config)
        head_dim = attention_head_dim(config)
        share = (scaling or {}).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        if share not in (None, 1, 1.0):
            raise ValueError("Phi-3.5-MoE does not support partial_rotary_factor")
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind in ("longrope", "su"):
            self.__dict__["_regions"] = _longrope_regions(config, scaling, theta, head_dim)  # read by _tables,
        elif kind not in ("default", None):                                                 # which the base calls
            raise ValueError(f"Phi-3.5-MoE rope scaling {kind!r} is not supported (default, longrope)")
        super().__init__(head_dim, config.max_position_embeddings, theta, None, table_positions=table_positions)

    def _tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        regions = self.__dict__.get("_regions")
        if regions is None:
            return super()._tables(num_positions)
        device = regions[0][1].device  # (where the model was built; `cover` may call this outside that context)
        cos = torch.empty(num_positions, self.head_dim // 2, dtype=torch.float32, device=device)
        sin = torch.empty_like(cos)
        for (first, inv_freq, mscale), nxt in zip(regions, [r[0] for r in regions[1:]] + [num_positions],
                                                  strict=True):
            if first >= num_positions:
                break
            last = min(nxt, num_positions)
            freqs = torch.outer(torch.arange(first, last, dtype=torch.float32, device=device), inv_freq)
            cos[first:last], sin[first:last] = freqs.cos() * mscale, freqs.sin() * mscale
        return cos, sin


class PhimoeDecoderLayer(PreNormForward, LlamaDecoderLayer):
    """Pre-norm layer with biased LayerNorms; no fused norm paths (they implement RMSNorm)."""

    def __init__(self, config: Any, layer_id: int, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 qkv_bias: bool = False, qk_norm: bool = False, mlp_factory: Any = phimoe_mlp,
                 attn_sinks: bool = False) -> None:
        super().__init__(config, layer_id, tp_rank, tp_size, rotary, qkv_bias, qk_norm, mlp_factory, attn_sinks)
        eps = float(config.rms_norm_eps)
        self.input_layernorm = LayerNorm(config.hidden_size, eps, bias=True)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps, bias=True)
        self.fuse_reduce = self.mlp_partial = False
        self.self_attn.o_proj.reduce_results = True


class PhimoeModel(LlamaModel):
    layer_cls = PhimoeDecoderLayer

    def __init__(self, config: Any, tp_rank: int, tp_size: int, qkv_bias: bool = False, qk_norm: bool = False,
                 mlp_factory: Any = phimoe_mlp, attn_sinks: bool = False) -> None:
        super().__init__(config, tp_rank, tp_size, qkv_bias, qk_norm, mlp_factory, attn_sinks)
        self.norm = LayerNorm(config.hidden_size, float(config.rms_norm_eps), bias=True)
        self.final_partial = False

    def build_rotary(self, config: Any) -> RotaryEmbedding:
        return PhimoeRotaryEmbedding(config, self.table_positions)


class PhimoeForCausalLM(MoECausalLM):
    mlp_factory = staticmethod(phimoe_mlp)

    def __init__(self, config: Any, tp_rank: int = 0, tp_size: int = 1) -> None:
        top_k = getattr(config, "num_experts_per_tok", 2)
        if top_k != 2:
            raise ValueError(f"Phi-3.5-MoE's sparsemixer router picks 2 experts; num_experts_per_tok={top_k} is not "
                             f"supported")
        super().__init__(config, tp_rank, tp_size)
        if getattr(config, "lm_head_bias", False):
            if self.tie_word_embeddings:
                raise ValueError("lm_head_bias with tied word embeddings is not supported")
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size, bias=True)
            self.model.norm.prefetch_next(self.lm_head)

    def build_model(self, config: Any, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        return PhimoeModel(config, tp_rank, tp_size, bool(getattr(config, "attention_bias", False)), False,
                           self.mlp_factory)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        for hf, ours in _STACKED.items():  # transformers 5's stacked experts: [E, 2I, H] (gate then up), [E, H, I]
            if name.endswith(f".mlp.{hf}"):
                target = name[:-len(hf)] + ours
                if target not in params:
                    raise ValueError(f"weight {name!r} has no stacked expert parameter {target!r}")
                params[target].weight_loader(params[target], tensor, None)
                return target
        return super().load_weight(params, name, tensor)


class PhiMoEForCausalLM(PhimoeForCausalLM):
    """The hub checkpoints' `architectures` name (their remote code's class)."""
