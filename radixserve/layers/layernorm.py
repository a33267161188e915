"""RMSNorm, optionally fused with the residual add (one Triton kernel on CUDA, one C call for float32 / bfloat16 rows
on the CPU, torch ops elsewhere); LayerNorm without a bias (Cohere's) or with one (Phi-3.5-MoE's), in torch ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers import cpu_ops
from radixserve.layers.triton_ops import use_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self._next: list[nn.Module] = []  # the layer after this norm (a list: not registered as a submodule)

    def prefetch_next(self, module: nn.Module | None) -> None:
        """With the fused all-reduce (push kernel, RADIXSERVE_AR_PREFETCH_MB > 0), the start of `module`'s weight
        is asked into the L2 while the all-reduce waits on the link."""
        self._next = [module] if module is not None else []

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """reduce: `x` is this TP rank's partial sum (a row-parallel output left unreduced): sum it over the ranks
        first, in the same kernel as the add and the norm when the custom all-reduce can."""
        if reduce:
            from radixserve.distributed.parallel_state import all_reduce_add_rmsnorm, tensor_model_parallel_all_reduce

            if residual is not None:
                nxt = getattr(self._next[0], "weight", None) if self._next else None
                fused = all_reduce_add_rmsnorm(x, residual, self.weight, self.eps,
                                               nxt if isinstance(nxt, torch.Tensor) else None)
                if fused is not None:
                    return fused
            x = tensor_model_parallel_all_reduce(x)
        if use_fused(x) and x.dim() == 2 and x.stride(-1) == 1:
            from radixserve.layers.triton_ops.norm import fused_add_rmsnorm, rmsnorm

            if residual is None:
                return rmsnorm(x, self.weight, self.eps)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if x.device.type == "cpu":  # float32 / bfloat16 rows: one C call instead of ~20 small ops
            out = cpu_ops.rms_norm(x, residual, self.weight, self.eps)
            if out is not None:
                return out
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(nn.Module):
    """LayerNorm without a bias (Cohere): (x - mean) * rsqrt(var + eps) * weight over the last dim, in float32 and
    back to x's dtype, as transformers computes it. `shape` is the weight's: (hidden,), or (heads, head_dim) for a
    weight per head (x then [..., heads, head_dim]). With `bias` (Phi-3.5-MoE's nn.LayerNorm, a 1-D shape): torch's
    layer_norm in x's dtype, as nn.LayerNorm computes it; called as RMSNorm is, `norm(x, residual)` returns
    (norm(x + residual), x + residual)."""

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-5, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape), requires_grad=False)
        if bias:
            if self.weight.dim() != 1:
                raise ValueError(f"a biased LayerNorm takes a 1-D shape, got {tuple(self.weight.shape)}")
            self.bias = nn.Parameter(torch.zeros(shape), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.eps = eps

    def prefetch_next(self, module: nn.Module | None) -> None:
        """RMSNorm's hook for its fused all-reduce; no such kernel fuses this norm, so nothing is prefetched."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """reduce: `x` is this TP rank's partial sum, summed over the ranks first (as RMSNorm's)."""
        if reduce:
            from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce

            x = tensor_model_parallel_all_reduce(x)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.layer_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)
        dtype = x.dtype
        x = x.float()
        centred = x - x.mean(-1, keepdim=True)
        x = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)
