"""RMSNorm and residual-add + RMSNorm in one pass over each row.

Rounding follows Hugging Face's RMSNorm exactly: the sum x + residual is rounded to the activation dtype (it is the
new residual), the statistics are taken in float32, the normalised row is rounded to the activation dtype and only
then multiplied by the weight (one more rounding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue


@triton.jit
def _rmsnorm_kernel(X, R, W, Out, ROut, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0)  # first: its latency overlaps x's, not the reduction's
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ROut.dtype.element_ty)
        tl.store(ROut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(Out.dtype.element_ty)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rmsnorm expects a 2-D tensor with unit stride in its last dim; got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm weight of shape {tuple(weight.shape)} does not match rows of {x.shape[1]}")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) for x [T, H]."""
    _check(x, weight)
    out = torch.empty_like(x)
    if x.shape[0]:
        launch(_rmsnorm_kernel, (x.shape[0],), x, x, weight, out, out, x.stride(0), x.stride(0), out.stride(0),
                                        out.stride(0), x.shape[1], eps, HAS_RESIDUAL=False,
                                        BLOCK=triton.next_power_of_2(x.shape[1]), **pdl.launch_opts(x))
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * RMSNorm(x + residual), x + residual) for x, residual [T, H], in one kernel."""
    _check(x, weight)
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(f"residual of shape {tuple(residual.shape)} does not match x of {tuple(x.shape)}")
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    if x.shape[0]:
        launch(_rmsnorm_kernel, (x.shape[0],), x, residual, weight, out, new_residual, x.stride(0), residual.stride(0),
                                        out.stride(0), new_residual.stride(0), x.shape[1], eps, HAS_RESIDUAL=True,
                                        BLOCK=triton.next_power_of_2(x.shape[1]), **pdl.launch_opts(x))
    return out, new_residual
