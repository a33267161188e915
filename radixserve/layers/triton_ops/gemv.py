"""Bandwidth-bound product of ONE activation row with a 16-bit weight (decode at batch 1): out = x @ W.T.

At batch 1 a linear layer's time is its weight's bytes over the memory bandwidth. cuBLAS streams the large 8B
projections at ~97% of the copy bandwidth but the small ones (qkv 6144x4096, o 4096x4096) at ~72-77%, and picks
split-K for some shapes, which adds a reduction kernel per call. This kernel cuts N into narrow programs (no
split-K: a 4,096-row weight already gives hundreds of programs), each streaming BLOCK_N whole rows in runs of
BLOCK_K columns into a [BLOCK_N, BLOCK_K] float32 accumulator that is summed once after the loop.

With `silu_mul` the weight is a stacked [gate; up] (2N rows) and the program reads gate row n and up row N + n and
writes silu(gate) * up: the gated MLP's activation in the product's epilogue (one kernel and one [1, 2N] round
trip less a layer).

Which shapes use it, with which tiles, comes from the `gemv_configs` table (families "row16" / "row16_silu"): only
shapes where a sweep on the GPU (`benchmarks/sweep_gemv.py --families row16 row16_silu --baselines`) found it faster
than cuBLAS have an entry; every other shape stays on `F.linear`. (`decode_gemv` is the MoE / MLA models' one-row
kernel, with the input RMSNorm folded in, opted into per layer.)"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization import gemv_configs
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue


@triton.jit
def _gemv_row_kernel(X, W, Bias, Out, N, K, stride_wn, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    up_off = N * stride_wn.to(tl.int64)
    # x through a [BLOCK_N, BLOCK_K] tile of the same layout as the weight tile (each row of it the same K run; the
    # repeats hit L1), so the product needs no exchange of x between threads inside the loop
    x_ptrs = X + cols[None, :] + 0 * rows[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (the wrapper picks BLOCK_K so)
        x = tl.load(x_ptrs).to(tl.float32)
        w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x
        if SILU_MUL:
            wu = tl.load(w_ptrs + up_off, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
            acc_up += wu.to(tl.float32) * x
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + rows, mask=row_ok, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    if SILU_MUL:
        up = tl.sum(acc_up, axis=1)
        if HAS_BIAS:
            up += tl.load(Bias + N + rows, mask=row_ok, other=0.0).to(tl.float32)
        # the roundings of the unfused path: both products in the activation dtype, silu rounded, then the product
        g = out.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        out = act * up.to(dtype).to(tl.float32)
    tl.store(Out + rows, out.to(dtype), mask=row_ok)


ENABLED = os.environ.get("RADIXSERVE_GEMV_ROW", "1") not in ("0", "")


def gemv_config(w: torch.Tensor, silu_mul: bool = False) -> gemv_configs.GemvConfig | None:
    """The table's tiles for this 16-bit [N, K] CUDA weight at one row (N: the stacked rows with `silu_mul`), or
    None where the layer keeps cuBLAS: no entry for the shape (cuBLAS was as fast), another dtype, not on CUDA,
    or RADIXSERVE_GEMV_ROW=0."""
    if not ENABLED or not w.is_cuda or w.dtype not in (torch.bfloat16, torch.float16) or w.dim() != 2 \
            or w.stride(-1) != 1:
        return None
    return gemv_configs.lookup("row16_silu" if silu_mul else "row16", 1, w.shape[0], w.shape[1])


def gemv_row(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
             config: gemv_configs.GemvConfig | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [1, K] times w [N, K] (both 16-bit or float32, rows contiguous) -> [1, N]; with `silu_mul`, w is
    [gate; up] and the result silu(gate) * up [1, N / 2]. `config` gives the tiles (default: small ones)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != w.shape[1] or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"gemv_row expects x [1, K] and w [N, K] with unit stride in K; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")
    n, k = w.shape
    if silu_mul and n % 2:
        raise ValueError(f"gemv_row with silu_mul expects a stacked [gate; up] weight (even rows), got {n}")
    n_out = n // 2 if silu_mul else n
    cfg = config or gemv_configs.GemvConfig("ew", 2, 64 if not x.is_cuda else 1024)
    block_k = min(cfg.block_k, triton.next_power_of_2(k))
    while k % block_k:
        block_k //= 2
    if block_k < 16 and x.is_cuda:
        raise ValueError(f"gemv_row needs K divisible by 16, got {k}")
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages) if x.is_cuda else {}
    launch(_gemv_row_kernel, (triton.cdiv(n_out, cfg.block_n),), x, w, bias if bias is not None else w, out, n_out,
           k, w.stride(0), HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
           **opts, **pdl.launch_opts(x))
    return out
