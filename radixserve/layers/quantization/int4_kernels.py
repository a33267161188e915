"""Triton kernels for 4- and 8-bit group-quantized weights in our layout (`int4_formats`): a GEMV for a few
activation rows that reads the packed bytes once per row and dequantises in registers, and a dequantising copy
into a 16-bit buffer for cuBLAS when the batch is larger. Both round each weight to the activation dtype before it is
used, as a model dequantised at load would hold it, so the two paths differ only in the order of the sums."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch

GEMV_MAX_M = 8  # activation rows the GEMV takes; more go through the dequantised buffer and cuBLAS


@triton.jit
def _weights(Wq, S, Z, rows, c, n_ok, c_ok, stride_wn, stride_sn, group, k0, OUT_DTYPE: tl.constexpr,
             BITS: tl.constexpr):
    """The [BLOCK_N, C] even and odd columns k0 + 2c, k0 + 2c + 1 of BLOCK_N rows, rounded to OUT_DTYPE: a byte's
    two nibbles (4 bits) or two bytes (8 bits)."""
    ok = n_ok[:, None] & c_ok[None, :]
    row = Wq + rows[:, None].to(tl.int64) * stride_wn
    if BITS == 4:
        b = tl.load(row + (k0 // 2 + c)[None, :], mask=ok, other=0)
        q_lo = (b & 15).to(tl.float32)
        q_hi = (b >> 4).to(tl.float32)
    else:
        q_lo = tl.load(row + (k0 + 2 * c)[None, :], mask=ok, other=0).to(tl.float32)
        q_hi = tl.load(row + (k0 + 2 * c + 1)[None, :], mask=ok, other=0).to(tl.float32)
    g = (k0 + 2 * c) // group  # both columns of a pair are in one group (the group is even)
    at = rows[:, None].to(tl.int64) * stride_sn + g[None, :]
    s = tl.load(S + at, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(Z + at, mask=ok, other=0).to(tl.float32)
    lo = ((q_lo - z) * s).to(OUT_DTYPE).to(tl.float32)
    hi = ((q_hi - z) * s).to(OUT_DTYPE).to(tl.float32)
    return lo, hi


@triton.jit
def _int4_gemv_kernel(X, Wq, S, Z, Out, Bias, N, K, stride_xm, stride_wn, stride_sn, stride_om, group,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr):
    """Program (n block, m): Out[m, rows] = X[m] . W[rows] (+ bias); 2 BLOCK_C columns a step."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1)
    n_ok = rows < N
    c = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    x_row = X + m.to(tl.int64) * stride_xm
    for k0 in range(0, K, 2 * BLOCK_C):
        c_ok = k0 + 2 * c < K
        lo, hi = _weights(Wq, S, Z, rows, c, n_ok, c_ok, stride_wn, stride_sn, group, k0, X.dtype.element_ty,
                          BITS)
        xe = tl.load(x_row + k0 + 2 * c, mask=c_ok, other=0.0).to(tl.float32)
        xo = tl.load(x_row + k0 + 2 * c + 1, mask=c_ok, other=0.0).to(tl.float32)
        acc += tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Out + m.to(tl.int64) * stride_om + rows, acc.to(Out.dtype.element_ty), mask=n_ok)


@triton.jit
def _int4_dequant_kernel(Wq, S, Z, Out, N, K, stride_wn, stride_sn, stride_on, group,
                         BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr):
    """Out[rows, 2c .. 2c + 1] for BLOCK_N rows and BLOCK_C column pairs."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    n_ok = rows < N
    c_ok = 2 * c < K
    lo, hi = _weights(Wq, S, Z, rows, c, n_ok, c_ok, stride_wn, stride_sn, group, 0, Out.dtype.element_ty, BITS)
    at = Out + rows[:, None].to(tl.int64) * stride_on + 2 * c[None, :]
    ok = n_ok[:, None] & c_ok[None, :]
    tl.store(at, lo.to(Out.dtype.element_ty), mask=ok)
    tl.store(at + 1, hi.to(Out.dtype.element_ty), mask=ok)


def _check(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, k: int, bits: int) -> int:
    n = qweight.shape[0]
    if bits not in (4, 8) or qweight.dtype != torch.uint8 or qweight.shape[1] * (8 // bits) != k \
            or qzeros.dtype != torch.uint8 or scales.shape != qzeros.shape or scales.shape[0] != n \
            or k % scales.shape[1]:
        raise ValueError(f"int kernels: qweight {tuple(qweight.shape)} {qweight.dtype}, scales {tuple(scales.shape)}, "
                         f"qzeros {tuple(qzeros.shape)} {qzeros.dtype} do not describe a [*, {k}] {bits}-bit weight "
                         f"in groups")
    group = k // scales.shape[1]
    if group % 2:
        raise ValueError(f"int kernels: the group ({group} columns) must be even")
    if qweight.stride(1) != 1 or scales.stride(1) != 1 or qzeros.stride(1) != 1 or scales.stride(0) != qzeros.stride(0):
        raise ValueError("int kernels: qweight, scales and qzeros must be row-major, scales and qzeros alike")
    return group


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
              bias: torch.Tensor | None = None, bits: int = 4) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M, unit stride) times the dequantised weight's transpose: [M, N] in x's dtype."""
    m, k = x.shape
    if m > GEMV_MAX_M or x.stride(1) != 1:
        raise ValueError(f"int4_gemv takes at most {GEMV_MAX_M} unit-stride rows, got {tuple(x.shape)}")
    group = _check(qweight, scales, qzeros, k, bits)
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_c = 16, 64
    launch(_int4_gemv_kernel, (triton.cdiv(n, block_n), m), x, qweight, scales, qzeros, out,
           bias if bias is not None else out, n, k, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
           group, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_C=block_c, BITS=bits)
    return out


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, k: int,
                    dtype: torch.dtype, bits: int = 4) -> torch.Tensor:
    """The weight [N, K] in `dtype`, each value (q - zero) * scale rounded once."""
    group = _check(qweight, scales, qzeros, k, bits)
    n = qweight.shape[0]
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_c = 16, 64
    launch(_int4_dequant_kernel, (triton.cdiv(n, block_n), triton.cdiv(k // 2, block_c)), qweight, scales,
           qzeros, out, n, k, qweight.stride(0), scales.stride(0), out.stride(0), group, BLOCK_N=block_n,
           BLOCK_C=block_c, BITS=bits)
    return out
