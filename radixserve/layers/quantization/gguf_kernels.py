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


@triton.jit
def _q4_k_gemv_kernel(X, Wq, Sc, Mn, D, Dmin, Out, Bias, N, K, stride_xm, stride_wn, stride_sn, stride_dn, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One activation row times BLOCK_N Q4_K rows, one 256-weight super-block per step: the 128 q bytes as
    [4 chunks, 32] (low nibbles: weights 64c + l, high: 64c + 32 + l), each sub-block's dot product with x scaled by
    d * sc, minus dmin * m times the sub-block's sum of x (no dequantised tile is formed)."""
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n[:, None, None].to(tl.int64)
    c = tl.arange(0, 4)
    offs_l = tl.arange(0, 32)
    byte = c[:, None] * 32 + offs_l[None, :]  # [4, 32]
    xcol = c[:, None] * 64 + offs_l[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, K // 256):
        x_lo = tl.load(X + m * stride_xm + s * 256 + xcol).to(tl.float32)  # [4, 32]
        x_hi = tl.load(X + m * stride_xm + s * 256 + 32 + xcol).to(tl.float32)
        b = tl.load(Wq + rows * stride_wn + s * 128 + byte[None, :, :], mask=mask_n[:, None, None], other=0)
        b = b.to(tl.int32)
        dot_lo = tl.sum((b & 0xF).to(tl.float32) * x_lo[None, :, :], axis=2)  # [BLOCK_N, 4]
        dot_hi = tl.sum((b >> 4).to(tl.float32) * x_hi[None, :, :], axis=2)
        sub = Sc + offs_n[:, None].to(tl.int64) * stride_sn + s * 8 + 2 * c[None, :]  # [BLOCK_N, 4]
        msub = Mn + offs_n[:, None].to(tl.int64) * stride_sn + s * 8 + 2 * c[None, :]
        sc_lo = tl.load(sub, mask=mask_n[:, None], other=0).to(tl.float32)
        sc_hi = tl.load(sub + 1, mask=mask_n[:, None], other=0).to(tl.float32)
        mn_lo = tl.load(msub, mask=mask_n[:, None], other=0).to(tl.float32)
        mn_hi = tl.load(msub + 1, mask=mask_n[:, None], other=0).to(tl.float32)
        d = tl.load(D + offs_n.to(tl.int64) * stride_dn + s, mask=mask_n, other=0.0).to(tl.float32)
        dm = tl.load(Dmin + offs_n.to(tl.int64) * stride_dn + s, mask=mask_n, other=0.0).to(tl.float32)
        xs_lo = tl.sum(x_lo, axis=1)  # [4]
        xs_hi = tl.sum(x_hi, axis=1)
        acc += d * tl.sum(sc_lo * dot_lo + sc_hi * dot_hi, axis=1)
        acc -= dm * tl.sum(mn_lo * xs_lo[None, :] + mn_hi * xs_hi[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, acc.to(Out.dtype.element_ty), mask=mask_n)


@triton.jit
def _q8_0_gemv_kernel(X, Wq, D, Out, Bias, N, K, stride_xm, stride_wn, stride_dn, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One activation row times BLOCK_N Q8_0 rows, eight 32-weight blocks per step; each block's int8 dot product
    with x times its d."""
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    g = tl.arange(0, 8)
    offs_l = tl.arange(0, 32)
    cols = g[:, None] * 32 + offs_l[None, :]  # [8, 32]
    rows = offs_n[:, None, None].to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, 256):
        x = tl.load(X + m * stride_xm + k0 + cols).to(tl.float32)
        q = tl.load(Wq + rows * stride_wn + k0 + cols[None, :, :], mask=mask_n[:, None, None], other=0)
        dot = tl.sum(q.to(tl.float32) * x[None, :, :], axis=2)  # [BLOCK_N, 8]
        d = tl.load(D + offs_n[:, None].to(tl.int64) * stride_dn + k0 // 32 + g[None, :], mask=mask_n[:, None],
                    other=0.0).to(tl.float32)
        acc += tl.sum(dot * d, axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, acc.to(Out.dtype.element_ty), mask=mask_n)


GEMV_MAX_M = 4


def gguf_gemv(x: torch.Tensor, fmt: str, fields: dict[str, torch.Tensor], n: int,
              bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """The product for a few rows (decode) straight from the packed fields; None when K is not a multiple of 256
    (the caller uses `gguf_gemm`)."""
    m, k = x.shape
    if k % 256 or x.stride(-1) != 1:
        return None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    wq, d = fields["qweight"], fields["d"]
    b = bias if bias is not None else d
    block_n = 32 if x.is_cuda else 8
    grid = (m, triton.cdiv(n, block_n))
    opts = dict(num_warps=4, num_stages=3) if x.is_cuda else {}
    if fmt == "Q4_K":
        sc = fields["scales"]
        launch(_q4_k_gemv_kernel, grid, x, wq, sc, fields["mins"], d, fields["dmin"], out, b, n, k, x.stride(0),
               wq.stride(0), sc.stride(0), d.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
               **opts)
    else:
        launch(_q8_0_gemv_kernel, grid, x, wq, d, out, b, n, k, x.stride(0), wq.stride(0), d.stride(0),
               out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, **opts)
    return out
