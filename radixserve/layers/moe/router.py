"""Expert selection: scores from the router logits, top-k (optionally within the best expert groups), weights.

Covers the routers of the supported families:
- Mixtral, Qwen2-MoE, Qwen3-MoE: softmax over all experts, top-k, optionally renormalised to sum to 1;
- DeepSeek-V2: softmax, top-k plain ("greedy") or within the `topk_group` best of `n_group` groups ranked by their
  best expert ("group_limited_greedy"), times `routed_scaling_factor`;
- DeepSeek-V3: sigmoid scores; the choice uses scores + `e_score_correction_bias`, groups ranked by the sum of their
  two best corrected scores; the weights are the uncorrected scores of the chosen experts, renormalised, times
  `routed_scaling_factor`;
- ERNIE 4.5 MoE: softmax; the choice uses scores + `e_score_correction_bias`, the weights are the chosen softmax
  scores over max(their sum, `renorm_min`) (`moe_norm_min`): only the torch path divides so (the fused kernels
  decline a router with renorm_min set rather than divide by the plain sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.triton_ops import use_fused

SCORING = ("softmax", "sigmoid")
GROUP_RANKING = ("max", "top2_sum")


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_groups: int | None = None  # grouped top-k: experts split into this many groups ...
    topk_groups: int | None = None  # ... of which the best this many are eligible
    group_ranking: str = "max"  # how a group is ranked: its best score, or the sum of its two best
    routed_scaling_factor: float = 1.0
    renorm_min: float = 0.0  # renormalised weights over max(sum, this) (ERNIE); 0: over the plain sum

    def __post_init__(self) -> None:
        if self.scoring not in SCORING:
            raise ValueError(f"MoE scoring must be one of {', '.join(SCORING)}, got {self.scoring!r}")
        if self.group_ranking not in GROUP_RANKING:
            raise ValueError(f"MoE group ranking must be one of {', '.join(GROUP_RANKING)}")
        if self.renorm_min < 0:
            raise ValueError(f"MoE renorm_min must be >= 0, got {self.renorm_min}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in 1..{self.num_experts}")
        if self.num_groups is not None:
            if self.num_groups < 1 or self.num_experts % self.num_groups:
                raise ValueError(f"n_group {self.num_groups} must divide the {self.num_experts} experts")
            if self.topk_groups is None or not 1 <= self.topk_groups <= self.num_groups:
                raise ValueError(f"topk_group {self.topk_groups} must be in 1..n_group {self.num_groups}")
            if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
                raise ValueError(f"topk_group {self.topk_groups} groups hold fewer experts than "
                                 f"num_experts_per_tok {self.top_k}")


def select_experts(router_logits: torch.Tensor, cfg: RouterConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, k], topk_ids int32 [T, k]) from router logits [T, E]. On CUDA an ungrouped router
    runs as one Triton kernel (`topk_kernel.py`); this torch code is the reference and the CPU path."""
    if use_fused(router_logits) and (cfg.num_groups or 1) == 1 and router_logits.stride(-1) == 1 \
            and not cfg.renorm_min:
        from radixserve.layers.moe.topk_kernel import fused_topk

        return fused_topk(router_logits, cfg.top_k, cfg.scoring == "sigmoid", cfg.renormalize,
                          cfg.routed_scaling_factor, correction_bias)
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups is not None and cfg.num_groups > 1:
        t = choice.shape[0]
        grouped = choice.view(t, cfg.num_groups, -1)
        if cfg.group_ranking == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(cfg.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(t, -1)
        # softmax scores are >= 0, so 0 never wins over an eligible expert (as in DeepSeek-V2); corrected sigmoid
        # scores may be negative, so they are masked with -inf (as in DeepSeek-V3)
        fill = 0.0 if cfg.scoring == "softmax" and correction_bias is None else float("-inf")
        choice = choice.masked_fill(~keep, fill)
    ids = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        total = total.clamp(min=cfg.renorm_min) if cfg.renorm_min else \
            total + (1e-20 if cfg.scoring == "sigmoid" else 0.0)
        weights = weights / total
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids.to(torch.int32)


class MoEGate(nn.Module):
    """The router's linear layer (HF name `...mlp.gate.weight`, held whole on every rank) and, for DeepSeek-V3, the
    `e_score_correction_bias`. Logits are computed in float32, as the DeepSeek references keep the gate in fp32."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool = False, bias: bool = False
                 ) -> None:
        super().__init__()
        # held in float32 (a few hundred KB): the logits need no cast of the weight at every step
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        if bias:  # GPT-OSS's router adds a bias to the logits (the one-launch routers do not take it)
            self.bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            self.bias.dummy_dtype = torch.get_default_dtype()
        else:
            self.register_parameter("bias", None)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)

        # the one-launch router's counter (its last program puts it back to 0)
        self.register_buffer("done_counter", torch.zeros(1, dtype=torch.int32), persistent=False)
        # the dtype a checkpoint of the model (built under it as torch's default) stores the gate in: random
        # (dummy) weights are rounded to it, as loading such a checkpoint would give them
        self.weight.dummy_dtype = torch.get_default_dtype()
        # the weight in that dtype when it holds exactly those values (`after_weights_loaded`): many tokens' logits
        # then run on the tensor cores (`gate_gemm.py`), the same float32 sums
        self.weight_half: torch.Tensor | None = None

    def after_weights_loaded(self) -> None:
        """Called once the weights are in (model_loader): keep the half-precision copy when it is exact."""
        half = self.weight.dummy_dtype
        self.weight_half = None
        if half in (torch.bfloat16, torch.float16) and self.weight.dtype == torch.float32:
            w = self.weight.detach().to(half)
            if torch.equal(w.float(), self.weight.detach()):
                self.weight_half = w.contiguous()

    def _half_fits(self, x: torch.Tensor) -> bool:
        from radixserve.layers.moe.gate_gemm import gate_fits

        return self.weight_half is not None and use_fused(x) and x.shape[0] > 1 and gate_fits(x, self.weight_half) \
            and self.weight_half.device == x.device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._half_fits(x):
            from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted
            from radixserve.layers.moe.gate_gemm import gate_logits

            logits = gate_logits(x, self.weight_half, is_interpreted())
            return logits if self.bias is None else logits + self.bias
        return F.linear(x.float(), self.weight.float(), self.bias)

    def route(self, x: torch.Tensor, cfg: RouterConfig, norm: tuple[torch.Tensor, nn.Module] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """`select_experts(self(x), cfg, bias)` in fused kernels where they apply (CUDA or forced kernels, an
        ungrouped router): one launch for at most GATE_TOPK_TOKENS tokens with the float32 weight, two
        (`gate_gemm.gate_topk_blocks`) for more with the exact half-precision copy. Returns (weights, ids, the
        experts' input, the new residual or None); None elsewhere (the caller then runs the linear layer and
        select_experts), and for a router with renorm_min (ERNIE), which the kernels do not implement.
        With `norm` = (residual, an RMSNorm), x is the block's input before that norm: the same launch does the
        residual add and the norm (`fused_add_rmsnorm`'s arithmetic) and returns its two outputs."""
        from radixserve.layers.moe import topk_kernel

        if self.bias is not None or cfg.renorm_min:
            return None
        if norm is None and (cfg.num_groups or 1) == 1 and self._half_fits(x):
            from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted
            from radixserve.layers.moe.gate_gemm import gate_topk_blocks

            w, ids = gate_topk_blocks(x, self.weight_half, cfg.top_k, cfg.scoring == "sigmoid", cfg.renormalize,
                                      cfg.routed_scaling_factor, self.e_score_correction_bias, is_interpreted())
            return w, ids, x, None
        if not use_fused(x) or x.shape[0] > topk_kernel.GATE_TOPK_TOKENS or (cfg.num_groups or 1) != 1 \
                or x.dim() != 2 or x.stride(-1) != 1 or self.weight.dtype != torch.float32 \
                or self.done_counter.device != x.device:
            return None
        norm_args = None
        if norm is not None:
            residual, rms = norm
            if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
                return None
            norm_args = (residual, rms.weight, rms.eps)
        from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted

        w, ids, x_out, res_out = topk_kernel.fused_gate_topk(
            x, self.weight, self.done_counter, cfg.top_k, cfg.scoring == "sigmoid", cfg.renormalize,
            cfg.routed_scaling_factor, self.e_score_correction_bias, is_interpreted(), norm_args)
        return w, ids, (x if x_out is None else x_out), res_out
