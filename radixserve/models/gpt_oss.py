"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): Llama-style blocks with
- attention: q/k/v/o biases, a learned per-head sink logit (`RadixAttention(sinks=True)`: softmax over the visible
  keys and the sink, whose column is dropped), sliding (128) and full layers alternating (`layer_types`), YaRN;
- experts in every layer: a biased router whose top-k logits are softmaxed (= softmax over all, top-k,
  renormalised), experts with biases and the clamped SwiGLU of `layers/moe/activation.py`.

Checkpoints: the BF16 layout (`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up columns interleaved,
`down_proj` [E, I, H], both stored input-major) and OpenAI's MXFP4 one (`*_blocks` uint8 [E, N, K / 32, 16], two
4-bit e2m1 values a byte, low nibble first, and `*_scales` uint8 [E, N, K / 32], power-of-two exponents biased by
127), whose experts are widened to the model dtype as they load (the model is then served unquantized)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.moe.activation import ExpertActivation
from radixserve.models.llama import LlamaModel
from radixserve.models.qwen2_moe import MoECausalLM, SparseMoeBlock

if TYPE_CHECKING:
    from collections.abc import Iterable

    from transformers import PretrainedConfig

# the e2m1 values of the 16 four-bit codes (sign bit 3)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> [..., G * 32] in `dtype`: each byte's low nibble is
    the even column, its high nibble the odd one, and a group of 32 columns shares the scale 2^(scale - 127).
    One leading index at a time, in float32 (the products are exact: an e2m1 value times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected [..., G, 16] and [..., G])")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    lead, groups = blocks.shape[:-2], blocks.shape[-2]
    n0 = lead[0] if lead else 1
    all_blocks, all_scales = blocks.reshape(n0, -1, 16), scales.reshape(n0, -1)
    out = torch.empty(n0, all_blocks.shape[1] * 32, dtype=dtype, device=blocks.device)
    for i in range(n0):
        b = all_blocks[i].long()
        vals = torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1).flatten(-2)  # [rows x groups, 32]
        out[i] = (vals * torch.exp2(all_scales[i].float() - 127.0)[:, None]).flatten().to(dtype)
    return out.view(*lead, groups * 32)


def deinterleave_rows(w: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate and up rows alternating -> gate rows then up rows (the stacked experts' layout)."""
    return torch.cat((w[:, 0::2], w[:, 1::2]), dim=1)


def gpt_oss_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    # the released defaults where the config names none (a 0 is the config's own value: refused or served as is)
    alpha, limit = getattr(config, "swiglu_alpha", None), getattr(config, "swiglu_limit", None)
    act = ExpertActivation("swiglu_oai", 1.702 if alpha is None else float(alpha),
                           7.0 if limit is None else float(limit))
    return SparseMoeBlock(config, tp_rank, tp_size, renormalize=True, biased=True, activation=act)


_LAYER_TYPES = ("sliding_attention", "full_attention")
_EXPERTS = ".mlp.experts."
# checkpoint expert tensor -> (our stacked parameter, how it becomes [E, ...] in that parameter's full layout)
_EXPERT_TENSORS = {
    "gate_up_proj": ("w13_weight", lambda t: deinterleave_rows(t.transpose(1, 2))),
    "gate_up_proj_bias": ("w13_bias", deinterleave_rows),
    "down_proj": ("w2_weight", lambda t: t.transpose(1, 2)),
    "down_proj_bias": ("w2_bias", lambda t: t),
}


class GptOssForCausalLM(MoECausalLM):
    mlp_factory = staticmethod(gpt_oss_mlp)

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        self._mxfp4: dict[str, torch.Tensor] = {}  # an MXFP4 tensor's blocks or scales until the other arrives

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        # (hidden_act is not read: the experts' activation is the architecture's, swiglu_alpha / swiglu_limit)
        if getattr(config, "num_key_value_heads", None) is None:
            raise ValueError("GPT-OSS config names no num_key_value_heads")
        unknown = sorted(set(getattr(config, "layer_types", None) or []) - set(_LAYER_TYPES))
        if unknown:  # (any other type would be served as full attention)
            raise ValueError(f"GPT-OSS layer_types {unknown} are not supported (supported: {', '.join(_LAYER_TYPES)})")
        return LlamaModel(config, tp_rank, tp_size, qkv_bias=bool(getattr(config, "attention_bias", True)),
                          mlp_factory=self.mlp_factory, attn_sinks=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._mxfp4.clear()
        super().load_weights(weights)
        if self._mxfp4:
            raise ValueError(f"MXFP4 checkpoint tensors without their other half (blocks / scales): "
                             f"{', '.join(sorted(self._mxfp4)[:4])}")

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        if name.endswith(".self_attn.sinks"):
            target = name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
            try:  # this rank's heads' slice
                params[target].weight_loader(params[target], tensor)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
            return target
        if _EXPERTS not in name:
            return super().load_weight(params, name, tensor)
        prefix, leaf = name.split(_EXPERTS)
        if leaf.endswith(("_blocks", "_scales")):
            base, half = leaf.rsplit("_", 1)
            other = self._mxfp4.pop(f"{prefix}{_EXPERTS}{base}_{'scales' if half == 'blocks' else 'blocks'}", None)
            if other is None:
                self._mxfp4[name] = tensor
                return None
            blocks, scales = (tensor, other) if half == "blocks" else (other, tensor)
            target = params.get(f"{prefix}{_EXPERTS}{_EXPERT_TENSORS.get(base, ('?',))[0]}")
            if target is None:
                raise ValueError(f"unexpected MXFP4 tensor {name!r} for GPT-OSS")
            # [E, N, K] out x in: already our layout but for gate_up's interleaved rows
            full = dequantize_mxfp4(blocks.to(target.device), scales.to(target.device), target.dtype)
            full = deinterleave_rows(full) if base == "gate_up_proj" else full
            target.weight_loader(target, full, None)
            return f"{prefix}{_EXPERTS}{_EXPERT_TENSORS[base][0]}"
        if leaf not in _EXPERT_TENSORS:
            raise ValueError(f"unexpected weight {name!r} for GPT-OSS")
        ours, layout = _EXPERT_TENSORS[leaf]
        target = f"{prefix}{_EXPERTS}{ours}"
        params[target].weight_loader(params[target], layout(tensor), None)
        return target
