"""SiLU(gate) * up over [gate | up] rows, one read and one write."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, d, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + d + cols, mask=mask, other=0.0)
    # torch rounds silu(gate) to the activation dtype before the product; so do we.
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2d] → silu(x[:, :d]) * x[:, d:] as [T, d]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul expects [T, 2d] with unit stride in its last dim; got {tuple(x.shape)}")
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = min(1024, triton.next_power_of_2(d))
        launch(_silu_and_mul_kernel, (x.shape[0], triton.cdiv(d, block)), x, out, x.stride(0), out.stride(0), d,
                                                                   BLOCK=block, **pdl.launch_opts(x))
    return out
