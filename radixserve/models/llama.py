"""Llama family (Llama 2/3, Mistral, SmolLM2). Qwen2 and Qwen3 reuse these blocks with bias / q-k norm switched on.
Parameter names follow Hugging Face, except that q/k/v and gate/up are stacked; `load_weights` maps them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.configs.model_config import sliding_window_size
from radixserve.distributed.parallel_state import custom_all_reduce_fuses_norm
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.logits_processor import LogitsProcessor
from radixserve.layers.quantization.kv_cache import kv_scale_name, set_kv_scale
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.triton_ops import use_fused
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.models.multimodal_text import TextOfMultimodal

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.layers.logits_processor_output import LogitsProcessorOutput
    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
    from radixserve.layers.triton_ops.rotary import KVWrite
    from radixserve.model_executor.forward_batch_info import ForwardBatch


def rope_params(config: PretrainedConfig) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) whether the config keeps them flat (transformers 4) or in rope_parameters (5)."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or (params if params.get("rope_type", "default") != "default"
                                                        else None)
    return float(theta), scaling


def check_hidden_act(config: PretrainedConfig) -> None:
    """Every MLP and expert here computes down(silu(gate(x)) * up(x)): refuse a config naming another activation
    (transformers would apply it; serving SiLU in its place would load and answer differently)."""
    act = getattr(config, "hidden_act", None) or "silu"
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (supported: silu)")


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp_rank: int, tp_size: int,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp_rank, tp_size,
                                           reduce_results=reduce_results)
        self.act_fn = SiluAndMul()
        self.output_scale = 1.0  # Granite's residual_multiplier: the block's output times it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up_proj.silu_and_mul(x)  # fused into the product where the layer can (see silu_and_mul)
        return self._scaled(self.down_proj(act)) if act is not None else self._down(self.gate_up_proj(x))

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.output_scale == 1.0 else out * self.output_scale

    def normed_forward(self, x: torch.Tensor, residual: torch.Tensor,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the block's output, x + residual) with `norm`'s residual add and the norm in gate_up's launch, where its
        quantization method folds them in (`normed_product`); None otherwise (the caller norms and calls the
        block, so that hooks on it fire)."""
        fused = self.gate_up_proj.normed_product(x, residual, norm)
        return None if fused is None else (self._down(fused.out), fused.residual)

    def _down(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = self.down_proj.gated_product(gate_up)  # the activation in down's launch where it can
        return self._scaled(out if out is not None else self.down_proj(self.act_fn(gate_up)))


def input_embedding(config: PretrainedConfig, tp_rank: int, tp_size: int, tied_default: bool = False
                    ) -> VocabParallelEmbedding:
    """The token embedding. Untied, every TP rank holds it whole (one row read a token, no masked lookup and no
    all-reduce; vocab x hidden x 2 bytes more memory a rank); tied (`tie_word_embeddings`, else `tied_default`), it
    is also the LM head, whose product stays split over the ranks."""
    tied = getattr(config, "tie_word_embeddings", None)
    tied = tied_default if tied is None else bool(tied)
    emb_rank, emb_size = (tp_rank, tp_size) if tied else (0, 1)
    return VocabParallelEmbedding(config.vocab_size, config.hidden_size, emb_rank, emb_size)


def attention_head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def model_rotary(config: PretrainedConfig, table_positions: int | None = None) -> RotaryEmbedding:
    """The model's rotary tables, one instance for all its layers (Llama 3.1's 131,072 positions are 64 MB of
    float32 cos/sin: a copy a layer would be 2 GB over 32 layers). `partial_rotary_factor` (top level or in
    rope_parameters) rotates that share of each head; `original_max_position_embeddings` may sit beside a
    transformers-4 config's rope_scaling instead of in it. `table_positions`: see RotaryEmbedding."""
    theta, scaling = rope_params(config)
    head_dim = attention_head_dim(config)
    params = getattr(config, "rope_parameters", None) or {}
    share = params.get("partial_rotary_factor")
    share = getattr(config, "partial_rotary_factor", None) if share is None else share
    share = 1.0 if share is None else float(share)
    if not 0 < share <= 1:  # (a 0 would rotate nothing, not the whole head)
        raise ValueError(f"partial_rotary_factor must be in (0, 1]; got {share}")
    original = getattr(config, "original_max_position_embeddings", None)
    if scaling is not None and original and "original_max_position_embeddings" not in scaling:
        scaling = {**scaling, "original_max_position_embeddings": original}
    return RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling, rotary_dim=int(head_dim * share),
                           table_positions=table_positions)


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 qkv_bias: bool = False, qk_norm: bool = False, scaling: float | None = None,
                 logit_cap: float = 0.0, sinks: bool = False, attention_chunk_size: int = -1,
                 o_bias: bool | None = None) -> None:
        """o_bias: whether o_proj has a bias (None: the config's attention_bias, as Llama's)."""
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = attention_head_dim(config)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, qkv_bias, tp_rank, tp_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Llama's attention_bias puts a bias on o_proj too; Qwen2's q/k/v bias does not.
        o_bias = bool(getattr(config, "attention_bias", False)) if o_bias is None else o_bias
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, o_bias, tp_rank, tp_size)
        self.rotary_emb = rotary  # shared by every layer (model_rotary)
        scaling = self.head_dim ** -0.5 if scaling is None else scaling  # Gemma: query_pre_attn_scalar ** -0.5
        self.attn = RadixAttention(self.num_heads, self.head_dim, scaling, self.num_kv_heads, layer_id,
                                   sliding_window_size=sliding_window_size(config, layer_id), logit_cap=logit_cap,
                                   sinks=sinks,  # GPT-OSS's learned per-head sink logits
                                   first_head=tp_rank * self.num_heads, total_heads=num_heads,
                                   attention_chunk_size=attention_chunk_size)  # Llama 4's chunked layers
        self.output_scale = 1.0  # Granite's residual_multiplier
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | None, forward_batch: ForwardBatch,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        """qkv: the projection already made (by the decoder layer, with its input norm in the same launch)."""
        if qkv is None:
            rotated = self._qkv_rope(positions, hidden, forward_batch)
            if rotated is not None:  # q/k/v, the rotation and the KV store in one launch
                q, k, v = rotated.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                return self._out(self.attn(q, k, v, forward_batch, save_kv_cache=False))
            qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self._out(self.attend(positions, q, k, v, forward_batch))

    def attend(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               forward_batch: ForwardBatch) -> torch.Tensor:
        """Attention of projected q, k, v (rows of [T, heads x head_dim]): the q/k norms, the rotation and the KV
        store (fused where the rotary kernel can), then the backend; o_proj is the caller's."""
        norm = None
        if self.qk_norm:
            if self.rotary_emb.can_fuse(q, k):  # normalised inside the rotary kernel: two launches fewer
                from radixserve.layers.triton_ops.rotary import QKNorm

                norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.k_norm.eps)
            else:
                q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
                k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        kv_write = self._kv_write(q, k, v, forward_batch)
        q, k = self.rotary_emb(positions, q, k, kv_write, norm)
        return self.attn(q, k, v, forward_batch, save_kv_cache=kv_write is None)

    def _out(self, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj's product, times Granite's residual_multiplier where the model sets one (output_scale)."""
        out = self.o_proj(attn_out)
        return out if self.output_scale == 1.0 else out * self.output_scale

    def normed_forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                       norm: RMSNorm, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the block's output, x + residual) with the residual add and the input `norm` in q/k/v's launch, and
        the rotation and KV store in its epilogue where it takes them, when q/k/v's quantization method folds the
        norm in (`normed_product`); None otherwise."""
        if not self.qkv_proj.folds_norm:  # (no rotation arguments built for a layer that cannot use them)
            return None
        fused = self.qkv_proj.normed_product(hidden, residual, norm, self._rope_args(positions, hidden, forward_batch))
        if fused is None:
            return None
        if not fused.rotated:
            return self.forward(positions, None, forward_batch, qkv=fused.out), fused.residual
        q, k, v = fused.out.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self._out(self.attn(q, k, v, forward_batch, save_kv_cache=False)), fused.residual

    def _rope_args(self, positions: torch.Tensor, hidden: torch.Tensor,
                   forward_batch: ForwardBatch) -> RopeArgs | None:
        """What q/k/v's product needs to rotate q and k and store k and v itself (one token, neox layout, no q/k
        norm, no adapters, a KV slot), or None."""
        if hidden.dim() != 2 or hidden.shape[0] != 1 or self.qk_norm or self.qkv_proj.lora is not None \
                or forward_batch.out_cache_loc is None or not self.rotary_emb.is_neox_style or not use_fused(hidden):
            return None
        from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
        from radixserve.layers.triton_ops.gemv_rope import ENABLED, KVDest

        if not ENABLED:  # RADIXSERVE_GEMV_ROPE=0: the rotary kernel after the product
            return None
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(self.attn.layer_id)
        kv = KVDest(k_buf, v_buf, forward_batch.out_cache_loc, self.attn.k_scale, self.attn.v_scale)
        return RopeArgs(self.num_heads, self.num_kv_heads, self.head_dim, positions, self.rotary_emb.cos_cache,
                        self.rotary_emb.sin_cache, kv)

    def _qkv_rope(self, positions: torch.Tensor, hidden: torch.Tensor | None,
                  forward_batch: ForwardBatch) -> torch.Tensor | None:
        """One token with the fused kernels on: q/k/v with q and k rotated and k/v stored in the pool, from one
        launch (`triton_ops/gemv_rope`, or the quantization method's `apply_rope`), where the one-row GEMV serves
        this weight; None to take the usual path."""
        proj = self.qkv_proj
        if hidden is None or hidden.dim() != 2 or hidden.shape[0] != 1 or hidden.stride(-1) != 1 or self.qk_norm \
                or proj.lora is not None or forward_batch.out_cache_loc is None or not self.rotary_emb.is_neox_style \
                or not use_fused(hidden):
            return None
        if not proj._plain:  # a quantization method's product: its own fused kernel where it has one (fp8)
            fused = getattr(proj.quant_method, "apply_rope", None)
            rope = self._rope_args(positions, hidden, forward_batch) if fused is not None else None
            return None if rope is None else fused(proj, hidden, proj.bias, rope)
        if hidden.dtype != proj.weight.dtype:
            return None
        from radixserve.layers.triton_ops import gemv_rope

        if "_rope_cfg" not in self.__dict__:  # the weight's shape and device are fixed once loaded
            self._rope_cfg = gemv_rope.gemv_rope_config(proj.weight, self.head_dim)
        if self._rope_cfg is None:
            return None
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(self.attn.layer_id)
        kv = gemv_rope.KVDest(k_buf, v_buf, forward_batch.out_cache_loc, self.attn.k_scale, self.attn.v_scale)
        return gemv_rope.gemv_qkv_rope(hidden, proj.weight, proj.bias, self.num_heads, self.num_kv_heads,
                                       self.head_dim, positions, self.rotary_emb.cos_cache, self.rotary_emb.sin_cache,
                                       kv, self._rope_cfg)

    def _kv_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  forward_batch: ForwardBatch) -> KVWrite | None:
        """Where the fused rotary kernel should store this layer's K/V (saving the attention backend's own store),
        or None to leave the store to the backend."""
        if forward_batch.out_cache_loc is None or not self.rotary_emb.can_fuse(q, k):
            return None
        from radixserve.layers.triton_ops.rotary import KVWrite

        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(self.attn.layer_id)
        return KVWrite(k_buf, v_buf, forward_batch.out_cache_loc, v, self.attn.k_scale, self.attn.v_scale)


def dense_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    """The feed-forward block of a dense Llama-family layer (MoE families pass their own factory)."""
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    return LlamaMLP(config.hidden_size, config.intermediate_size, mlp_bias, tp_rank, tp_size)


MLPFactory = Callable[["PretrainedConfig", int, int, int], nn.Module]


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention  # (Llama 4: its own, with the same signature)

    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 qkv_bias: bool = False, qk_norm: bool = False, mlp_factory: MLPFactory = dense_mlp,
                 attn_sinks: bool = False) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id, tp_rank, tp_size, rotary, qkv_bias, qk_norm,
                                            sinks=attn_sinks)
        self.mlp = mlp_factory(config, layer_id, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # With the fused all-reduce + add + RMSNorm, o_proj and a dense MLP's down_proj leave their outputs
        # unreduced and the norm after them sums over the ranks (the next layer's input norm, for the MLP)
        self.fuse_reduce = tp_size > 1 and custom_all_reduce_fuses_norm()
        self.mlp_partial = self.fuse_reduce and isinstance(self.mlp, LlamaMLP)
        self.input_partial = False  # set by LlamaModel: the previous layer's MLP output comes unreduced
        if self.fuse_reduce:
            self.self_attn.o_proj.reduce_results = False
        if self.mlp_partial:
            self.mlp.down_proj.reduce_results = False

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        qkv_proj = self.self_attn.qkv_proj
        if qkv_proj.decode_gemv and not self.input_partial and qkv_proj.gemv_ok(hidden):
            # one row: the residual add, the input norm and q/k/v in one launch (the one-row GEMV)
            from radixserve.layers.triton_ops.gemv import gemv_row_norm

            norm = self.input_layernorm
            qkv, new_residual = gemv_row_norm(hidden, qkv_proj.weight, qkv_proj.bias,
                                              norm=(residual, norm.weight, norm.eps))
            residual = hidden if new_residual is None else new_residual
            hidden = self.self_attn(positions, None, forward_batch, qkv=qkv)
        elif (fused := None if self.input_partial else
              self.self_attn.normed_forward(positions, hidden, residual, self.input_layernorm, forward_batch)):
            hidden, residual = fused  # the residual add and the norm in q/k/v's launch (its quantization method's)
        else:
            if residual is None:
                residual = hidden
                hidden = self.input_layernorm(hidden)
            else:
                hidden, residual = self.input_layernorm(hidden, residual, reduce=self.input_partial)
            hidden = self.self_attn(positions, hidden, forward_batch)
        # MoE blocks: for a few tokens the norm runs inside the router's launch (not with the fused all-reduce)
        forward_norm = None if self.fuse_reduce else getattr(self.mlp, "forward_norm", None)
        if forward_norm is not None:
            return forward_norm(hidden, residual, self.post_attention_layernorm)
        if not self.fuse_reduce and isinstance(self.mlp, LlamaMLP) and (
                normed := self.mlp.normed_forward(hidden, residual, self.post_attention_layernorm)) is not None:
            return normed
        hidden, residual = self.post_attention_layernorm(hidden, residual, reduce=self.fuse_reduce)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    table_positions: int | None = None  # the rotary tables' positions at construction (None: the config's)

    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, qkv_bias: bool = False,
                 qk_norm: bool = False, mlp_factory: MLPFactory = dense_mlp, attn_sinks: bool = False) -> None:
        super().__init__()
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        rotary = self.build_rotary(config)
        self.layers = nn.ModuleList(self.layer_cls(config, i, tp_rank, tp_size, rotary, qkv_bias, qk_norm,
                                                   mlp_factory, attn_sinks)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        for prev, layer in zip(self.layers[:-1], self.layers[1:], strict=True):  # fused all-reduce + norm
            layer.input_partial = prev.mlp_partial
            layer.input_layernorm.prefetch_next(layer.self_attn.qkv_proj)
        for layer in self.layers:
            layer.post_attention_layernorm.prefetch_next(getattr(layer.mlp, "gate_up_proj", None))
        self.final_partial = bool(len(self.layers)) and self.layers[-1].mlp_partial
        self.embed_scale = 1.0

    def build_rotary(self, config: PretrainedConfig) -> RotaryEmbedding:
        """The rotary tables every layer shares (a family with its own frequencies overrides this)."""
        return model_rotary(config, self.table_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:  # Granite's embedding_multiplier
            hidden = hidden * self.embed_scale
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual, reduce=self.final_partial)
        return hidden


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    partial_rotary = False  # a family whose load_weight lays q/k out for it (rotary_embedding.partial_rotary_order)
    mlp_factory: MLPFactory = staticmethod(dense_mlp)
    # HF name fragment -> (our stacked parameter fragment, shard id)
    stacked_params = [("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
                      ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)]

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.model = self.build_model(config, tp_rank, tp_size)
        attn = next((layer.self_attn for layer in self.model.layers if hasattr(layer, "self_attn")), None)
        rotary = attn.rotary_emb if attn is not None else None  # (a hybrid model's first layers may have none)
        if rotary is not None and 0 < rotary.rotary_dim < rotary.head_dim and not self.partial_rotary:
            raise ValueError(f"{type(self).__name__} does not support partial_rotary_factor (rotary_dim "
                             f"{rotary.rotary_dim} of head_dim {rotary.head_dim})")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.model.norm.prefetch_next(self.lm_head)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        """The decoder stack (`self.model`): embed_tokens, layers (each with self_attn.attn), norm."""
        check_hidden_act(config)
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        return LlamaModel(config, tp_rank, tp_size, qkv_bias, self.qk_norm, self.mlp_factory)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        hidden = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(hidden, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            kv_scale = kv_scale_name(name)
            if kv_scale is not None:
                set_kv_scale(self.model.layers[kv_scale[0]].self_attn.attn, kv_scale[1], tensor)
                continue
            target = self.load_weight(params, name, tensor)
            if target is not None:
                loaded.add(target)
        missing = sorted(n for n in set(params) - loaded if not getattr(params[n], "optional", False))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {', '.join(missing[:5])}")

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        """Load one checkpoint tensor; returns the name of the parameter it (partly) filled. Families with other
        stacked or renamed tensors (experts, MLA) override this and fall back to it."""
        for hf_part, our_part, shard in self.stacked_params:
            if f".{hf_part}." in name:
                target = name.replace(f".{hf_part}.", f".{our_part}.")
                if target not in params and _zero_bias(name, tensor):
                    return None
                if target not in params:
                    raise ValueError(f"weight {name!r} has no parameter {target!r} in {type(self).__name__}")
                params[target].weight_loader(params[target], tensor, shard)
                return target
        if name not in params and _zero_bias(name, tensor):
            return None
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
        load_plain(params[name], name, tensor)
        return name


def _zero_bias(name: str, tensor: torch.Tensor) -> bool:
    """An all-zero bias of a layer the model holds without one (older GPTQ exports give every quantized layer a
    bias tensor, zeros where the model has none): adding it changes nothing, so it is skipped."""
    return name.endswith(".bias") and not bool(tensor.any())


def load_plain(param: nn.Parameter, name: str, tensor: torch.Tensor) -> None:
    """A parameter loaded whole or through its own weight_loader."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        if param.shape != tensor.shape:
            raise ValueError(f"weight shape mismatch for {name}: expected {tuple(param.shape)}, "
                             f"got {tuple(tensor.shape)}")
        param.data.copy_(tensor)
    else:
        loader(param, tensor)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Mistral3ForConditionalGeneration(TextOfMultimodal, MistralForCausalLM):
    """Mistral Small 3.1 / 3.2 served as text (`models/multimodal_text.py`): its Mistral language model."""


class CwmForCausalLM(LlamaForCausalLM):
    """Meta's CWM: Llama 3 whose `layer_types` put one full-attention layer among sliding-window ones
    (`sliding_window_size`)."""


class InternLM3ForCausalLM(LlamaForCausalLM):
    """InternLM3: Llama; transformers' config maps its `qkv_bias` / `bias` to attention_bias / mlp_bias, and its
    dynamic NTK rope keeps the config's frequencies within the original context (`ModelConfig` refuses more)."""
