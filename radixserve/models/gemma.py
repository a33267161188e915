"""Gemma 1 (`GemmaForCausalLM`), Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 served as text (`Gemma3ForCausalLM`: the
1B and the text configs; `Gemma3ForConditionalGeneration`: the 4B/12B/27B checkpoints, whose vision tower is skipped
at load and whose requests are text only).

Gemma 1 is Llama's model (one norm before the attention, one before the MLP) with the scaled embedding, the
(1 + weight) norms and the GELU-tanh MLP below; its scores scale by head_dim ** -0.5. Gemma 2 and 3 are Llama's
attention and stacked layers, with Gemma's differences:
- the embedding is multiplied by sqrt(hidden_size) (rounded to the model's dtype, as transformers does);
- four norms a layer: the attention's and the MLP's outputs are normed before the residual add (post-attention and
  post-feedforward), their inputs by the input and pre-feedforward norms;
- every norm scales by (1 + weight): the checkpoint's weights get 1 added at load, so the usual RMSNorm serves;
- the MLP's activation is GELU (tanh approximation), attention scores scale by query_pre_attn_scalar ** -0.5;
- `layer_types` alternates sliding-window and full-attention layers;
- Gemma 2 soft-caps the attention scores (attn_logit_softcapping, in the attention backends) and the logits
  (final_logit_softcapping, in the logits processor); Gemma 3 instead norms q and k per head (as Qwen3) and turns
  its sliding layers with a local rotary base, its full layers with the global one (and its scaling).
EmbeddingGemma's bidirectional attention is refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.logits_processor import LogitsProcessor
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    attention_head_dim,
    input_embedding,
    model_rotary,
)
from radixserve.models.multimodal_text import text_config, text_weight_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def check_gemma_config(config: PretrainedConfig, soft_capping: bool) -> None:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or GELU_TANH[0]
    if act not in GELU_TANH:
        raise ValueError(f"Gemma hidden_activation {act!r} is not supported (supported: gelu_pytorch_tanh)")
    if not soft_capping:
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, cap, None) is not None:
                raise ValueError(f"{cap} is not supported for Gemma 3")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported (EmbeddingGemma)")


def layer_type_rotary(config: PretrainedConfig, layer_type: str) -> RotaryEmbedding:
    """Gemma 3's rotary tables of one layer type ("full_attention" / "sliding_attention"), from transformers 5's
    per-type rope_parameters."""
    params = (getattr(config, "rope_parameters", None) or {}).get(layer_type)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ValueError(f"Gemma 3 config has no rope_parameters[{layer_type!r}] with a rope_theta")
    kind = params.get("rope_type", "default")
    scaling = None if kind in ("default", None) else dict(params)
    return RotaryEmbedding(attention_head_dim(config), config.max_position_embeddings, float(params["rope_theta"]),
                           scaling)


class GeluTanhMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        d = gate_up.shape[-1] // 2
        return self.down_proj(F.gelu(gate_up[..., :d], approximate="tanh") * gate_up[..., d:])


class SandwichNormLayer(nn.Module):
    """A decoder layer whose attention and MLP outputs are normed before their residual adds, four norms a layer
    (Gemma 2/3, GLM-4): `NORMS` names them, in the checkpoint's words, in the order (attention input, attention
    output, MLP input, MLP output); the subclass builds them beside `self_attn` and `mlp`."""

    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's normed MLP output, not yet added to `residual` (None at the first layer)."""
        attn_in, attn_out, mlp_in, mlp_out = (getattr(self, name) for name in self.NORMS)
        if residual is None:
            residual = hidden
            hidden = attn_in(hidden)
        else:
            hidden, residual = attn_in(hidden, residual)
        hidden = attn_out(self.self_attn(positions, hidden, forward_batch))
        hidden, residual = mlp_in(hidden, residual)
        return mlp_out(self.mlp(hidden)), residual


class GemmaDecoderLayer(SandwichNormLayer):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp_rank, tp_size, rotary,
                                        qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=qk_norm,
                                        scaling=float(config.query_pre_attn_scalar) ** -0.5,
                                        logit_cap=float(getattr(config, "attn_logit_softcapping", None) or 0.0))
        self.mlp = GeluTanhMLP(config.hidden_size, config.intermediate_size, tp_rank, tp_size)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)


def embedding_scale(config: PretrainedConfig) -> float:
    """sqrt(hidden_size) rounded to the model's dtype (built under it as torch's default), as transformers
    multiplies (33.94 is 34.0 in bfloat16)."""
    return torch.tensor(float(config.hidden_size) ** 0.5, dtype=torch.get_default_dtype(), device="cpu").item()


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, gemma3: bool) -> None:
        super().__init__()
        self.embed_tokens = input_embedding(config, tp_rank, tp_size, tied_default=True)
        self.embed_scale = embedding_scale(config)
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        if gemma3:  # one table per layer type, shared by its layers
            rotary = {t: layer_type_rotary(config, t) for t in sorted(set(types))}
        else:
            shared = model_rotary(config)
            rotary = {t: shared for t in set(types)}
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, tp_rank, tp_size, rotary[types[i]], qk_norm=gemma3)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GemmaFamilyForCausalLM(LlamaForCausalLM):
    """What every Gemma shares at load: the tied embedding by default, the norms' (1 + weight)."""

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        config = text_config(config)
        if getattr(config, "tie_word_embeddings", None) is None:
            config.tie_word_embeddings = True  # Gemma's default
        super().__init__(config, tp_rank, tp_size)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        name = text_weight_name(name)  # a multimodal checkpoint's text weights; its image encoder is not loaded
        if name is None or name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        if name.endswith("norm.weight"):  # Gemma's norms scale by (1 + weight)
            tensor = tensor.float() + 1.0
        return super().load_weight(params, name, tensor)


def gelu_tanh_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    return GeluTanhMLP(config.hidden_size, config.intermediate_size, tp_rank, tp_size)


class GemmaForCausalLM(GemmaFamilyForCausalLM):
    """Gemma 1: Llama's layers with the GELU-tanh MLP and the scaled embedding. Its releases' configs say
    hidden_act "gelu", which transformers runs as the tanh approximation (as here)."""

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        act = getattr(config, "hidden_act", None) or GELU_TANH[0]
        if act not in (*GELU_TANH, "gelu"):
            raise ValueError(f"Gemma hidden_act {act!r} is not supported (supported: gelu_pytorch_tanh)")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported")
        model = LlamaModel(config, tp_rank, tp_size, bool(getattr(config, "attention_bias", False)),
                           mlp_factory=gelu_tanh_mlp)
        model.embed_scale = embedding_scale(config)
        return model


class Gemma2Or3ForCausalLM(GemmaFamilyForCausalLM):
    """Both later generations: `gemma3` picks Gemma 3's q/k norms and per-type rotary over Gemma 2's
    soft-capping."""
    gemma3 = True

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            self.logits_processor = LogitsProcessor(self.config.vocab_size, float(cap))

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_gemma_config(config, soft_capping=not self.gemma3)
        return GemmaModel(config, tp_rank, tp_size, self.gemma3)


class Gemma3ForCausalLM(Gemma2Or3ForCausalLM):
    pass


class Gemma3ForConditionalGeneration(Gemma2Or3ForCausalLM):
    pass


class Gemma2ForCausalLM(Gemma2Or3ForCausalLM):
    gemma3 = False
