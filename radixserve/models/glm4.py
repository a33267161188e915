"""GLM-4 (`Glm4ForCausalLM`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1), GLM-4.5 (`Glm4MoeForCausalLM`: GLM-4.5,
GLM-4.5-Air, GLM-4.6) and GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, last below). GLM-4 and GLM-4.5: Llama's
attention (q/k/v bias, o_proj without one) with partial rotation over the first partial_rotary_factor (0.5) of each
head.

- GLM-4 rotates *interleaved* pairs (2i, 2i + 1) of the first rotary_dim dims, GLM-4.5 the neox halves of them
  (i, i + rotary_dim / 2). Our kernels rotate the pairs (i, i + head_dim / 2) with the frequencies past
  rotary_dim / 2 zero, so q and k rows (weights, biases, per-row scales; GLM-4.5's q/k norm weights too) are laid
  out per head at load in `rotary_order`: q.k is the same sum in any order of the head's dims, v is untouched.
- GLM-4 has four norms a layer ("sandwich" norms): the attention's and the MLP's outputs are normed before the
  residual add (post_self_attn_layernorm, post_mlp_layernorm), their inputs by input_layernorm and
  post_attention_layernorm; its checkpoints store the MLP's gate/up fused as `gate_up_proj` (split here).
- GLM-4.5's MoE is DeepSeek-V3's (`deepseek_v2.DeepseekMoE`): sigmoid scores plus `e_score_correction_bias` choose
  the experts (grouped top-k over n_group / topk_group), the chosen sigmoid scores weigh them (renormalised when
  norm_topk_prob) times routed_scaling_factor, plus the shared experts; the first `first_k_dense_replace` layers
  are dense. Its per-head q/k RMSNorm is on when `use_qk_norm`. The checkpoints' multi-token-prediction layer
  (`num_nextn_predict_layers`, stored as layer num_hidden_layers) serves speculative decoding only and is skipped.
- GLM-4.7-Flash is DeepSeek-V3 (`deepseek_v2.DeepseekV3ForCausalLM`): its multi-head latent attention (interleaved
  rotary pairs when `rope_interleave`; at its shape qk_nope_head_dim 192 and v_head_dim 256) and the same MoE,
  with the dense / sparse choice a layer from `mlp_layer_types` (transformers derives it from num_hidden_layers
  when the config omits it: the first layer dense)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import RotaryEmbedding, partial_rotary_order
from radixserve.models.deepseek_v2 import DeepseekMoE, DeepseekV3ForCausalLM
from radixserve.models.gemma import SandwichNormLayer
from radixserve.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    check_hidden_act,
    input_embedding,
    load_plain,
    model_rotary,
)
from radixserve.models.qwen2_moe import MoECausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

_QK = (".q_proj.", ".k_proj.", ".q_norm.", ".k_norm.")
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def rotary_order(head_dim: int, rotary_dim: int, interleaved: bool) -> torch.Tensor | None:
    """The order of a head's dims for our kernels (new dim j holds the checkpoint's dim order[j]), or None where
    the checkpoint's is already ours (neox over the whole head). Interleaved: the first half gets the even rotated
    dims 0, 2, .., rotary_dim - 2 then half of the unrotated ones, the second half the odd rotated dims then the
    other unrotated ones, so that the pair (2i, 2i + 1) lands on (i, i + head_dim / 2)."""
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or head_dim % 2:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in 1..head_dim {head_dim} (even)")
    if not interleaved:
        return None if rotary_dim == head_dim else partial_rotary_order(head_dim, rotary_dim)
    # on the CPU whatever the default device (models are built under the GPU's): it indexes checkpoint tensors
    half, rest = head_dim // 2, torch.arange(rotary_dim, head_dim, device="cpu")
    r = rotary_dim // 2
    return torch.cat([torch.arange(0, rotary_dim, 2, device="cpu"), rest[:half - r],
                      torch.arange(1, rotary_dim, 2, device="cpu"),
                      rest[half - r:]])


def unbiased_o_proj(attn: LlamaAttention) -> None:
    """GLM's attention_bias puts biases on q/k/v only (LlamaAttention gives o_proj one too under that flag)."""
    attn.o_proj.register_parameter("bias", None)


class GlmLayout:
    """Mixin for a LlamaForCausalLM-based GLM family: q/k rows laid out in `rotary_order` at load."""

    interleaved_rotary = False
    dim_order: torch.Tensor | None = None
    head_dim = 0

    def _init_layout(self, model: nn.Module) -> None:
        attn = model.layers[0].self_attn if len(model.layers) else None
        if attn is None:
            return
        self.head_dim = attn.head_dim
        rotary = attn.rotary_emb
        self.dim_order = rotary_order(rotary.head_dim, rotary.rotary_dim, self.interleaved_rotary)

    def _laid_out(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """q/k tensors with their rows in `dim_order` within each head: weights [rows, in], biases [rows], per-row
        scales [rows, 1], the q/k norms' weights [head_dim]; a scalar (a per-tensor scale) as it is. Other shapes
        (block-wise scales, packed 4-bit rows) cannot be laid out per dim and are refused."""
        if self.dim_order is None or not any(part in name for part in _QK) or tensor.numel() == 1:
            return tensor
        if tensor.dim() == 0 or tensor.shape[0] % self.head_dim \
                or name.endswith(("_scale_inv", ".qweight", ".qzeros", ".scales", ".g_idx", ".weight_packed")):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} cannot be laid out per head dim for the rotary "
                             f"layout (block-wise or packed quantized q/k tensors are not supported; 16-bit and "
                             f"per-channel fp8 ones are)")
        heads = tensor.shape[0] // self.head_dim
        return tensor.reshape(heads, self.head_dim, *tensor.shape[1:])[:, self.dim_order] \
            .reshape(tensor.shape).contiguous()

    def lora_b_layout(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B [out, r] for `module` with its rows laid out as the base weight's (q and k: the delta
        must land on the dims the rotation expects). A B whose rows are not whole heads is left as it is, for the
        adapter's shape check to refuse."""
        if b.dim() != 2 or b.shape[0] % max(self.head_dim, 1):
            return b
        return self._laid_out(f".{module}.", b)


class Glm4DecoderLayer(SandwichNormLayer):
    NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")

    def __init__(self, config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp_rank, tp_size, rotary,
                                        qkv_bias=bool(getattr(config, "attention_bias", True)))
        unbiased_o_proj(self.self_attn)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)  # the MLP's input norm
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps)


class Glm4Model(nn.Module):
    """Embeddings, pre-norm layers called as layer(positions, hidden, residual, forward_batch) -> (hidden,
    residual) (`layer_cls`, built with the rotary of `build_rotary`), the final RMSNorm; MiniMax-M2's too."""

    layer_cls: type[nn.Module] = Glm4DecoderLayer

    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        rotary = self.build_rotary(config)
        self.layers = nn.ModuleList(self.layer_cls(config, i, tp_rank, tp_size, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_rotary(self, config: PretrainedConfig) -> RotaryEmbedding:
        return model_rotary(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Glm4ForCausalLM(GlmLayout, LlamaForCausalLM):
    partial_rotary = True
    interleaved_rotary = True

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        self._init_layout(self.model)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        check_hidden_act(config)
        return Glm4Model(config, tp_rank, tp_size)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if ".gate_up_proj." not in name:
            return super().load_weight(params, name, self._laid_out(name, tensor))
        if not name.endswith(".weight") or tensor.dtype not in _FLOAT:
            raise ValueError(f"{name}: quantized GLM-4 checkpoints (gate/up stored fused) are not supported; serve "
                             f"the 16-bit checkpoint (with --quantization fp8 to quantize it)")
        if tensor.shape[0] % 2:
            raise ValueError(f"{name}: expected an even number of rows (gate, up), got {tensor.shape[0]}")
        target = None
        for part, t in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
            target = super().load_weight(params, name.replace(".gate_up_proj.", f".{part}."), t.contiguous())
        return target


def glm4_moe_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    if layer_id < (getattr(config, "first_k_dense_replace", 0) or 0):
        return LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size)
    return DeepseekMoE(config, tp_rank, tp_size, v3=True)


class Glm4MoeForCausalLM(GlmLayout, MoECausalLM):
    partial_rotary = True
    interleaved_rotary = False
    mlp_factory = staticmethod(glm4_moe_mlp)

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        if not getattr(config, "n_routed_experts", None):
            raise ValueError("Glm4MoeForCausalLM needs n_routed_experts in its config")
        self.qk_norm = bool(getattr(config, "use_qk_norm", False))
        super().__init__(config, tp_rank, tp_size)
        self._init_layout(self.model)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        model = super().build_model(config, tp_rank, tp_size)
        if isinstance(model, LlamaModel):
            for layer in model.layers:
                unbiased_o_proj(layer.self_attn)
        return model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # the multi-token-prediction layer(s) sit at layer num_hidden_layers on: speculative decoding only
        n = self.config.num_hidden_layers
        super().load_weights((name, t) for name, t in weights
                             if (m := _LAYER.match(name)) is None or int(m.group(1)) < n)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if name.endswith("e_score_correction_bias") and name in params:
            load_plain(params[name], name, tensor.float())
            return name
        return super().load_weight(params, name, self._laid_out(name, tensor))


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's model as it is (see the module's text); transformers rotates the whole
    qk_rope_head_dim, so a partial_rotary_factor other than 1 is refused."""

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        params = getattr(config, "rope_parameters", None) or {}
        share = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        if share not in (None, 1, 1.0):
            raise ValueError(f"Glm4MoeLiteForCausalLM: partial_rotary_factor {share} is not supported (1.0: the whole "
                             f"qk_rope_head_dim rotates)")
        super().__init__(config, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # the multi-token-prediction layer(s) sit at layer num_hidden_layers on: speculative decoding only
        n = self.config.num_hidden_layers
        super().load_weights((name, t) for name, t in weights
                             if (m := _LAYER.match(name)) is None or int(m.group(1)) < n)
