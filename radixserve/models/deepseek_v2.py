"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and DeepSeek-MoE (routed + shared experts; the
first `first_k_dense_replace` layers dense).

MLA caches per token one compressed latent c = RMSNorm(W_DKV x) (kv_lora_rank values) and one rotated key part
k_pe (qk_rope_head_dim values) shared by all heads. Head h's key is [W_UK_h c, k_pe] and its value W_UV_h c
(W_UK, W_UV: the two halves of kv_b_proj). Attention runs on the latent directly, with the up-projections absorbed
into the query and the output ("weight absorption"):
    q_h · k_h = (W_UK_h^T q_nope_h) · c + q_pe_h · k_pe,      o_h = W_UV_h (sum_j p_hj c_j),
so the backend does multi-query attention with key [c, k_pe] (kv_lora_rank + rope dims), value c, and one KV head,
reading the latent pool (`mem_cache/mla_memory_pool.py`) and never an expanded K/V. Prefill, chunked prefill on a
cached prefix and decode all take this path.

The queries come from q_proj (q_lora_rank None, V2-Lite) or q_b_proj(RMSNorm(q_a_proj x)). Rotary dims are
interleaved pairs in DeepSeek's checkpoints (V2 always; V3 when `rope_interleave`), with YaRN scaling as the configs
use it: cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax scale by
mscale(factor, mscale_all_dim)^2."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from radixserve.layers.logits_processor import LogitsProcessor
from radixserve.layers.moe import FusedMoE, MoEGate, RouterConfig, load_expert_weight
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding, yarn_mscale
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.models.llama import LlamaForCausalLM, LlamaMLP, load_plain, rope_params

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.layers.logits_processor_output import LogitsProcessorOutput
    from radixserve.model_executor.forward_batch_info import ForwardBatch


class DeepseekMLAAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        if heads % tp_size:
            raise ValueError(f"{heads} attention heads are not divisible by the tensor parallel size {tp_size}")
        self.num_heads = heads // tp_size
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        bias = bool(getattr(config, "attention_bias", False))
        qk_dim = self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_dim, False, tp_rank, tp_size)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, False, tp_rank, tp_size)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.rank + self.rope, bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim), False, tp_rank, tp_size)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias, tp_rank, tp_size)
        self.rotary_emb = rotary_emb  # one instance shared by every layer (its cos/sin tables cover the context)
        _, scaling = rope_params(config)
        softmax_scale = qk_dim ** -0.5
        if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("mscale_all_dim"):
            m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
            softmax_scale *= m * m
        self.attn = RadixAttention(self.num_heads, self.rank + self.rope, softmax_scale, 1, layer_id,
                                   v_head_dim=self.rank)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        t = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        w_kc, w_vc = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank).split(
            [self.nope, self.v_dim], dim=1)  # [H, nope, rank], [H, v, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)  # [T, H, rank]
        q_full = torch.cat([q_latent, q_pe.reshape(t, self.num_heads, self.rope)], dim=-1)
        k_full = torch.cat([latent, k_pe.reshape(t, self.rope)], dim=-1)  # [T, rank + rope]
        o = self.attn(q_full.reshape(t, -1), k_full, latent, forward_batch)  # [T, H * rank]
        o = torch.bmm(o.view(t, self.num_heads, self.rank).transpose(0, 1), w_vc.transpose(1, 2))  # [H, T, v]
        return self.o_proj(o.transpose(0, 1).reshape(t, self.num_heads * self.v_dim))


class DeepseekMoE(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, v3: bool) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, config.n_routed_experts
        self.tp_size = tp_size
        if v3:
            router = RouterConfig(num_experts, config.num_experts_per_tok, "sigmoid",
                                  bool(getattr(config, "norm_topk_prob", True)), config.n_group, config.topk_group,
                                  "top2_sum", float(config.routed_scaling_factor))
        else:
            grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
            router = RouterConfig(num_experts, config.num_experts_per_tok, "softmax",
                                  bool(getattr(config, "norm_topk_prob", False)) and config.num_experts_per_tok > 1,
                                  config.n_group if grouped else None, config.topk_group if grouped else None,
                                  "max", float(config.routed_scaling_factor))
        self.gate = MoEGate(hidden, num_experts, correction_bias=v3)
        self.experts = FusedMoE(router, hidden, config.moe_intermediate_size, tp_rank, tp_size, reduce_results=False)
        shared = (getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
        self.shared_experts = LlamaMLP(hidden, shared, False, tp_rank, tp_size, reduce_results=False) \
            if shared else None
        if self.shared_experts is not None:  # small batches: computed in the experts' own two launches
            self.experts.attach_shared_experts(self.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x), self.gate.e_score_correction_bias)
        if self.shared_experts is not None and not self.experts.shared_folded(x):
            out = out + self.shared_experts(x)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int, v3: bool,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DeepseekMLAAttention(config, layer_id, tp_rank, tp_size, rotary_emb)
        if layer_id >= (getattr(config, "first_k_dense_replace", 0) or 0):
            self.mlp = DeepseekMoE(config, tp_rank, tp_size, v3)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, v3: bool,
                 interleaved_rope: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        theta, scaling = rope_params(config)
        rotary = RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings, theta, scaling,
                                 is_neox_style=not interleaved_rope)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i, tp_rank, tp_size, v3, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    v3 = False
    stacked_params = [("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)]

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        nn.Module.__init__(self)
        if not getattr(config, "kv_lora_rank", None):
            raise ValueError(f"{type(self).__name__} needs an MLA config (kv_lora_rank)")
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        interleaved = bool(getattr(config, "rope_interleave", True)) if self.v3 else True
        self.model = DeepseekModel(config, tp_rank, tp_size, self.v3, interleaved)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        hidden = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(hidden, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        n = self.config.num_hidden_layers
        # DeepSeek-V3 checkpoints carry the multi-token-prediction module as layer num_hidden_layers: not served here
        super().load_weights((name, t) for name, t in weights
                             if not name.startswith(f"model.layers.{n}."))

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        target = load_expert_weight(params, name, tensor)
        if target is not None:
            return target
        if name.endswith("e_score_correction_bias") and name in params:
            load_plain(params[name], name, tensor.float())
            return name
        return super().load_weight(params, name, tensor)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    v3 = True
