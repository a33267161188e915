"""GGUF Q8_0 / Q4_K products that the decode GEMVs (`gguf_kernels`: Q8_0 up to 4 rows, Q4_K up to 16) do not take:
the weight dequantised once into a 16-bit buffer (one Triton launch over the packed fields, `gguf_formats`) and
cuBLAS; for Q8_0 products of at most DEQUANT_MIN_M rows whose K is not a multiple of 256 (the GEMVs' block), a
tiled Triton GEMM that dequantises each [BLOCK_N, BLOCK_K] tile in registers, out = x @ dequant(W).T (+ bias).
The dequantised weight is rounded to the activation dtype before the product, as a dequantise-at-load model would
round its weights."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization.gguf_kernels import GEMV_MAX_M
from radixserve.layers.triton_ops.launch import launch


@triton.jit
def _q8_0_gemm_kernel(X, Wq, D, Out, Bias, M, N, K, stride_xm, stride_wn, stride_dn, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      FP32: tl.constexpr):
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
        q = tl.load(Wq + rows_n * stride_wn + kk[None, :], mask=mask_w, other=0).to(tl.float32)
        d = tl.load(D + rows_n * stride_dn + (kk // 32)[None, :], mask=mask_w, other=0.0).to(tl.float32)
        w = d * q
        if FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _q4_k_dequant_kernel(Wq, Sc, Mn, D, Dmin, Out, N, stride_wn, stride_sn, stride_dn, stride_on,
                         BLOCK_N: tl.constexpr, CH: tl.constexpr):
    """Out[rows, cols] of the 16-bit weight for BLOCK_N rows x CH chunks of 64 columns. A chunk is 32 bytes: the
    low nibbles are its first sub-block of 32 weights, the high nibbles its second; the sub-block scales and mins
    and the super-block (256 columns) d / dmin are loaded once per row and sub-block and broadcast."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1) * CH + tl.arange(0, CH)  # chunk index (64 columns each)
    j = tl.arange(0, 32)
    r3 = rows[:, None, None].to(tl.int64)
    ok = rows[:, None, None] < N
    b = tl.load(Wq + r3 * stride_wn + c[None, :, None] * 32 + j[None, None, :], mask=ok, other=0).to(tl.int32)
    r2 = rows[:, None].to(tl.int64)
    ok2 = rows[:, None] < N
    d = tl.load(D + r2 * stride_dn + c[None, :] // 4, mask=ok2, other=0.0).to(tl.float32)
    dm = tl.load(Dmin + r2 * stride_dn + c[None, :] // 4, mask=ok2, other=0.0).to(tl.float32)
    s_lo = tl.load(Sc + r2 * stride_sn + 2 * c[None, :], mask=ok2, other=0).to(tl.float32) * d
    s_hi = tl.load(Sc + r2 * stride_sn + 2 * c[None, :] + 1, mask=ok2, other=0).to(tl.float32) * d
    m_lo = tl.load(Mn + r2 * stride_sn + 2 * c[None, :], mask=ok2, other=0).to(tl.float32) * dm
    m_hi = tl.load(Mn + r2 * stride_sn + 2 * c[None, :] + 1, mask=ok2, other=0).to(tl.float32) * dm
    lo = (b & 0xF).to(tl.float32) * s_lo[:, :, None] - m_lo[:, :, None]
    hi = ((b >> 4) & 0xF).to(tl.float32) * s_hi[:, :, None] - m_hi[:, :, None]
    o = Out + r3 * stride_on + c[None, :, None] * 64 + j[None, None, :]
    tl.store(o, lo.to(Out.dtype.element_ty), mask=ok)
    tl.store(o + 32, hi.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _q8_0_dequant_kernel(Wq, D, Out, N, stride_wn, stride_dn, stride_on, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """Out[rows, cols] for BLOCK_N rows x NB blocks of 32 columns: int8 values times their block's scale."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    j = tl.arange(0, 32)
    r3 = rows[:, None, None].to(tl.int64)
    ok = rows[:, None, None] < N
    cols = blk[None, :, None] * 32 + j[None, None, :]
    q = tl.load(Wq + r3 * stride_wn + cols, mask=ok, other=0).to(tl.float32)
    d = tl.load(D + rows[:, None].to(tl.int64) * stride_dn + blk[None, :], mask=rows[:, None] < N,
                other=0.0).to(tl.float32)
    tl.store(Out + r3 * stride_on + cols, (q * d[:, :, None]).to(Out.dtype.element_ty), mask=ok)


def gguf_dequantize(fmt: str, fields: dict[str, torch.Tensor], n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in `dtype` from its packed fields, in one Triton launch (the fields' device)."""
    q4k = fmt == "Q4_K"
    if fmt not in ("Q4_K", "Q8_0") or k % (256 if q4k else 32):
        raise ValueError(f"gguf_dequantize: {fmt} with {k} columns (Q4_K: a multiple of 256; Q8_0: of 32)")
    wq, d = fields["qweight"], fields["d"]
    out = torch.empty((n, k), dtype=dtype, device=wq.device)
    if n == 0:
        return out
    block_n = 16
    if q4k:
        ch = 4  # a program: 16 rows x one super-block (256 columns)
        launch(_q4_k_dequant_kernel, (triton.cdiv(n, block_n), k // (64 * ch)), wq, fields["scales"],
               fields["mins"], d, fields["dmin"], out, n, wq.stride(0), fields["scales"].stride(0), d.stride(0),
               out.stride(0), BLOCK_N=block_n, CH=ch)
    else:
        nb = 8 if k % 256 == 0 else 1
        launch(_q8_0_dequant_kernel, (triton.cdiv(n, block_n), k // (32 * nb)), wq, d, out, n, wq.stride(0),
               d.stride(0), out.stride(0), BLOCK_N=block_n, NB=nb)
    return out


# Above this many rows a product dequantises the weight once into a 16-bit buffer (one pass over the packed bytes
# and one write of the 16-bit weight) and multiplies with cuBLAS: on an H200 at the 8B shape a Q4_K decode step of
# 64 rows takes 13.7 ms that way and a 512-token prefill 18.7 ms (docs/PERFORMANCE.md, 2026-12-01). A tiled kernel
# dequantises the whole weight again for every block of rows (~90 ms a pass over the 8B's Q4_K weights, where a
# 512-token prefill in 64-row tiles took 745 ms), so the Q8_0 one below is kept only for the few rows the decode
# GEMVs cannot take (K not a multiple of 256); every Q4_K K is, so Q4_K has no tiled kernel.
DEQUANT_MIN_M = GEMV_MAX_M


def gguf_gemm(x: torch.Tensor, fmt: str, fields: dict[str, torch.Tensor], n: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) times the packed weight [N, K] of format `fmt` ("Q8_0" or "Q4_K"): the dequantised
    weight and cuBLAS, or for Q8_0 up to DEQUANT_MIN_M rows the tiled kernel that dequantises in registers."""
    m, k = x.shape
    q4k = fmt == "Q4_K"
    if x.stride(-1) != 1 or k % (256 if q4k else 32):
        raise ValueError(f"gguf_gemm needs row-contiguous x with K a multiple of the {fmt} block; got {tuple(x.shape)}")
    if q4k or m > DEQUANT_MIN_M:
        w = gguf_dequantize(fmt, fields, n, k, x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    wq, d = fields["qweight"], fields["d"]
    block_m, block_n, block_k = 16, 32, 128  # one block of rows: m <= DEQUANT_MIN_M here
    if not x.is_cuda:  # the interpreter: small tiles
        block_n, block_k = 16, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    launch(_q8_0_gemm_kernel, grid, x, wq, d, out, bias if bias is not None else d, m, n, k, x.stride(0),
           wq.stride(0), d.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
           BLOCK_K=block_k, FP32=x.dtype == torch.float32 or not x.is_cuda, num_warps=4,
           num_stages=3 if x.is_cuda else 1)
    return out
