"""Decode GEMVs that read GGUF Q8_0 / Q4_K weights in their packed fields (`gguf_formats`): out = x @ dequant(W).T
(+ bias), with the kernel and block sizes from the swept table (`gemv_configs`). Here: the kernels that dequantise
in registers (Q8_0; Q4_K's "ew" and "acc") and `gguf_gemv`, which picks and launches a kernel; Q4_K's integer-product
kernels are in `gguf_int_kernels` and `gguf_chunk_kernels` (dp4c). Most kernels run one program per row of x (up to
GEMV_MAX_M rows); Q4_K's dp4x (up to 8 rows) and mma_rows (up to 16) take every row of x in one program; those, dp4c
and x's quantisation before them
launch with programmatic dependent launch when RADIXSERVE_PDL asks for it (`triton_ops.pdl`). Larger products:
`gguf_gemm`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization import gemv_configs
from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.quantization.gguf_chunk_kernels import _q4_k_gemv_dp4c_kernel, q8_1_blocks
from radixserve.layers.quantization.gguf_int_kernels import (
    _q4_k_chunk_pointers,
    _q4_k_chunk_scales,
    _q4_k_gemv_dp4a_kernel,
    _q4_k_gemv_dp4w_kernel,
    _q4_k_gemv_dp4x_kernel,
    _q4_k_gemv_dp4x_rows_kernel,
    _q4_k_gemv_mma2d_kernel,
    _q4_k_gemv_mma_kernel,
    _q4_k_gemv_mma_rows_kernel,
    q8_1_words,
)
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch


@triton.jit
def _small_int_to_f32(v, MAGIC: tl.constexpr):
    """int32 v in 0..255 as float32: by conversion, or (MAGIC) by OR-ing it into the mantissa of 2^23 and taking
    2^23 off (two plain ALU operations instead of one integer-to-float conversion, a slower unit)."""
    if MAGIC:
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return v.to(tl.float32)


@triton.jit
def _q4_k_gemv_kernel(X, Wq, Sc, Mn, D, Dmin, Out, Bias, N, K, stride_xm, stride_wn, stride_sn, stride_dn, stride_om,
                      HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr, BLOCK_N: tl.constexpr, NCH: tl.constexpr):
    """One activation row (program axis 1) times BLOCK_N Q4_K rows; each step reads NCH contiguous 32-byte chunks
    of every row (chunk g holds weights 64g + l in its low nibbles, 64g + 32 + l in its high ones: sub-blocks 2g and
    2g + 1). Each sub-block's dot product with x is scaled by d * sc, and dmin * m times the sub-block's sum of x is
    taken off (no dequantised tile is formed); the [BLOCK_N, NCH] partial sums are added over K after the loop.
    The q bytes and x go through [BLOCK_N, NCH, 32] tiles in runs of 8 columns, so both get one register layout."""
    m = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ch = tl.arange(0, NCH)
    offs_l = tl.arange(0, 32)
    offs_l = (offs_l // 8) * 8 + offs_l % 8
    rows = offs_n.to(tl.int64)
    w_ptrs, x_ptrs, s_ptrs, m_ptrs, d_ptrs, dm_ptrs = _q4_k_chunk_pointers(
        X, Wq, Sc, Mn, D, Dmin, m, rows, ch, offs_l, stride_xm, stride_wn, stride_sn, stride_dn)
    mask_w = mask_n[:, None, None]
    mask_s = mask_n[:, None]
    acc = tl.zeros((BLOCK_N, NCH), dtype=tl.float32)
    for g0 in range(0, K // 64, NCH):  # K % (64 * NCH) == 0 and NCH % 4 == 0 (the wrapper checks)
        b = tl.load(w_ptrs + g0 * 32, mask=mask_w, other=0).to(tl.int32)
        x_lo = tl.load(x_ptrs + g0 * 64).to(tl.float32)
        x_hi = tl.load(x_ptrs + g0 * 64 + 32).to(tl.float32)
        dot_lo = tl.sum(_small_int_to_f32(b & 0xF, MAGIC) * x_lo, axis=2)  # [BLOCK_N, NCH]
        dot_hi = tl.sum(_small_int_to_f32(b >> 4, MAGIC) * x_hi, axis=2)
        xs_lo = tl.sum(x_lo, axis=2)
        xs_hi = tl.sum(x_hi, axis=2)
        sc_lo, sc_hi, mn_lo, mn_hi, d, dm = _q4_k_chunk_scales(s_ptrs, m_ptrs, d_ptrs, dm_ptrs, g0, mask_s)
        acc += d * (sc_lo * dot_lo + sc_hi * dot_hi) - dm * (mn_lo * xs_lo + mn_hi * xs_hi)
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, out.to(Out.dtype.element_ty), mask=mask_n)


@triton.jit
def _q4_k_gemv_acc_kernel(X, Wq, Sc, Mn, D, Dmin, Out, Bias, N, K, stride_xm, stride_wn, stride_sn, stride_dn,
                          stride_om, HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr, BLOCK_N: tl.constexpr,
                          NCH: tl.constexpr):
    """As `_q4_k_gemv_kernel`, but every weight is dequantised in registers (d * sc * q - dmin * m, the sub-block's
    factors broadcast along its 32 weights) and multiplied into a [BLOCK_N, NCH, 32] accumulator that is reduced
    once after the loop: no reduction across threads inside the loop."""
    m = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ch = tl.arange(0, NCH)
    offs_l = tl.arange(0, 32)
    offs_l = (offs_l // 8) * 8 + offs_l % 8
    rows = offs_n.to(tl.int64)
    w_ptrs, x_ptrs, s_ptrs, m_ptrs, d_ptrs, dm_ptrs = _q4_k_chunk_pointers(
        X, Wq, Sc, Mn, D, Dmin, m, rows, ch, offs_l, stride_xm, stride_wn, stride_sn, stride_dn)
    mask_w = mask_n[:, None, None]
    mask_s = mask_n[:, None]
    acc = tl.zeros((BLOCK_N, NCH, 32), dtype=tl.float32)
    for g0 in range(0, K // 64, NCH):  # K % (64 * NCH) == 0 and NCH % 4 == 0 (the wrapper checks)
        b = tl.load(w_ptrs + g0 * 32, mask=mask_w, other=0).to(tl.int32)
        x_lo = tl.load(x_ptrs + g0 * 64).to(tl.float32)
        x_hi = tl.load(x_ptrs + g0 * 64 + 32).to(tl.float32)
        sc_lo, sc_hi, mn_lo, mn_hi, d, dm = _q4_k_chunk_scales(s_ptrs, m_ptrs, d_ptrs, dm_ptrs, g0, mask_s)
        s_lo = (d * sc_lo)[:, :, None]
        s_hi = (d * sc_hi)[:, :, None]
        m_lo = (dm * mn_lo)[:, :, None]
        m_hi = (dm * mn_hi)[:, :, None]
        acc += (_small_int_to_f32(b & 0xF, MAGIC) * s_lo - m_lo) * x_lo
        acc += (_small_int_to_f32(b >> 4, MAGIC) * s_hi - m_hi) * x_hi
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, out.to(Out.dtype.element_ty), mask=mask_n)



@triton.jit
def _q8_0_gemv_kernel(X, Wq, D, Out, Bias, N, K, stride_xm, stride_wn, stride_dn, stride_om,
                      HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """One activation row (program axis 1) times BLOCK_N Q8_0 rows, NB contiguous 32-weight blocks of every row per
    step; each block's int8 dot product with x times its d, the [BLOCK_N, NB] partial sums added over K after the
    loop. q and x go through [BLOCK_N, NB, 32] tiles in runs of 8 columns (one register layout for both)."""
    m = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    g = tl.arange(0, NB)
    offs_l = tl.arange(0, 32)
    offs_l = (offs_l // 8) * 8 + offs_l % 8
    cols = (g[:, None] * 32 + offs_l[None, :])[None, :, :]  # [1, NB, 32]
    rows = offs_n.to(tl.int64)
    w_ptrs = Wq + rows[:, None, None] * stride_wn + cols
    x_ptrs = X + m * stride_xm + cols + 0 * offs_n[:, None, None]
    d_ptrs = D + rows[:, None] * stride_dn + g[None, :]
    acc = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    for k0 in range(0, K, NB * 32):  # K % (32 * NB) == 0 (the wrapper checks)
        q = tl.load(w_ptrs + k0, mask=mask_n[:, None, None], other=0).to(tl.int32)
        q = _small_int_to_f32(q + 128, MAGIC) - 128.0
        x = tl.load(x_ptrs + k0).to(tl.float32)
        d = tl.load(d_ptrs + k0 // 32, mask=mask_n[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(q * x, axis=2) * d
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, out.to(Out.dtype.element_ty), mask=mask_n)


GEMV_MAX_M = 4  # Q8_0, and the Q4_K kernels that run one program per row of x
# Q4_K kernels that take every row of x in one program: `_q4_k_gemv_dp4x_rows_kernel` up to 8 rows (at 16 it is
# instruction-bound: the 8B step 14.2 ms against 12.3 for the dequantised weight and cuBLAS; at 8 it wins, 8.2
# against 12.2 ms; H200, docs/PERFORMANCE.md), `_q4_k_gemv_mma_rows_kernel` up to 16 (where the table names it).
ROWS_MAX_M = {"dp4x": 8, "mma_rows": 16}
Q4_K_GEMV_MAX_M = max(ROWS_MAX_M.values())


def gemv_max_m(fmt: str) -> int:
    """The most rows of x any decode GEMV takes for this format (larger products: `gguf_gemm`; within it, the
    kernel the table names for the batch decides, `gguf_gemv` returning None where it does not take them)."""
    return Q4_K_GEMV_MAX_M if fmt == "Q4_K" else GEMV_MAX_M


# dp4c needs a step of >= 32 chunks (one a lane): programs whose lanes would share chunks sum wrongly on the GPU
# (H200, Triton 3.6; tests/gpu/test_quant_gpu.py), so the config's block_k must be 2,048 or more and K a multiple
# of 2,048; other configs and shapes get dp4x
DP4C_MIN_BLOCK_K = 2048
DP4C_FALLBACK = GemvConfig("dp4x", 2, 1024, 2)


def _dp4c_views_fit(fields: dict[str, torch.Tensor]) -> bool:
    """Whether the Q4_K fields can be read as `_q4_k_gemv_dp4c_kernel` reads them: the q bytes as 32-bit words,
    the sub-block scales and mins as 16-bit pairs."""
    wq, sc, mn = fields["qweight"], fields["scales"], fields["mins"]
    return wq.stride(0) % 4 == 0 and wq.data_ptr() % 4 == 0 and all(
        t.stride(0) % 2 == 0 and t.data_ptr() % 2 == 0 and t.stride(1) == 1 for t in (sc, mn))


def dp4c_config(n: int, k: int, fields: dict[str, torch.Tensor], cuda: bool,
                config: GemvConfig | None = None) -> GemvConfig | None:
    """The tiles of the one-row dp4c product of this Q4_K weight ([n, k]): `config`, else the table's entry, when
    it names dp4c and the shape and fields take it; None where another kernel serves the product (then x's
    quantisation cannot be fused into the operation before it: `gguf_prologue`)."""
    cfg = config or gemv_configs.get("q4_k", 1, n, k, cuda)
    fits = cfg.kernel == "dp4c" and cfg.block_k >= DP4C_MIN_BLOCK_K and k % DP4C_MIN_BLOCK_K == 0 \
        and _dp4c_views_fit(fields)
    return cfg if fits else None


def dp4c_tiles(cfg: GemvConfig, k: int, cuda: bool) -> tuple[int, dict]:
    """(block_k, launch options) of a dp4c launch over K = k: the config's block_k halved until it divides K; on
    the GPU the config's warps capped so that every thread has its own chunks (block_k / 64 >= 32 lanes x warps)."""
    block_k = max(256, cfg.block_k)
    while k % block_k:
        block_k //= 2
    if not cuda:
        return block_k, {}
    return block_k, dict(num_warps=max(1, min(cfg.num_warps, block_k // DP4C_MIN_BLOCK_K)), num_stages=cfg.num_stages)


def dp4c_gemv(xw: torch.Tensor, f: torch.Tensor, fields: dict[str, torch.Tensor], n: int,
              bias: torch.Tensor | None, cfg: GemvConfig, out: torch.Tensor) -> torch.Tensor:
    """out [M, n] = x @ dequant(W).T (+ bias) from x already quantised (`q8_1_blocks`: words [M, K / 4], factors
    F [M, K / 8]) through `_q4_k_gemv_dp4c_kernel`, with `cfg` from `dp4c_config`."""
    m, k = xw.shape[0], xw.shape[1] * 4
    wq, sc, d = fields["qweight"], fields["scales"], fields["d"]
    w32, sc16, mn16 = wq.view(torch.int32), sc.view(torch.int16), fields["mins"].view(torch.int16)
    block_k, opts = dp4c_tiles(cfg, k, xw.is_cuda)
    launch(_q4_k_gemv_dp4c_kernel, (triton.cdiv(n, cfg.block_n), m), xw, f, w32, sc16, mn16, d, fields["dmin"], out,
           bias if bias is not None else d, n, k, f.stride(0), w32.stride(0), sc16.stride(0), d.stride(0),
           out.stride(0), HAS_BIAS=bias is not None, ASM=xw.is_cuda, BLOCK_N=cfg.block_n, NCH=block_k // 64,
           EVEN_N=n % cfg.block_n == 0, **opts, **pdl.launch_opts(xw))
    return out


def gguf_gemv(x: torch.Tensor, fmt: str, fields: dict[str, torch.Tensor], n: int,
              bias: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor | None:
    """The product for a few rows (decode, M <= `gemv_max_m(fmt)`) straight from the packed fields; None when the
    shape does not suit it (K not a multiple of 256, or more rows than the kernel the table names takes): the caller
    uses `gguf_gemm`. `config` overrides the tuned block sizes (`gemv_configs`; block_k = weight columns a program
    reads per step)."""
    m, k = x.shape
    q4k = fmt == "Q4_K"
    if k % 256 or m > gemv_max_m(fmt) or x.stride(-1) != 1:
        return None
    cfg = config or gemv_configs.get("q4_k" if q4k else "q8_0", m, n, k, x.is_cuda)
    if q4k and cfg.kernel == "dp4c" and (cfg.block_k < DP4C_MIN_BLOCK_K or k % DP4C_MIN_BLOCK_K
                                         or not _dp4c_views_fit(fields)):
        cfg = DP4C_FALLBACK
    dp4x = q4k and cfg.kernel == "dp4x" and fields["qweight"].stride(0) % 4 == 0 \
        and fields["qweight"].data_ptr() % 4 == 0
    rows_kernel = "dp4x" if dp4x else cfg.kernel if q4k and cfg.kernel == "mma_rows" else None
    if m > ROWS_MAX_M.get(rows_kernel, GEMV_MAX_M):  # one program per row of x would read the weight m times
        return None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_k = max(256, cfg.block_k)
    while k % block_k:
        block_k //= 2
    wq, d = fields["qweight"], fields["d"]
    b = bias if bias is not None else d
    block_n = max(16, cfg.block_n) if cfg.kernel in ("mma", "mma_rows") else cfg.block_n  # an MMA: 16 rows or more
    grid = (triton.cdiv(n, block_n), m)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages) if x.is_cuda else {}
    if q4k:
        sc = fields["scales"]
        if dp4x:
            w32 = wq.view(torch.int32)
            xw, xs, qsum, xsum = q8_1_words(x)
            if m == 1:
                launch(_q4_k_gemv_dp4x_kernel, grid, xw, xs, qsum, xsum, w32, sc, fields["mins"], d, fields["dmin"],
                       out, b, n, k, w32.stride(0), sc.stride(0), d.stride(0), out.stride(0),
                       HAS_BIAS=bias is not None, ASM=x.is_cuda, BLOCK_N=block_n, NCH=block_k // 64, **opts,
                       **pdl.launch_opts(x))
                return out
            rows = gemv_configs.bucket(m)
            launch(_q4_k_gemv_dp4x_rows_kernel, (grid[0], triton.cdiv(m, rows)), xw, xs, qsum, xsum, w32, sc,
                   fields["mins"], d, fields["dmin"], out, b, m, n, k, w32.stride(0), sc.stride(0), d.stride(0),
                   out.stride(0), HAS_BIAS=bias is not None, ASM=x.is_cuda, BLOCK_N=block_n, NCH=block_k // 64,
                   ROWS=rows, **opts, **pdl.launch_opts(x))
            return out
        if cfg.kernel == "dp4c":
            xw, f = q8_1_blocks(x)
            return dp4c_gemv(xw, f, fields, n, bias, cfg, out)
        if rows_kernel == "mma_rows":
            words, xs, _, xsum = q8_1_words(x)
            launch(_q4_k_gemv_mma_rows_kernel, (grid[0],), words.view(torch.int8), xs, xsum, wq, sc,
                   fields["mins"], d, fields["dmin"], out, b, m, n, k, wq.stride(0), sc.stride(0), d.stride(0),
                   out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, NCH=block_k // 64, **opts,
                   **pdl.launch_opts(x))
            return out
        if cfg.kernel == "dp4w" and wq.stride(0) % 4 == 0 and wq.data_ptr() % 4 == 0:
            w32 = wq.view(torch.int32)
            launch(_q4_k_gemv_dp4w_kernel, grid, x, w32, sc, fields["mins"], d, fields["dmin"], out, b, n, k,
                   x.stride(0), w32.stride(0), sc.stride(0), d.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                   ASM=x.is_cuda, BLOCK_N=block_n, NCH=block_k // 64, **opts)
            return out
        if cfg.kernel == "dp4a":
            launch(_q4_k_gemv_dp4a_kernel, grid, x, wq, sc, fields["mins"], d, fields["dmin"], out, b, n, k,
                   x.stride(0), wq.stride(0), sc.stride(0), d.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                   ASM=x.is_cuda, BLOCK_N=block_n, NCH=block_k // 64, **opts)
            return out
        if cfg.kernel == "mma":
            kernel = _q4_k_gemv_mma2d_kernel if cfg.variant == "2d" else _q4_k_gemv_mma_kernel
            launch(kernel, grid, x, wq, sc, fields["mins"], d, fields["dmin"], out, b, n, k,
                   x.stride(0), wq.stride(0), sc.stride(0), d.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                   BLOCK_N=block_n, NCH=block_k // 64, **opts)
            return out
        kernel = _q4_k_gemv_acc_kernel if cfg.kernel == "acc" else _q4_k_gemv_kernel
        launch(kernel, grid, x, wq, sc, fields["mins"], d, fields["dmin"], out, b, n, k, x.stride(0),
               wq.stride(0), sc.stride(0), d.stride(0), out.stride(0), HAS_BIAS=bias is not None,
               MAGIC=cfg.variant == "magic", BLOCK_N=cfg.block_n, NCH=block_k // 64, **opts)
    else:
        launch(_q8_0_gemv_kernel, grid, x, wq, d, out, b, n, k, x.stride(0), wq.stride(0), d.stride(0),
               out.stride(0), HAS_BIAS=bias is not None, MAGIC=cfg.variant == "magic", BLOCK_N=cfg.block_n,
               NB=block_k // 32, **opts)
    return out
