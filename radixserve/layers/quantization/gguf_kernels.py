"""Triton GEMM/GEMV that reads GGUF Q8_0 / Q4_K weights in their packed fields (`gguf_formats`) and dequantises
each [BLOCK_N, BLOCK_K] tile in registers: out = x @ dequant(W).T (+ bias). The dequantised tile is rounded to the
activation dtype before the tensor-core product, as a dequantise-at-load model would round its weights."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch


@triton.jit
def _gguf_gemm_kernel(X, Wq, Sc, Mn, D, Dmin, Out, Bias, M, N, K, stride_xm, stride_wn, stride_sn, stride_dn,
                      stride_om, Q4K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_n = offs_n[:, None].to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k  # [BLOCK_K] absolute columns
        mask_k = kk < K
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        mask_w = mask_n[:, None] & mask_k[None, :]
        sub = kk // 32
        if Q4K:
            byte = (kk // 64) * 32 + (kk % 32)
            shift = ((kk // 32) % 2) * 4
            qb = tl.load(Wq + rows_n * stride_wn + byte[None, :], mask=mask_w, other=0)
            q = ((qb.to(tl.int32) >> shift[None, :]) & 0xF).to(tl.float32)
            sc = tl.load(Sc + rows_n * stride_sn + sub[None, :], mask=mask_w, other=0).to(tl.float32)
            mn = tl.load(Mn + rows_n * stride_sn + sub[None, :], mask=mask_w, other=0).to(tl.float32)
            d = tl.load(D + rows_n * stride_dn + (kk // 256)[None, :], mask=mask_w, other=0.0).to(tl.float32)
            dm = tl.load(Dmin + rows_n * stride_dn + (kk // 256)[None, :], mask=mask_w,
                         other=0.0).to(tl.float32)
            w = d * sc * q - dm * mn
        else:
            q = tl.load(Wq + rows_n * stride_wn + kk[None, :], mask=mask_w, other=0).to(tl.float32)
            d = tl.load(D + rows_n * stride_dn + sub[None, :], mask=mask_w, other=0.0).to(tl.float32)
            w = d * q
        if FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def gguf_gemm(x: torch.Tensor, fmt: str, fields: dict[str, torch.Tensor], n: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) times the packed weight [N, K] of format `fmt` ("Q8_0" or "Q4_K")."""
    m, k = x.shape
    q4k = fmt == "Q4_K"
    if x.stride(-1) != 1 or k % (256 if q4k else 32):
        raise ValueError(f"gguf_gemm needs row-contiguous x with K a multiple of the {fmt} block; got {tuple(x.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    wq, d = fields["qweight"], fields["d"]
    sc, mn, dmin = (fields["scales"], fields["mins"], fields["dmin"]) if q4k else (d, d, d)
    small = m <= 16
    block_m = 16 if small else 64
    block_n = 32 if small else 64
    block_k = 128 if small else 64
    if not x.is_cuda:  # the interpreter: small tiles
        block_n, block_k = 16, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    launch(_gguf_gemm_kernel, grid, x, wq, sc, mn, d, dmin, out, bias if bias is not None else d, m, n, k,
           x.stride(0), wq.stride(0), sc.stride(0), d.stride(0), out.stride(0), Q4K=q4k, HAS_BIAS=bias is not None,
           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32=x.dtype == torch.float32 or not x.is_cuda,
           num_warps=4, num_stages=3 if x.is_cuda else 1)
    return out
