"""x's quantisation for the Q4_K one-row GEMV (`gguf_chunk_kernels`, dp4c) done in the launch of the operation that
produces x, so that a decode layer runs one small kernel before each product instead of two:

- `q8_1_blocks_normed`: the residual add and RMSNorm before q/k/v and gate/up (the new residual is stored too);
- `q8_1_blocks_gated`: SiLU(gate) * up before the down projection.

x is rounded exactly as the unfused kernels round it (`triton_ops/norm.py`, `triton_ops/activation.py`: every
intermediate to the activation dtype) and then quantised as `q8_1_blocks` quantises it, so a fused layer computes
what the norm or activation kernel followed by `q8_1_blocks` would. One program per row and BLOCK_G 32-column
blocks; with the norm, each program first takes the whole row's statistics itself (as the norm kernel does, from
one tile of the row: a few KB that stay in the L2)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization.gguf_chunk_kernels import _store_dp4c_factors
from radixserve.layers.quantization.gguf_int_kernels import _q8_1_row_tile, _q8_1_store_words
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

BLOCK_G = 16  # 32-column blocks a program: 512 columns


@triton.jit
def _q8_1_normed_blocks_kernel(X, Res, NormW, ResOut, Words, F, K, stride_xm, stride_rm, stride_om, eps,
                               HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
                               PDL: tl.constexpr = 0):
    """x [M, K] (+ residual) -> RMSNorm(x + residual) * weight quantised for dp4c (Words [M, K / 4], F [M, K / 8]);
    x + residual stored to ResOut (HAS_RES) by the program that owns those columns."""
    pdl_prologue(PDL)
    dtype = X.dtype.element_ty
    m, g, mask_g, offs = _q8_1_row_tile(K, BLOCK_G)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    row = tl.load(X + m * stride_xm + cols, mask=mask, other=0.0)
    if HAS_RES:
        row = (row.to(tl.float32) + tl.load(Res + m * stride_rm + cols, mask=mask, other=0.0).to(tl.float32))
        row = row.to(dtype)
    rf = row.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(rf * rf, axis=0) / K + eps)
    mask3 = mask_g[:, None, None]
    x = tl.load(X + m * stride_xm + offs, mask=mask3, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(Res + m * stride_rm + offs, mask=mask3, other=0.0).to(tl.float32)).to(dtype)
        tl.store(ResOut + m * stride_om + offs, x, mask=mask3)
    normed = (x.to(tl.float32) * rstd).to(dtype)
    w = tl.load(NormW + offs, mask=mask3, other=0.0).to(tl.float32)
    y = (normed.to(tl.float32) * w).to(dtype).to(tl.float32)
    xs, qsum, xsum = _q8_1_store_words(y, Words, m, g, mask_g, K)
    _store_dp4c_factors(F, m, g, mask_g, xs, qsum, xsum, K)


@triton.jit
def _q8_1_gated_blocks_kernel(X, Words, F, K, stride_xm, BLOCK_G: tl.constexpr, PDL: tl.constexpr = 0):
    """x [M, 2K] = [gate | up] -> SiLU(gate) * up [M, K] quantised for dp4c (Words [M, K / 4], F [M, K / 8])."""
    pdl_prologue(PDL)
    dtype = X.dtype.element_ty
    m, g, mask_g, offs = _q8_1_row_tile(K, BLOCK_G)
    mask3 = mask_g[:, None, None]
    gate = tl.load(X + m * stride_xm + offs, mask=mask3, other=0.0).to(tl.float32)
    up = tl.load(X + m * stride_xm + K + offs, mask=mask3, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(dtype).to(tl.float32)
    xs, qsum, xsum = _q8_1_store_words(y, Words, m, g, mask_g, K)
    _store_dp4c_factors(F, m, g, mask_g, xs, qsum, xsum, K)


def _outputs(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if k % 64:
        raise ValueError(f"dp4c's quantised x needs a multiple of 64 columns; got {k}")
    m = x.shape[0]
    return (torch.empty((m, k // 4), dtype=torch.int32, device=x.device),
            torch.empty((m, k // 8), dtype=torch.float32, device=x.device))


def _check_rows(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what} expects a 2-D tensor with unit stride in its last dim; got {tuple(x.shape)}")


def q8_1_blocks_normed(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [M, K] -> (words, factors, x + residual or None): `q8_1_blocks(weight * RMSNorm(x + residual))` and the new
    residual in one launch (the norm's output itself is never stored)."""
    _check_rows(x, "q8_1_blocks_normed")
    m, k = x.shape
    if weight.shape != (k,):
        raise ValueError(f"norm weight of shape {tuple(weight.shape)} does not match rows of {k}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual of shape {tuple(residual.shape)} does not match x of {tuple(x.shape)}")
    words, f = _outputs(x, k)
    new_res = torch.empty_like(x) if residual is not None else None
    if m:
        res = residual if residual is not None else x
        out_res = new_res if new_res is not None else x
        launch(_q8_1_normed_blocks_kernel, (m, triton.cdiv(k // 32, BLOCK_G)), x, res, weight, out_res, words, f,
               k, x.stride(0), res.stride(0), out_res.stride(0), eps, HAS_RES=residual is not None,
               BLOCK_K=triton.next_power_of_2(k), BLOCK_G=BLOCK_G, **(dict(num_warps=4) if x.is_cuda else {}),
               **pdl.launch_opts(x))
    return words, f, new_res


def q8_1_blocks_gated(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2K] = [gate | up] -> (words, factors) of `q8_1_blocks(silu(gate) * up)` in one launch."""
    _check_rows(x, "q8_1_blocks_gated")
    m, k2 = x.shape
    if k2 % 2:
        raise ValueError(f"q8_1_blocks_gated expects [gate | up] rows of even width; got {k2}")
    k = k2 // 2
    words, f = _outputs(x, k)
    if m:
        launch(_q8_1_gated_blocks_kernel, (m, triton.cdiv(k // 32, BLOCK_G)), x, words, f, k, x.stride(0),
               BLOCK_G=BLOCK_G, **(dict(num_warps=4) if x.is_cuda else {}), **pdl.launch_opts(x))
    return words, f
