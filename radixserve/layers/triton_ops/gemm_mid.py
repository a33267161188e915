"""16-bit products of a middling number of rows (decode of a batch, M = 17..256): out = x @ W.T (+ bias).

At these sizes a linear layer is still bound by its weight's bytes (the 8B at M = 64: 64 FLOP per weight byte
against ~230 the bf16 tensor cores can do per byte of HBM), so what counts is that every SM streams weight rows with
enough bytes in flight. cuBLAS tiles the output in 128-column blocks: a 4,096-row weight (o, down) gives 32-64 tiles
for 132 SMs, so it splits K and adds a reduction kernel, or leaves SMs idle; on an H200 it read the 8B's q/k/v, o
and down weights at 59-75% of the copy bandwidth at 64-160 rows (docs/perf-log.md).

`_mid_kernel` is the product transposed: each program takes BLOCK_N weight rows (the MMA's long side) against x.T
[K, BLOCK_M] (the batch, the MMA's narrow side), so N / BLOCK_N programs stream the weight, and with SPLIT_K > 1
each streams K / SPLIT_K of the columns. With SILU_MUL the weight is a stacked [gate; up], a program takes gate
rows n and up rows N + n, and its epilogue writes silu(gate) * up: the gated MLP's activation kernel and the
[M, 2N] round trip are gone. A split program stores its float32 partial tile and takes a ticket (an
atomic count per output tile); the program that draws the last ticket sums the partials, adds the bias, writes the
output and puts the count back to 0, so a split product is one launch and the counts are zero between launches (and
inside CUDA graphs).

Which tiles run for a shape and batch comes from the swept table (families "mid16" and "mid16_silu",
`gemv_configs.get_mid`, swept by `benchmarks/sweep_gemv.py --families mid16 mid16_silu --baselines`; a "tn" entry
only where the kernel beat cuBLAS by 2%); a shape the table lacks stays on `F.linear` (and the activation kernel).
RADIXSERVE_GEMM_MID=0 keeps every shape on cuBLAS. Launched with programmatic dependent launch where the decode
path's other Triton kernels are (`triton_ops/pdl.py`)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization import gemv_configs
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.device_buffers import kept_buffer
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

MIN_M, MAX_M = 17, 256
ENABLED = os.environ.get("RADIXSERVE_GEMM_MID", "1") != "0"
_TICKETS = 1 << 16  # output tiles a split product may have (one int32 count each)


@triton.jit
def _mid_kernel(X, W, Bias, Out, Part, Tickets, M, N, K, stride_xm, stride_wn, stride_om,
                HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, FP32: tl.constexpr, SPLIT_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    pid_m = tl.program_id(0)  # the batch's blocks first: programs next to each other read the same weight rows
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    k_len = K // SPLIT_K  # a multiple of BLOCK_K (the wrapper checks)
    offs_k = pid_k * k_len + tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    xt_ptrs = X + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # x.T [BLOCK_K, BLOCK_M]
    up_off = N * stride_wn.to(tl.int64)  # SILU_MUL: W is [gate; up], up row n is row N + n
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, k_len, BLOCK_K):
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        xt = tl.load(xt_ptrs, mask=mask_m[None, :], other=0.0)
        if FP32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
        if SILU_MUL:
            wu = tl.load(w_ptrs + up_off, mask=mask_n[:, None], other=0.0)
            if FP32:
                acc_up = tl.dot(wu.to(tl.float32), xt.to(tl.float32), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(wu, xt, acc_up)
        w_ptrs += BLOCK_K
        xt_ptrs += BLOCK_K
    last = True
    if SPLIT_K > 1:
        tile = pid_n * tl.num_programs(0) + pid_m
        size: tl.constexpr = BLOCK_N * BLOCK_M
        parts: tl.constexpr = 2 if SILU_MUL else 1
        tile_offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        part = Part + tile.to(tl.int64) * (SPLIT_K * parts * size) + tile_offs
        tl.store(part + pid_k * (parts * size), acc)
        if SILU_MUL:
            tl.store(part + pid_k * (parts * size) + size, acc_up)
        tl.debug_barrier()  # every thread's partial is stored before the ticket is drawn
        ticket = tl.atomic_add(Tickets + tile, 1, sem="acq_rel")
        last = ticket == SPLIT_K - 1
        if last:  # the last split of this tile sums the partials (and puts the count back for the next launch)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(part + s * (parts * size), cache_modifier=".cg")
                if SILU_MUL:
                    acc_up += tl.load(part + s * (parts * size) + size, cache_modifier=".cg")
            tl.atomic_xchg(Tickets + tile, 0)
    if last:
        dtype = Out.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            if SILU_MUL:
                acc_up += tl.load(Bias + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        if SILU_MUL:  # the roundings of the unfused path: both products in the output dtype, silu rounded
            g = acc.to(dtype).to(tl.float32)
            acc = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
        o_ptrs = Out + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(o_ptrs, acc.to(dtype), mask=mask_m[None, :] & mask_n[:, None])


def _tickets(device: torch.device) -> torch.Tensor:
    """The per-device ticket counts (zero between launches)."""
    return kept_buffer("mid_mm tickets", device, lambda d: torch.zeros(_TICKETS, dtype=torch.int32, device=d))


def mid_mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cfg: gemv_configs.GemvConfig,
           silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] times w [N, K] (both x's dtype, unit stride in K) (+ bias [N]) -> [M, N] in x's dtype, with the
    tiles of `cfg` (block_n weight rows and block_m batch rows a program, block_k columns a step, split_k programs
    over K). With `silu_mul` w is a stacked [gate; up] (2N' rows) and the result silu(gate) * up [M, N'] (the
    gated MLP's activation in the epilogue). Raises ValueError for what the kernel cannot take; any M works (the
    table's M is only its speed)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.stride(-1) != 1 or w.stride(-1) != 1 \
            or x.dtype != w.dtype:
        raise ValueError(f"mid_mm expects x [M, K] and w [N, K] of one dtype with unit stride in K; got x "
                         f"{tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    m, k = x.shape
    n = w.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"mid_mm: bias {tuple(bias.shape)} for {n} outputs")
    if silu_mul and n % 2:
        raise ValueError(f"mid_mm with silu_mul expects a stacked [gate; up] weight (even rows), got {n}")
    split = max(1, cfg.split_k)
    if k % (split * cfg.block_k):
        raise ValueError(f"mid_mm: K = {k} is not a multiple of split_k x block_k = {split} x {cfg.block_k}")
    n_out = n // 2 if silu_mul else n
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n_out, cfg.block_n), split)
    tiles = grid[0] * grid[1]
    if split > 1 and tiles > _TICKETS:
        raise ValueError(f"mid_mm: {tiles} output tiles exceed the {_TICKETS} ticket counts")
    part_size = tiles * split * cfg.block_n * cfg.block_m * (2 if silu_mul else 1) if split > 1 else 1
    part = torch.empty(part_size, dtype=torch.float32, device=x.device)
    tickets = _tickets(x.device) if split > 1 else part
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages) if x.is_cuda else {}
    launch(_mid_kernel, grid, x, w, bias if bias is not None else out, out, part, tickets, m, n_out, k, x.stride(0),
           w.stride(0), out.stride(0), HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
           FP32=x.dtype == torch.float32 or not x.is_cuda, SPLIT_K=split, BLOCK_M=cfg.block_m,
           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **opts, **pdl.launch_opts(x))
    return out


def mid_config(w: torch.Tensor, m: int, silu_mul: bool = False) -> gemv_configs.GemvConfig | None:
    """The table's tiles for an M-row product with this 16-bit [N, K] CUDA weight (family "mid16", or
    "mid16_silu" for a stacked [gate; up] with the activation in the epilogue), or None where cuBLAS keeps it: M
    outside 17..256, no entry for the shape or an entry "cublas" (the sweep found cuBLAS as fast at that M),
    another dtype, or RADIXSERVE_GEMM_MID=0."""
    if not ENABLED or not MIN_M <= m <= MAX_M or not w.is_cuda or w.dtype not in (torch.bfloat16, torch.float16) \
            or w.dim() != 2 or w.stride(-1) != 1:
        return None
    cfg = gemv_configs.get_mid(m, w.shape[0], w.shape[1], family="mid16_silu" if silu_mul else "mid16")
    if cfg is None or cfg.kernel != "tn" or w.shape[1] % (max(1, cfg.split_k) * cfg.block_k):
        return None
    return cfg
