"""FP8 products for a middling number of rows (decode of a batch, M = 17..256): out = x @ (W * scale).T.

At these sizes a linear layer is still bound by its weight's bytes (8B shape at M = 64: 2 x 64 FLOP per weight byte
against ~230 FLOP per byte the fp8 tensor cores can do), so what counts is that every SM streams weight rows. A
library GEMM tiles the output in 128-column blocks and, for N = 4,096, leaves most of the 132 SMs idle. This kernel
is the product transposed: each program takes BLOCK_N weight rows (the MMA's long side) against x.T [K, BLOCK_M]
(the batch, the MMA's narrow side), so N / BLOCK_N programs stream the weight.

- "w8a8": x is quantised per token first (`per_token_group_quant_fp8`, one small kernel), the product runs on the
  fp8 tensor cores, and the epilogue applies the weight's per-channel scale and x's per-token scale.
- "w8a16": the fp8 tile is widened to x's dtype in registers and multiplied on the 16-bit tensor cores (no
  activation scales: exact in x).

- "scaled_mm_t": cuBLASLt's fp8 product transposed, out.T = W @ x.T with the per-channel scales on the long side
  (`torch._scaled_mm` row-wise, the batch padded to a multiple of 16 rows), the result copied back to [M, N]: the
  library then tiles the weight's rows, not the batch.
- "scaled_mm_unit": x quantised per token, cuBLASLt's product with tensor-wise scales of 1 (its tensor-wise fp8
  kernels ran ~2x faster than its row-wise ones at 64-256 rows on an H200, `benchmarks/bench_fp8_scaled_mm.py`),
  then x's per-token and the weight's per-channel scales and the bias applied in one pass over the [M, N] result
  (`_scale_rows_cols_kernel`); the unscaled product is rounded to bf16 once before the scales (bf16's range holds
  it; fp16's would not).

Which of these (or `torch._scaled_mm`, the default) runs for a shape and batch comes from the swept table
(`gemv_configs.get_mid`, `benchmarks/sweep_gemv.py --families fp8_mid`); a shape the table lacks keeps
`torch._scaled_mm`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.triton_ops.device_buffers import kept_buffer
from radixserve.layers.triton_ops.launch import launch

MAX_M = 256


@triton.jit
def _fp8_mid_kernel(X, XS, W, S, Bias, Out, M, N, K, stride_xm, stride_wn, stride_om,
                    A8: tl.constexpr, FP32: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    xt_ptrs = X + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # x.T [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (the wrapper checks)
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        xt = tl.load(xt_ptrs, mask=mask_m[None, :], other=0.0)
        if A8:
            acc += tl.dot(w, xt)
        elif FP32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(xt.dtype), xt, acc)
        w_ptrs += BLOCK_K
        xt_ptrs += BLOCK_K
    out = acc * tl.load(S + offs_n, mask=mask_n, other=0.0)[:, None]
    if A8:
        out = out * tl.load(XS + offs_m, mask=mask_m, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    o_ptrs = Out + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])


def fp8_mid_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, cfg: GemvConfig,
               bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] (rows contiguous, M <= MAX_M) times the fp8 weight w [N, K] with per-channel float32 scales ([N] or
    [N, 1]) -> [M, N] `out_dtype`, with `cfg.kernel` "w8a8" or "w8a16" (block_n weight rows, block_m batch rows,
    block_k columns a step). None when the shape or the config does not suit this kernel: the caller keeps its
    own path."""
    from radixserve.layers.quantization.fp8_kernels import per_token_group_quant_fp8

    m, k = x.shape
    n = w.shape[0]
    if cfg.kernel == "scaled_mm_unit" and scale.numel() == n and x.stride(-1) == 1 and w.stride(-1) == 1 \
            and k % 16 == 0 and n % 16 == 0 and w.shape[1] == k and out_dtype in (torch.bfloat16, torch.float32):
        return scaled_mm_unit(x, w, scale, out_dtype, bias)
    if cfg.kernel == "scaled_mm_t" and scale.numel() == n and x.stride(-1) == 1 and w.stride(-1) == 1 \
            and k % 16 == 0 and n % 16 == 0:
        return scaled_mm_transposed(x, w, scale, out_dtype, bias)
    if cfg.kernel not in ("w8a8", "w8a16") or m > MAX_M or k % 16 or scale.numel() != n or x.stride(-1) != 1 \
            or w.stride(-1) != 1 or w.shape[1] != k:
        return None
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    block_k = cfg.block_k
    while k % block_k:
        block_k //= 2
    a8 = cfg.kernel == "w8a8"
    if a8:
        xq, xs = per_token_group_quant_fp8(x, k)
    else:
        xq, xs = x, scale
    s = scale.reshape(-1)
    block_m = max(16, cfg.block_m)  # not cut to m: one compiled kernel serves every batch size of a table entry
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages) if x.is_cuda else {}
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))
    launch(_fp8_mid_kernel, grid, xq, xs, w, s, bias if bias is not None else s, out, m, n, k, xq.stride(0),
           w.stride(0), out.stride(0), A8=a8, FP32=not a8 and (x.dtype == torch.float32 or not x.is_cuda),
           HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, **opts)
    return out


def scaled_mm_transposed(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (quantised per token here) times the fp8 weight w [N, K] with per-channel scales, computed as
    (W @ x.T).T by `torch._scaled_mm` (row-wise scales: the weight's on the rows of the product, x's on its
    columns); the rows of x are padded to a multiple of 16 (the library's alignment; the padding's columns of the
    product are dropped). Returns a contiguous [M, N] `out_dtype`."""
    from radixserve.layers.quantization.fp8_kernels import per_token_group_quant_fp8

    m, k = x.shape
    mp = -(-m // 16) * 16
    if mp != m:
        x = torch.cat([x, x.new_zeros(mp - m, k)])
    xq, xs = per_token_group_quant_fp8(x, k)
    out_t = torch._scaled_mm(w, xq.t(), scale_a=scale.reshape(-1, 1).float(), scale_b=xs.reshape(1, -1),
                             out_dtype=out_dtype)
    out = out_t[:, :m].t().contiguous()
    return out if bias is None else out + bias.to(out_dtype)


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on `device` (torch._scaled_mm's tensor-wise scale)."""
    return kept_buffer("fp8 unit scale", device, lambda d: torch.ones((), dtype=torch.float32, device=d))


@triton.jit
def _scale_rows_cols_kernel(Out, XS, WS, Bias, M, N, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """In place: Out[m, n] = Out[m, n] * XS[m] * WS[n] (+ Bias[n]), in float32, stored in Out's dtype."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]
    ptrs = Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    o = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    xs = tl.load(XS + offs_m, mask=mask_m, other=0.0)
    ws = tl.load(WS + offs_n, mask=mask_n, other=0.0)
    o = o * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        o += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(ptrs, o.to(Out.dtype.element_ty), mask=mask)


def scaled_mm_unit(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (quantised per token here) times the fp8 weight w [N, K] with per-channel scales: the product by
    `torch._scaled_mm` with tensor-wise scales of 1, then both scales and the bias in one pass (`out_dtype`
    bfloat16 or float32: the unscaled product overflows float16)."""
    from radixserve.layers.quantization.fp8_kernels import per_token_group_quant_fp8

    m, k = x.shape
    n = w.shape[0]
    xq, xs = per_token_group_quant_fp8(x, k)
    one = _unit_scale(x.device)
    out = torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=out_dtype)
    if m == 0:
        return out
    block_m, block_n = 16, 256
    ws = scale.reshape(-1)
    launch(_scale_rows_cols_kernel, (triton.cdiv(n, block_n), triton.cdiv(m, block_m)), out, xs, ws,
           bias if bias is not None else ws, m, n, out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m,
           BLOCK_N=block_n, **(dict(num_warps=4) if x.is_cuda else {}))
    return out
