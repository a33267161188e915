"""DBRX (`DbrxForCausalLM`: dbrx-base, dbrx-instruct; 132 B parameters, 36 B active): a pre-norm MoE model with

- bias-free LayerNorms (`norm_1`, `norm_2`, `norm_f`; nn.LayerNorm(bias=False), eps 1e-5) in place of RMSNorms;
- attention from one fused `Wqkv` [q | k | v] (no biases; `attn_config.kv_n_heads` KV heads), whose output is
  clamped to [-clip_qkv, clip_qkv] (`attn_config.clip_qkv`, 8 in the release) before it is split and rotated. The
  fused tensor is split into q / k / v at load, so each tensor-parallel rank takes its heads' rows of each; the
  clamp is elementwise, so it is the same on a rank's slice. No fused q/k/v + rotation path is taken (it would skip
  the clamp);
- a MoE block in every layer: softmax over `ffn_config.moe_num_experts` (16) router logits, the top `moe_top_k` (4)
  divided by their p-norm (`moe_normalize_expert_weights`, p = 1 in the release: a renormalisation to sum 1, which
  the fused top-k kernels serve; another p runs the selection as torch ops; null leaves the weights as they are);
- the experts stored fused per matrix: `ffn.experts.mlp.w1` (gate), `v1` (up) and `w2` (down, stored transposed),
  each [E * I, H]. They load one expert at a time into FusedMoE's stacked parameters (each rank its intermediate
  slice, or its experts under --ep-size); no module is built per expert.

The rotary base is `attn_config.rope_theta` (500,000 in the release), as DBRX was trained and as transformers 4
computed it. transformers 5.x reads only a top-level `rope_theta` / `rope_parameters` and turns a release config
(which has none) with 10,000: the two agree only where the config carries both (the tests' configs do).
`moe_jitter_eps` and the dropouts act in training only. Tied embeddings (transformers refuses them), an activation
other than SiLU and GGUF files are refused."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from radixserve.layers.layernorm import LayerNorm
from radixserve.layers.moe import FusedMoE, MoEGate, RouterConfig
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.vocab_parallel_embedding import VocabParallelEmbedding
from radixserve.models.llama import LlamaAttention, LlamaForCausalLM, attention_head_dim, rope_params
from radixserve.models.ungated import PreNormForward

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
    from radixserve.model_executor.forward_batch_info import ForwardBatch

_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.(.+)$")
# checkpoint names inside a block -> ours inside model.layers.<i>
_RENAMES = {"norm_attn_norm.norm_1.weight": "input_layernorm.weight",
            "norm_attn_norm.norm_2.weight": "post_attention_layernorm.weight",
            "norm_attn_norm.attn.out_proj.weight": "self_attn.o_proj.weight",
            "ffn.router.layer.weight": "mlp.gate.weight"}
_EXPERTS = {"ffn.experts.mlp.w1": "w1", "ffn.experts.mlp.v1": "w3", "ffn.experts.mlp.w2": "w2"}
_TOP = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.norm_f.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def sub_config(config: PretrainedConfig, name: str) -> dict[str, Any]:
    """attn_config / ffn_config as a dict (transformers keeps them as sub-config objects)."""
    sub = getattr(config, name, None)
    if sub is None:
        return {}
    return dict(sub) if isinstance(sub, dict) else dict(vars(sub))


def normalize_p(config: PretrainedConfig) -> float | None:
    """moe_normalize_expert_weights: the p of the norm the top-k weights are divided by (None: not divided)."""
    p = sub_config(config, "ffn_config").get("moe_normalize_expert_weights", 1.0)
    if p is None:
        return None
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
        raise ValueError(f"moe_normalize_expert_weights must be a positive number (or inf) or null; got {p!r}")
    return float(p)


def check_config(config: PretrainedConfig) -> None:
    ffn, attn = sub_config(config, "ffn_config"), sub_config(config, "attn_config")
    act = (ffn.get("ffn_act_fn") or {"name": "silu"}).get("name", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"ffn_act_fn {act!r} is not supported for DBRX (supported: silu)")
    if bool(getattr(config, "tie_word_embeddings", False)):
        raise ValueError("tie_word_embeddings is not supported for DBRX (transformers refuses it too)")
    for key in ("moe_num_experts", "moe_top_k", "ffn_hidden_size"):
        value = ffn.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"ffn_config.{key} must be a positive integer; got {value!r}")
    clip = attn.get("clip_qkv")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        raise ValueError(f"attn_config.clip_qkv must be a positive number or null; got {clip!r}")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"d_model {config.hidden_size} is not divisible by n_heads {config.num_attention_heads}")
    normalize_p(config)


def dbrx_rotary(config: PretrainedConfig) -> RotaryEmbedding:
    """The rotary tables: attn_config.rope_theta where it is set (see the module's note), the rope_parameters'
    theta otherwise; a rope scaling in rope_parameters is applied as transformers does."""
    theta, scaling = rope_params(config)
    own = sub_config(config, "attn_config").get("rope_theta")
    if own is not None:
        if isinstance(own, bool) or not isinstance(own, (int, float)) or not own > 0:
            raise ValueError(f"attn_config.rope_theta must be a positive number; got {own!r}")
        theta = float(own)
    if scaling is not None and scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor is not supported for DBRX")
    return RotaryEmbedding(attention_head_dim(config), config.max_position_embeddings, theta, scaling)


class DbrxLayerNorm(LayerNorm):
    """nn.LayerNorm(bias=False) as transformers computes it: torch's layer_norm in x's dtype."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight.to(x.dtype), None, self.eps)


class DbrxAttention(LlamaAttention):
    """Llama's attention (no biases) with the clamp of the fused q/k/v output; none of the fused paths that
    project and rotate in one launch (they would leave the clamp out)."""

    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, tp_rank, tp_size, rotary, qkv_bias=False, o_bias=False)
        clip = sub_config(config, "attn_config").get("clip_qkv")
        self.clip = None if clip is None else float(clip)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | None, forward_batch: ForwardBatch,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        if qkv is None:
            if hidden is None:
                raise ValueError("DbrxAttention needs the hidden states or their q/k/v projection")
            qkv = self.qkv_proj(hidden)
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        kv_write = self._kv_write(q, k, v, forward_batch)
        q, k = self.rotary_emb(positions, q, k, kv_write)
        return self._out(self.attn(q, k, v, forward_batch, save_kv_cache=kv_write is None))

    def normed_forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                       norm: nn.Module, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def _rope_args(self, positions: torch.Tensor, hidden: torch.Tensor,
                   forward_batch: ForwardBatch) -> RopeArgs | None:
        return None

    def _qkv_rope(self, positions: torch.Tensor, hidden: torch.Tensor | None,
                  forward_batch: ForwardBatch) -> torch.Tensor | None:
        return None


class DbrxMoE(nn.Module):
    """Router (softmax, top-k, divided by the p-norm of the chosen weights) and the experts; one all-reduce."""

    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        ffn = sub_config(config, "ffn_config")
        hidden, experts, top_k = config.hidden_size, ffn["moe_num_experts"], ffn["moe_top_k"]
        self.tp_size = tp_size
        self.p = normalize_p(config)
        self.gate = MoEGate(hidden, experts)
        # p = 1: weights / their sum (softmax scores are positive), the router's renormalisation (fused kernels too)
        router = RouterConfig(experts, top_k, "softmax", renormalize=self.p == 1.0)
        self.experts = FusedMoE(router, hidden, ffn["ffn_hidden_size"], tp_rank, tp_size, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p is None or self.p == 1.0:
            out = self.experts.forward_gated(x, self.gate)
        else:
            scores = self.gate(x).float().softmax(dim=-1)
            weights, ids = scores.topk(self.experts.router.top_k, dim=-1)
            ord_ = math.inf if math.isinf(self.p) else self.p
            weights = weights / torch.linalg.vector_norm(weights, ord=ord_, dim=-1, keepdim=True)
            out = self.experts.run_experts(x, weights, ids.to(torch.int32))
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


class DbrxDecoderLayer(PreNormForward, nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DbrxAttention(config, layer_id, tp_rank, tp_size, rotary)
        self.mlp = DbrxMoE(config, tp_rank, tp_size)
        self.input_layernorm = DbrxLayerNorm(config.hidden_size, 1e-5)
        self.post_attention_layernorm = DbrxLayerNorm(config.hidden_size, 1e-5)


class DbrxModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        # as LlamaModel untied: the embedding whole on every rank
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, 0, 1)
        rotary = dbrx_rotary(config)
        self.layers = nn.ModuleList(DbrxDecoderLayer(config, i, tp_rank, tp_size, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = DbrxLayerNorm(config.hidden_size, 1e-5)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class DbrxForCausalLM(LlamaForCausalLM):
    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        check_config(config)
        super().__init__(config, tp_rank, tp_size)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        return DbrxModel(config, tp_rank, tp_size)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if name in _TOP:
            return super().load_weight(params, _TOP[name], tensor)
        m = _BLOCK.match(name)
        if m is None:
            raise ValueError(f"unexpected weight {name!r} for DbrxForCausalLM")
        prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest in _RENAMES:
            return super().load_weight(params, prefix + _RENAMES[rest], tensor)
        if rest == "norm_attn_norm.attn.Wqkv.weight":
            return self._load_wqkv(params, prefix + "self_attn.qkv_proj.weight", name, tensor)
        if rest in _EXPERTS:
            return self._load_experts(params, prefix, name, _EXPERTS[rest], tensor)
        raise ValueError(f"unexpected weight {name!r} for DbrxForCausalLM (quantized DBRX checkpoints are not "
                         f"supported)")

    def _load_wqkv(self, params: dict[str, nn.Parameter], target: str, name: str, tensor: torch.Tensor) -> str:
        """The fused [q | k | v] rows split into q, k and v; each rank takes its heads' rows of each."""
        cfg = self.config
        head_dim = attention_head_dim(cfg)
        kv_rows = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
        sizes = [cfg.num_attention_heads * head_dim, kv_rows, kv_rows]
        if tensor.dim() != 2 or tensor.shape[0] != sum(sizes) or tensor.dtype not in _FLOATS:
            raise ValueError(f"{name}: expected a {sum(sizes)} x {cfg.hidden_size} float tensor (q, k, v rows), "
                             f"got {tuple(tensor.shape)} {tensor.dtype}")
        for shard, part in zip("qkv", tensor.split(sizes), strict=True):
            params[target].weight_loader(params[target], part, shard)
        return target

    def _load_experts(self, params: dict[str, nn.Parameter], prefix: str, name: str, shard: str,
                      tensor: torch.Tensor) -> str:
        """w1 / v1 / w2 [E * I, H]: expert e's rows e * I .. (e + 1) * I; w2's are down's transpose."""
        target = prefix + ("mlp.experts.w2_weight" if shard == "w2" else "mlp.experts.w13_weight")
        experts = self.model.layers[0].mlp.experts
        e, i, h = experts.num_experts, experts.intermediate_size, experts.hidden_size
        if tuple(tensor.shape) != (e * i, h) or tensor.dtype not in _FLOATS:
            raise ValueError(f"{name}: expected a {e * i} x {h} float tensor ({e} experts of {i} rows), got "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        param = params[target]
        for expert, rows in enumerate(tensor.view(e, i, h)):
            param.weight_loader(param, rows.t() if shard == "w2" else rows, shard, expert)
        return target

