"""Triton kernels for FP8 linear layers.

- `per_token_group_quant_fp8(x, group)`: dynamic activation scales, one per `group` columns of each row
  (group = the row width: per-token scales), and the row quantised to float8_e4m3fn.
- `fp8_gemm(a, b, b_scale, ...)`: out = a @ dequant(b).T with b [N, K] float8 and float32 scales per
  (group_n x group_k) block of b (group_n = 1, group_k = K: per-channel; 128 x 128: block-wise). `a` is either
  float8 with its per-(row, group_k) scales (W8A8: the fp8 tensor-core product, scales applied per K tile), or a
  16/32-bit activation (W8A16: b is widened in the kernel; used for small batches, where the product is bound by
  the bytes of b and quantising a would only add a kernel).
Both are tested on the CPU under TRITON_INTERPRET=1 against the torch references in `fp8.py`."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch


@triton.jit
def _group_quant_kernel(X, Q, S, stride_x, stride_q, group, groups_per_row, eps, fmax, BLOCK: tl.constexpr,
                        ONE_PASS: tl.constexpr):
    """One program per (row, group). ONE_PASS (the group fits one BLOCK): the group is loaded once and kept in
    registers, so a per-token quantisation of a decode batch costs one load latency, not two passes of several."""
    g = tl.program_id(0).to(tl.int64)
    row = g // groups_per_row
    col0 = (g % groups_per_row) * group
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + col0 + offs, mask=offs < group, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x)), eps) / fmax
        q = tl.minimum(tl.maximum(x / scale, -fmax), fmax)
        tl.store(Q + row * stride_q + col0 + offs, q.to(Q.dtype.element_ty), mask=offs < group)
        tl.store(S + g, scale)
        return
    amax = tl.zeros((), dtype=tl.float32)
    for c in range(0, group, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + col0 + offs, mask=offs < group, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x)))
    scale = tl.maximum(amax, eps) / fmax
    for c in range(0, group, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + col0 + offs, mask=offs < group, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -fmax), fmax)
        tl.store(Q + row * stride_q + col0 + offs, q.to(Q.dtype.element_ty), mask=offs < group)
    tl.store(S + g, scale)


ONE_PASS_MAX = 16384  # widest group quantised from registers in one pass (per-token scales of an 8B's rows)


def per_token_group_quant_fp8(x: torch.Tensor, group: int, dtype: torch.dtype = torch.float8_e4m3fn,
                              eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (q [M, K] `dtype`, scales [M, K // group] float32), x ~= q * scale."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % group:
        raise ValueError(f"group quantisation needs a 2-D row-contiguous x whose width is a multiple of {group}; "
                         f"got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    s = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    one_pass = group <= ONE_PASS_MAX
    block = triton.next_power_of_2(group) if one_pass else 1024
    warps = 1 if block < 512 else min(16, max(4, block // 1024))
    launch(_group_quant_kernel, (m * (k // group),), x, q, s, x.stride(0), q.stride(0), group, k // group, eps,
           float(torch.finfo(dtype).max), BLOCK=block, ONE_PASS=one_pass, num_warps=warps)
    return q, s


@triton.jit
def _fp8_gemm_kernel(A, B, C, As, Bs, Bias, M, N, K, stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                     group_n, group_k, a_group_k,
                     A_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = B + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    bs_ptrs = Bs + (offs_n // group_n) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        b_s = tl.load(bs_ptrs + k0 // group_k, mask=mask_n, other=0.0)
        if A_FP8:
            a_s = tl.load(As + offs_m * stride_asm + k0 // a_group_k, mask=mask_m, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc += tl.dot(a, b.to(a.dtype)) * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, group_n: int, group_k: int,
             out_dtype: torch.dtype, a_scale: torch.Tensor | None = None, a_group_k: int | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] (fp8 with `a_scale` [M, K // a_group_k], or 16/32-bit), b [N, K] fp8, b_scale
    [ceil(N / group_n), ceil(K / group_k)] float32 -> [M, N] `out_dtype`."""
    m, k = a.shape
    n = b.shape[0]
    a_fp8 = a_scale is not None
    span = math.gcd(k, group_k, a_group_k or k)  # a K tile must lie inside one scale group of a and of b
    block_k = next((b for b in (128, 64, 32, 16) if span % b == 0), 16)
    if k % block_k or group_k % block_k or (a_fp8 and (a_group_k or k) % block_k) or b.shape[1] != k \
            or a.stride(-1) != 1 or b.stride(-1) != 1 or b_scale.stride(-1) != 1:
        raise ValueError(f"fp8_gemm cannot tile a {tuple(a.shape)} x {tuple(b.shape)} product with scale groups "
                         f"{group_n}x{group_k}")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if m <= 16 else 64 if m <= 64 else 128
    a_s = a_scale if a_fp8 else b_scale
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    launch(_fp8_gemm_kernel, grid, a, b, out, a_s, b_scale, bias if bias is not None else b_scale, m, n, k,
           a.stride(0), b.stride(0), out.stride(0), a_s.stride(0), b_scale.stride(0), group_n, group_k,
           a_group_k or k, A_FP8=a_fp8, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
           BLOCK_K=block_k, num_warps=4, num_stages=4 if a.is_cuda else 1)
    return out


@triton.jit
def _fp8_gemv_kernel(A, B, C, Bs, Bias, N, K, stride_am, stride_bn, stride_cm, stride_bsn, group_n, group_k,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """One activation row (program axis 0) times BLOCK_N fp8 weight rows, G x 128 columns per step, no tensor
    cores: a decode GEMV is bound by the weight bytes, and elementwise products keep every load wide."""
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_g = tl.arange(0, G)
    offs_l = tl.arange(0, 128)
    cols = offs_g[:, None] * 128 + offs_l[None, :]  # [G, 128]
    w_ptrs = B + offs_n[:, None, None].to(tl.int64) * stride_bn + cols[None, :, :]
    bs_row = Bs + (offs_n // group_n) * stride_bsn
    acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    for k0 in range(0, K, G * 128):
        x = tl.load(A + m * stride_am + k0 + cols).to(tl.float32)  # [G, 128]
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None, None], other=0.0).to(tl.float32)  # [BLOCK_N, G, 128]
        part = tl.sum(w * x[None, :, :], axis=2)  # [BLOCK_N, G]
        s = tl.load(bs_row[:, None] + (k0 + offs_g[None, :] * 128) // group_k, mask=mask_n[:, None], other=0.0)
        acc += part * s
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(C + m * stride_cm + offs_n, out.to(C.dtype.element_ty), mask=mask_n)


def fp8_gemv(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, group_n: int, group_k: int,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """The W8A16 product for a few rows (decode); None when the shape does not suit it (K not a multiple of 256
    or scale groups narrower than 128 columns): the caller uses `fp8_gemm`."""
    m, k = a.shape
    n = b.shape[0]
    g = 2
    if k % (128 * g) or group_k % 128 or a.stride(-1) != 1 or b.stride(-1) != 1 or b_scale.stride(-1) != 1:
        return None
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_n = 16 if a.is_cuda else 8
    launch(_fp8_gemv_kernel, (m, triton.cdiv(n, block_n)), a, b, out, b_scale, bias if bias is not None else b_scale,
           n, k, a.stride(0), b.stride(0), out.stride(0), b_scale.stride(0), group_n, group_k,
           HAS_BIAS=bias is not None, BLOCK_N=block_n, G=g, num_warps=4, num_stages=3 if a.is_cuda else 1)
    return out
