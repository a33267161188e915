"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and DeepSeek-MoE (routed + shared experts; the
first `first_k_dense_replace` layers dense, or those `mlp_layer_types` names dense).

MLA caches per token one compressed latent c = RMSNorm(W_DKV x) (kv_lora_rank values) and one rotated key part
k_pe (qk_rope_head_dim values) shared by all heads. Head h's key is [W_UK_h c, k_pe] and its value W_UV_h c
(W_UK, W_UV: the two halves of kv_b_proj). Attention runs on the latent directly, with the up-projections absorbed
into the query and the output ("weight absorption"):
    q_h · k_h = (W_UK_h^T q_nope_h) · c + q_pe_h · k_pe,      o_h = W_UV_h (sum_j p_hj c_j),
so the backend does multi-query attention with key [c, k_pe] (kv_lora_rank + rope dims), value c, and one KV head,
reading the latent pool (`mem_cache/mla_memory_pool.py`) and never an expanded K/V. Decode and short extends on a
long cached prefix take this path; a prefill, whose cost is the products rather than the reads, expands its keys
through kv_b_proj and attends in the heads' own dimensions (`triton_ops/mla_expanded.py`), 3.4x fewer
multiply-adds a score at DeepSeek's shapes.

The queries come from q_proj (q_lora_rank None, V2-Lite) or q_b_proj(RMSNorm(q_a_proj x)). Rotary dims are
interleaved pairs in DeepSeek's checkpoints (V2 always; V3 when `rope_interleave`), with YaRN scaling as the configs
use it: cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax scale by
mscale(factor, mscale_all_dim)^2.

With --enable-dp-attention each TP rank keeps the whole attention (and embedding, lm_head) and runs it on its own
requests, with its own latent KV pool; the MoE and dense MLP layers stay sharded (or expert-parallel) over the
ranks and work on every rank's tokens at once: each rank gathers max(tokens per rank) rows from every rank
(zero-padded), computes its shard's partial sums for all of them, and a reduce-scatter returns each rank the sums
of its own rows. A rank without requests runs an IDLE forward: no attention, only its part in those collectives."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import (
    dp_attention_gather,
    dp_attention_scatter,
    is_dp_attention_enabled,
    tensor_model_parallel_all_reduce,
)
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from radixserve.layers.logits_processor import LogitsProcessor
from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.layers.moe import FusedMoE, MoEGate, RouterConfig, load_expert_weight
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding, yarn_mscale
from radixserve.layers.triton_ops import use_fused
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.model_executor.piecewise_graph_runner import active_capture
from radixserve.models.llama import LlamaForCausalLM, LlamaMLP, check_hidden_act, load_plain, rope_params
from radixserve.models.qwen2_moe import norm_then_moe

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch


# tokens up to which q absorption, rotary, the latent norm and store run fused (`mla_prep.py`); None: every batch
FUSED_PREP_TOKENS: int | None = None
# prefills whose lengths favour it run in the expanded (multi-head) form (`_attend_expanded`); RADIXSERVE_MLA_EXPANDED=0
# keeps every extend in the latent form
EXPANDED_PREFILL = os.environ.get("RADIXSERVE_MLA_EXPANDED", "1") != "0"


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

    def use_decode_gemv(self) -> None:
        """One-row products through the one-row GEMV (`triton_ops.gemv`): the two projections of the input in one
        launch (with the input norm, `norm_project`) and o_proj without cuBLAS's split-K."""
        for proj in (self.q_a_proj if self.q_lora_rank else self.q_proj, self.kv_a_proj_with_mqa, self.o_proj):
            proj.decode_gemv = True

    def norm_project(self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(q or q_a, kv_a, new residual) of one row from a single launch: the residual add, the input norm and
        both projections of its output; None when the one-row GEMV does not apply."""
        first = self.q_a_proj if self.q_lora_rank else self.q_proj
        kv = self.kv_a_proj_with_mqa
        if not (first.gemv_ok(hidden) and kv.gemv_ok(hidden)) or first.bias is not None or kv.bias is not None:
            return None
        from radixserve.layers.triton_ops.gemv import gemv_row_norm

        out, new_residual = gemv_row_norm(hidden, first.weight, None, kv.weight,
                                          norm=(residual, norm.weight, norm.eps))
        n = first.weight.shape[0]
        return out[:, :n], out[:, n:], (hidden if new_residual is None else new_residual)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | None, forward_batch: ForwardBatch,
                projected: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """projected: (q_proj's or q_a_proj's output, kv_a_proj_with_mqa's output) already made (`norm_project`)."""
        if projected is not None:
            first, kv_a = projected
        else:
            first = self.q_a_proj(hidden) if self.q_lora_rank else self.q_proj(hidden)
            kv_a = self.kv_a_proj_with_mqa(hidden)
        t = first.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(first)) if self.q_lora_rank else first
        q = q.view(t, self.num_heads, self.nope + self.rope)
        capture = active_capture()
        if capture is not None:  # a piecewise CUDA graph ends here: the attention's form depends on the lengths
            return self.o_proj(capture.cut(self, self._attend, (positions, q, kv_a), forward_batch))
        return self.o_proj(self._attend(positions, q, kv_a, forward_batch))

    def _attend(self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor, forward_batch: ForwardBatch
                ) -> torch.Tensor:
        """Everything between the projections and o_proj: [T, H * v_head_dim] from q [T, H, nope + rope] and
        kv_a [T, rank + rope], in the expanded form or the latent one (with the absorptions)."""
        t = q.shape[0]
        if self._expanded_fits(q, forward_batch):
            return self._attend_expanded(positions, q, kv_a, forward_batch)
        w_kc, w_vc = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank).split(
            [self.nope, self.v_dim], dim=1)  # [H, nope, rank], [H, v, rank]
        if 0 < t <= (FUSED_PREP_TOKENS or t) and use_fused(q) and w_kc.dtype == q.dtype and q.stride(2) == 1 \
                and kv_a.stride(1) == 1:
            q_full, k_full, saved = self._prep_fused(positions, q, kv_a, w_kc, forward_batch)
            o = self.attn(q_full.reshape(t, -1), k_full, k_full[:, :self.rank], forward_batch,
                          save_kv_cache=not saved)
            from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted
            from radixserve.layers.attention.triton_ops.mla_prep import mla_absorb_out

            return mla_absorb_out(o.view(t, self.num_heads, self.rank), w_vc, is_interpreted())
        o = self._attend_unfused(positions, q, kv_a, w_kc, forward_batch)
        o = torch.bmm(o.view(t, self.num_heads, self.rank).transpose(0, 1), w_vc.transpose(1, 2))  # [H, T, v]
        return o.transpose(0, 1).reshape(t, self.num_heads * self.v_dim)

    def _expanded_fits(self, q: torch.Tensor, forward_batch: ForwardBatch) -> bool:
        """A prefill (no decodes riding along) on CUDA or under the Triton interpreter, with a latent pool of the
        activations' dtype, whose lengths make the expanded form the cheaper one (`mla_expanded.expanded_pays`)."""
        from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted
        from radixserve.layers.attention.triton_ops.mla_expanded import expanded_pays
        from radixserve.model_executor.forward_batch_info import ForwardMode

        fb = forward_batch
        if not EXPANDED_PREFILL or fb.forward_mode != ForwardMode.EXTEND or fb.extend_seq_lens_cpu is None \
                or fb.extend_prefix_lens_cpu is None or fb.out_cache_loc is None or q.shape[0] == 0 \
                or not (q.is_cuda or is_interpreted()) or self.kv_b_proj.weight.dtype != q.dtype \
                or getattr(self.kv_b_proj, "lora", None) is not None:  # the latent form reads its weight alone
            return False
        pool_rows = fb.token_to_kv_pool.get_kv_buffer(self.attn.layer_id)[0]
        if pool_rows.dtype != q.dtype or not pool_rows.is_contiguous():
            return False
        return expanded_pays(fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu, self.num_heads, self.rank,
                             self.rope, self.nope, self.v_dim)

    def _attend_expanded(self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor,
                         fb: ForwardBatch) -> torch.Tensor:
        """A prefill in the expanded form (`triton_ops/mla_expanded.py`): one launch rotates q_pe and writes the new
        tokens' key rows into the pool (`mla_expanded_prep`), every key of each request (its cached prefix too) is
        expanded through kv_b_proj, and the heads attend in their own dimensions; returns [T, H * v_head_dim] for
        o_proj."""
        from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted
        from radixserve.layers.attention.triton_ops.mla_expanded import mla_expanded_extend
        from radixserve.layers.attention.triton_ops.mla_prep import mla_expanded_prep

        t = q.shape[0]
        rot, norm = self.rotary_emb, self.kv_a_layernorm
        rows = fb.token_to_kv_pool.get_kv_buffer(self.attn.layer_id)[0].view(-1, self.rank + self.rope)
        q = mla_expanded_prep(q, kv_a, positions, rot.cos_cache, rot.sin_cache, norm.weight, norm.eps,
                              rot.is_neox_style, rows, fb.out_cache_loc, is_interpreted())
        ext, pre = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        if any(pre):  # each request's keys from the pool: its prefix and (stored just now) its new tokens
            if fb.mla_key_layout is None:  # the same for every layer: built once a forward
                fb.mla_key_layout = _key_layout(fb, [e + p for e, p in zip(ext, pre, strict=True)])
            slots, kv_start, kv_lens_d = fb.mla_key_layout
            keys = rows[slots]
        else:
            keys, kv_lens_d, kv_start = rows[fb.out_cache_loc], fb.extend_seq_lens, fb.extend_start_loc
        kv = self.kv_b_proj(keys[:, :self.rank]).view(-1, self.num_heads, self.nope + self.v_dim)
        o = torch.empty((t, self.num_heads, self.v_dim), dtype=q.dtype, device=q.device)
        mla_expanded_extend(q, kv[..., :self.nope], kv[..., self.nope:], keys[:, self.rank:], o,
                            fb.extend_start_loc, kv_start, fb.extend_seq_lens, kv_lens_d, max(ext),
                            self.attn.scaling)
        return o.view(t, self.num_heads * self.v_dim)

    def _prep_fused(self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor, w_kc: torch.Tensor,
                    forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """q_full and the key rows from one kernel (`mla_prep.py`); the key rows go straight into the latent pool
        when its dtype is the activations' (then the returned k_full is only kv_a, which the backend does not read,
        and `saved` is True)."""
        from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted
        from radixserve.layers.attention.triton_ops.mla_prep import mla_decode_prep

        rot = self.rotary_emb
        loc = forward_batch.out_cache_loc
        pool = forward_batch.token_to_kv_pool
        kv_buf = pool.get_kv_buffer(self.attn.layer_id)[0] if loc is not None else None
        saved = kv_buf is not None and kv_buf.dtype == q.dtype and kv_buf.is_contiguous()
        k_out = kv_buf.view(-1, kv_buf.shape[-1]) if saved else \
            torch.empty((q.shape[0], self.rank + self.rope), dtype=q.dtype, device=q.device)
        q_full = mla_decode_prep(q, kv_a, positions, rot.cos_cache, rot.sin_cache, w_kc, self.kv_a_layernorm.weight,
                                 self.kv_a_layernorm.eps, rot.is_neox_style, k_out, loc if saved else None,
                                 is_interpreted())
        return q_full, (kv_a if saved else k_out), saved

    def _attend_unfused(self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor, w_kc: torch.Tensor,
                        forward_batch: ForwardBatch) -> torch.Tensor:
        t = q.shape[0]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = kv_a.split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)  # [T, H, rank]
        q_full = torch.cat([q_latent, q_pe.reshape(t, self.num_heads, self.rope)], dim=-1)
        k_full = torch.cat([latent, k_pe.reshape(t, self.rope)], dim=-1)  # [T, rank + rope]
        return self.attn(q_full.reshape(t, -1), k_full, latent, forward_batch)  # [T, H * rank]


def _key_layout(fb: ForwardBatch, kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pool slots of every request's first kv_lens[b] tokens, request after request, with each request's first
    row among them and its count (device tensors; no host sync)."""
    dev = fb.req_pool_indices.device
    total = sum(kv_lens)
    lens = torch.tensor(kv_lens, dtype=torch.int64).to(dev, non_blocking=True)
    starts = torch.cumsum(lens, 0) - lens
    rows = torch.repeat_interleave(fb.req_pool_indices.to(torch.int64), lens, output_size=total)
    cols = torch.arange(total, device=dev) - torch.repeat_interleave(starts, lens, output_size=total)
    return fb.req_to_token_pool.req_to_token[rows, cols].to(torch.int64), starts, lens


class DeepseekMoE(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, v3: bool,
                 reduce_results: bool = True) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, config.n_routed_experts
        self.tp_size = tp_size
        self.reduce_results = reduce_results
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
        return self._finish(x, self.experts.forward_gated(x, self.gate))

    def forward_norm(self, hidden: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm_then_moe(self, hidden, residual, norm)

    def _finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is not None and not self.experts.shared_folded(x):
            out = out + self.shared_experts(x)
        if self.tp_size > 1 and self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out


def is_moe_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """Whether layer `layer_id` runs the MoE: its entry of `mlp_layer_types` ("dense" / "sparse", GLM-4.7-Flash's
    config) where the config has that list, else every layer from `first_k_dense_replace` on."""
    types = getattr(config, "mlp_layer_types", None)
    if types is None:
        return layer_id >= (getattr(config, "first_k_dense_replace", 0) or 0)
    if len(types) != config.num_hidden_layers or not set(types) <= {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of the {config.num_hidden_layers} "
                         f"layers, got {types}")
    return types[layer_id] == "sparse"


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int, v3: bool,
                 rotary_emb: RotaryEmbedding, dp_attention: bool = False) -> None:
        super().__init__()
        self.dp_attention = dp_attention  # attention whole on every rank, the MLP sharded over all ranks' tokens
        attn_rank, attn_size = (0, 1) if dp_attention else (tp_rank, tp_size)
        self.self_attn = DeepseekMLAAttention(config, layer_id, attn_rank, attn_size, rotary_emb)
        if is_moe_layer(config, layer_id):
            self.mlp = DeepseekMoE(config, tp_rank, tp_size, v3, reduce_results=not dp_attention)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size,
                                reduce_results=not dp_attention)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.dp_attention and forward_batch.forward_mode.is_idle()):  # IDLE: a DP rank without requests
            projected = self.self_attn.norm_project(hidden, residual, self.input_layernorm)
            if projected is not None:  # one row: the residual add, the norm and both projections in one launch
                first, kv_a, residual = projected
                hidden = self.self_attn(positions, None, forward_batch, projected=(first, kv_a))
            else:
                if residual is None:
                    residual = hidden
                    hidden = self.input_layernorm(hidden)
                else:
                    hidden, residual = self.input_layernorm(hidden, residual)
                hidden = self.self_attn(positions, hidden, forward_batch)
            if isinstance(self.mlp, DeepseekMoE) and not self.dp_attention:  # the norm in the router's launch
                return self.mlp.forward_norm(hidden, residual, self.post_attention_layernorm)
            hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.dp_attention:
            rows = max(forward_batch.dp_num_tokens)
            return dp_attention_scatter(self.mlp(dp_attention_gather(hidden, rows)), hidden.shape[0]), residual
        return self.mlp(hidden), residual


class DeepseekModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, v3: bool,
                 interleaved_rope: bool, dp_attention: bool = False) -> None:
        super().__init__()
        emb_rank, emb_size = (0, 1) if dp_attention else (tp_rank, tp_size)
        self.dp_attention = dp_attention
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, emb_rank, emb_size)
        theta, scaling = rope_params(config)
        rotary = RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings, theta, scaling,
                                 is_neox_style=not interleaved_rope)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i, tp_rank, tp_size, v3, rotary, dp_attention)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        if self.dp_attention and forward_batch.forward_mode.is_idle():
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    v3 = False
    decode_gemv_attention = True  # V2-Lite: q_proj + kv_a 15 MB, o_proj 8 MB (one-row products, `use_decode_gemv`)
    stacked_params = [("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)]

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        nn.Module.__init__(self)
        if not getattr(config, "kv_lora_rank", None):
            raise ValueError(f"{type(self).__name__} needs an MLA config (kv_lora_rank)")
        check_hidden_act(config)
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.dp_attention = is_dp_attention_enabled() and tp_size > 1
        interleaved = bool(getattr(config, "rope_interleave", True)) if self.v3 else True
        self.model = DeepseekModel(config, tp_rank, tp_size, self.v3, interleaved, self.dp_attention)
        if self.decode_gemv_attention:
            for layer in self.model.layers:
                layer.self_attn.use_decode_gemv()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            head_rank, head_size = (0, 1) if self.dp_attention else (tp_rank, tp_size)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, head_rank, head_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        hidden = self.model(input_ids, positions, forward_batch)
        if self.dp_attention and forward_batch.forward_mode.is_idle():
            return LogitsProcessorOutput(next_token_logits=hidden.new_empty(0, self.config.vocab_size).float())
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
    decode_gemv_attention = False  # its projections (7168 wide) were not measured against cuBLAS
