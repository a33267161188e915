"""IBM Granite MoE (`GraniteMoeForCausalLM`: granite-3.0 / 3.1 1b-a400m and 3b-a800m, PowerMoE-3b) and Granite MoE
with a shared MLP (`GraniteMoeSharedForCausalLM`): Granite 3.x's dense model (`granite.py`: embeddings times
`embedding_multiplier`, attention scores scaled by `attention_multiplier`, each attention and feed-forward output
times `residual_multiplier` before its residual add, logits divided by `logits_scaling`) with a sparse MoE block
in every layer:

- the router is one linear layer (`block_sparse_moe.router.layer`, no bias); transformers takes the top
  `num_experts_per_tok` logits and a softmax over them, which is a softmax over all the experts, their top-k,
  renormalised to sum to 1 (the router here: `RouterConfig(..., "softmax", renormalize=True)`, whose fused CUDA
  kernels serve it too);
- the experts are stored fused, `block_sparse_moe.input_linear.weight` [E, 2I, H] (each expert's gate rows then its
  up rows) and `block_sparse_moe.output_linear.weight` [E, H, I]: already FusedMoE's stacked layout (`w13_weight`,
  `w2_weight`), loaded whole through its weight_loader (each rank takes its intermediate slice, or its experts under
  --ep-size), no module built per expert. transformers 5's in-memory names (`experts.gate_up_proj`,
  `experts.down_proj`, `router.weight`) load too;
- GraniteMoeShared adds `shared_mlp` (`shared_intermediate_size`, 0: none): input_linear [2S, H] (gate then up) and
  output_linear [H, S], added to the experts' output unweighted, before the residual multiplier. It is the block's
  `shared_expert` here (a LlamaMLP: split over the TP ranks, one all-reduce with the experts).

Quantized expert tensors (scales beside the fused weights) and GGUF files (`configs/model_config.py`) are refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.models.granite import GraniteForCausalLM
from radixserve.models.llama import load_plain
from radixserve.models.qwen2_moe import MoECausalLM, SparseMoeBlock

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_MOE = ".block_sparse_moe."
# checkpoint (and transformers 5's in-memory) names under block_sparse_moe -> ours under mlp
_MOE_TENSORS = {"router.layer.weight": "gate.weight", "router.weight": "gate.weight",
                "input_linear.weight": "experts.w13_weight", "experts.gate_up_proj": "experts.w13_weight",
                "output_linear.weight": "experts.w2_weight", "experts.down_proj": "experts.w2_weight"}
_SHARED = ".shared_mlp."
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class GraniteMoeBlock(SparseMoeBlock):
    """Router, routed experts and the optional shared MLP; the block's output times `output_scale` (Granite's
    residual_multiplier, set by GraniteForCausalLM.build_model), after the all-reduce."""

    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int, shared_size: int) -> None:
        super().__init__(config, tp_rank, tp_size, renormalize=True, shared_size=shared_size)
        self.output_scale = 1.0

    def _finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out = super()._finish(x, out)  # (+ the shared MLP, the all-reduce)
        return out if self.output_scale == 1.0 else out * self.output_scale


def _shared_size(config: PretrainedConfig) -> int:
    size = getattr(config, "shared_intermediate_size", None)
    size = 0 if size is None else size
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"shared_intermediate_size must be an integer >= 0; got {size!r}")
    return size


def granitemoe_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    return GraniteMoeBlock(config, tp_rank, tp_size, shared_size=0)


def granitemoeshared_mlp(config: PretrainedConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    return GraniteMoeBlock(config, tp_rank, tp_size, shared_size=_shared_size(config))


class GraniteMoeForCausalLM(GraniteForCausalLM, MoECausalLM):
    mlp_factory = staticmethod(granitemoe_mlp)

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
            value = getattr(config, key, 1.0)
            if value is None and key == "attention_multiplier":  # the default scale, head_dim ** -0.5
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{key} must be a number; got {value!r}")
        super().__init__(config, tp_rank, tp_size)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if _MOE in name:
            prefix, leaf = name.split(_MOE, 1)
            if leaf not in _MOE_TENSORS:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__} (quantized Granite MoE "
                                 f"experts are not supported)")
            _check_float(name, tensor)
            target = f"{prefix}.mlp.{_MOE_TENSORS[leaf]}"
            if target not in params:
                raise ValueError(f"weight {name!r} has no parameter {target!r} in {type(self).__name__}")
            if _MOE_TENSORS[leaf] == "gate.weight":
                load_plain(params[target], name, tensor)
            else:  # the whole stacked tensor: this rank's slice taken by the experts' loader
                try:
                    params[target].weight_loader(params[target], tensor, None)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from e
            return target
        if _SHARED in name:
            prefix, leaf = name.split(_SHARED, 1)
            if leaf == "input_linear.weight":  # [2S, H]: gate rows, then up rows
                _check_float(name, tensor)
                if tensor.dim() != 2 or tensor.shape[0] % 2:
                    raise ValueError(f"{name}: expected [2 * shared_intermediate_size, hidden], got "
                                     f"{tuple(tensor.shape)}")
                target = None
                for part, half in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
                    target = super().load_weight(params, f"{prefix}.mlp.shared_expert.{part}.weight",
                                                 half.contiguous())
                return target
            if leaf == "output_linear.weight":
                _check_float(name, tensor)
                return super().load_weight(params, f"{prefix}.mlp.shared_expert.down_proj.weight", tensor)
            raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
        return super().load_weight(params, name, tensor)


def _check_float(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _FLOATS:
        raise ValueError(f"{name}: {tensor.dtype} tensors of Granite MoE's fused experts / shared MLP are not "
                         f"supported; serve the 16-bit checkpoint (with --quantization fp8 to quantize it)")


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    mlp_factory = staticmethod(granitemoeshared_mlp)
