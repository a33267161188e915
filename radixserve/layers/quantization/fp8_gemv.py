"""Bandwidth-bound FP8 products for a few activation rows (decode, M = 1..16): out = x @ (W * scale).T.

At batch 1 a linear layer reads its whole weight to produce one row, so its time is the weight's bytes over the
memory bandwidth; the job of these kernels is to keep every SM streaming the fp8 bytes. Both cut N into many narrow
programs (no split-K: even the 4,096-row projections of an 8B model give hundreds of programs) and read wide
contiguous runs of each weight row per step; the weight is widened in registers (W8A16, no activation scales) and
the per-output-channel scale is applied once at the end.

- `_fp8_gemv_ew_kernel` (elementwise, for M <= 2): BLOCK_N rows x BLOCK_K columns per step, products on the CUDA
  cores into a [BLOCK_N, BLOCK_K] float32 accumulator per activation row, summed over K once, after the loop.
  WIDEN_F16 chooses how the fp8 byte is widened: Triton's conversion (False) or by moving its bits into an fp16
  (True; exact, the factor 2^8 it leaves goes into the epilogue's scale). RED8 sums each thread's runs of 8
  products first, so the accumulator is [BLOCK_N, BLOCK_K / 8]: its registers, not instructions, limited how many
  programs (and fp8 bytes in flight) an SM holds.
- `_fp8_gemv_dot_kernel` (tensor cores, for larger M): the product transposed, W tile [BLOCK_N, BLOCK_K] (widened
  to the activation dtype) times x.T [BLOCK_K, 16], so the weight's rows fill the MMA's 16+ rows and x's few rows
  its narrow side.

Block sizes come from `gemv_configs` (a table swept on the GPU, `benchmarks/sweep_gemv.py`). Per-channel scales
([N] or [N, 1]) in both kernels; block-wise scales ([ceil(N / bn), ceil(K / bk)], DeepSeek-V3's and the Qwen3 FP8
releases' 128 x 128) in the elementwise one for one or two rows (BLOCKS: each step's products, or runs of 8, times
their column group's scale before they reach the accumulator; a program's rows lie in one row block), as the
small-batch expert kernels do (`moe/small_batch._fp8_rows`); other block-wise products keep the W8A16 `fp8_gemm`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization import gemv_configs
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue, prefetch_rows


@triton.jit
def _widen(w, WIDEN_F16: tl.constexpr):
    if WIDEN_F16:  # e4m3 byte seeeemmm -> fp16 bits s0eeeemmm0000000: the value / 2^8, subnormals included
        b = w.to(tl.int16)
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32)
    return w.to(tl.float32)


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up with the roundings of the unfused path: the GEMV's output in the activation dtype, silu in
    float32 rounded to it, the product rounded."""
    g = gate.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return act * up.to(dtype).to(tl.float32)


@triton.jit
def _load_w(ptrs, mask_n, EVICT: tl.constexpr):
    if EVICT:
        return tl.load(ptrs, mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=mask_n[:, None], other=0.0)


@triton.jit
def _runs8(p):
    """The sums of the [BLOCK_N, BLOCK_K] products' runs of 8 columns (one thread's: no exchange)."""
    return tl.sum(tl.reshape(p, (p.shape[0], p.shape[1] // 8, 8)), axis=2)


@triton.jit
def _acc(acc, wf, x, RED8: tl.constexpr):
    """acc + the products of the widened weight tile and x (RED8: as sums of runs of 8, `_runs8`)."""
    if RED8:  # (both branches assign: compiled Triton does not end a function at a return inside a static if)
        acc = acc + _runs8(wf * x)
    else:
        acc = acc + wf * x
    return acc


@triton.jit
def _group_cols(offs_k, offs_n, group_k, RED8: tl.constexpr):
    """The column group (of `group_k`) of each accumulator column within a K step, in the accumulator's layout
    (built through the same reshape as `_runs8`, so the loop's scale loads need no exchange between threads);
    valid at every step because K steps and groups are powers of two that start at multiples of each other."""
    cols = offs_k[None, :] + 0 * offs_n[:, None]
    if RED8:
        cols = tl.min(tl.reshape(cols, (cols.shape[0], cols.shape[1] // 8, 8)), axis=2)
    return cols // group_k


@triton.jit
def _acc_blocks(acc, wf, x, scales, RED8: tl.constexpr):
    """`_acc` for block-wise scales: each accumulator column's products (one, or a run of 8) times the scale of
    its column group (`scales`, in the accumulator's layout) before they are added."""
    if RED8:
        acc = acc + _runs8(wf * x) * scales
    else:
        acc = acc + wf * x * scales
    return acc


@triton.jit
def _row_out(acc0, acc1, S, Bias, offs_n, mask_n, N, out_factor, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
             dtype: tl.constexpr, BLOCKS: tl.constexpr = False):
    """The float32 outputs of rows offs_n from their accumulator (scaled, + bias); with SILU_MUL acc1 holds the up
    rows N + offs_n and the result is silu(gate) * up. BLOCKS: the accumulators hold scaled products already."""
    if BLOCKS:
        scale = out_factor
    else:
        scale = tl.load(S + offs_n, mask=mask_n, other=0.0) * out_factor
    bias = tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    out = tl.sum(acc0, axis=1) * scale + bias
    if SILU_MUL:
        if BLOCKS:
            scale_u = out_factor
        else:
            scale_u = tl.load(S + N + offs_n, mask=mask_n, other=0.0) * out_factor
        bias_u = tl.load(Bias + N + offs_n, mask=mask_n, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
        out = _silu_mul(out, tl.sum(acc1, axis=1) * scale_u + bias_u, dtype)
    return out


@triton.jit
def _fp8_gemv_ew_kernel(X, W, S, Bias, Out, M, N, K, stride_xm, stride_wn, stride_om, out_factor, stride_sn,
                        group_n, group_k, HAS_BIAS: tl.constexpr, WIDEN_F16: tl.constexpr, TWO_ROWS: tl.constexpr,
                        SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0,
                        EVICT: tl.constexpr = False, RED8: tl.constexpr = False, BLOCKS: tl.constexpr = False,
                        PREFETCH: tl.constexpr = 0):
    """SILU_MUL: W is [gate; up] (2N rows), each program reads the gate rows n and the up rows N + n and writes
    silu(gate) * up ([M, N]); one activation row only (TWO_ROWS is off). PDL: `triton_ops.pdl`.
    BLOCKS: S holds a scale per group_n rows and group_k columns (rows stride_sn apart); BLOCK_N divides group_n
    (and so does N with SILU_MUL), so each program's gate rows, and its up rows, share one row of scales (per-channel
    scales: stride_sn, group_n, group_k unused).
    More fp8 bytes in flight per SM (the kernel is bound by them, not by instructions): RED8 sums each thread's
    runs of 8 products before they reach the accumulator ([BLOCK_N, BLOCK_K / 8] registers instead of [BLOCK_N,
    BLOCK_K], so larger tiles and more programs fit an SM); EVICT streams the weight past L1 (evict-first), leaving
    it to x. PREFETCH: bytes a row of the weight to ask the L2 for before the PDL wait (`pdl.prefetch_rows`)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    prefetch_rows(W, tl.minimum(offs_n, N - 1), stride_wn, PREFETCH)
    if SILU_MUL:
        prefetch_rows(W, tl.minimum(offs_n, N - 1) + N, stride_wn, PREFETCH)
    pdl_prologue(PDL)
    # Runs of 8 contiguous columns: the fp8 bytes and the 16-bit x then get the same register layout (8 a thread),
    # so nothing is exchanged through shared memory inside the loop.
    offs_k = tl.arange(0, BLOCK_K)
    offs_k = (offs_k // 8) * 8 + offs_k % 8
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_rows = N * stride_wn.to(tl.int64)
    # x read through a [BLOCK_N, BLOCK_K] pointer tile (every row the same; L1 serves the repeats): same layout too
    x_ptrs = X + offs_k[None, :] + 0 * offs_n[:, None]
    ACC_K: tl.constexpr = BLOCK_K // 8 if RED8 else BLOCK_K
    acc0 = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)  # the second row of x, or the up rows
    if BLOCKS:  # pointers to the scales of the gate (or only) rows' and the up rows' groups in the first K step
        s_ptrs = S + (tl.program_id(0) * BLOCK_N // group_n).to(tl.int64) * stride_sn \
            + _group_cols(offs_k, offs_n, group_k, RED8)
        up_scales = ((N + tl.program_id(0) * BLOCK_N) // group_n - tl.program_id(0) * BLOCK_N // group_n) \
            .to(tl.int64) * stride_sn
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (the wrapper checks)
        w = _load_w(w_ptrs, mask_n, EVICT)
        u = _load_w(w_ptrs + up_rows, mask_n, EVICT) if SILU_MUL else w
        wf = _widen(w, WIDEN_F16)
        x0 = tl.load(x_ptrs).to(tl.float32)
        if BLOCKS:
            sc = tl.load(s_ptrs + k0 // group_k)
            acc0 = _acc_blocks(acc0, wf, x0, sc, RED8)
            if TWO_ROWS:
                acc1 = _acc_blocks(acc1, wf, tl.load(x_ptrs + stride_xm).to(tl.float32), sc, RED8)
            if SILU_MUL:
                acc1 = _acc_blocks(acc1, _widen(u, WIDEN_F16), x0, tl.load(s_ptrs + up_scales + k0 // group_k),
                                   RED8)
        else:
            acc0 = _acc(acc0, wf, x0, RED8)
            if TWO_ROWS:
                acc1 = _acc(acc1, wf, tl.load(x_ptrs + stride_xm).to(tl.float32), RED8)
            if SILU_MUL:
                acc1 = _acc(acc1, _widen(u, WIDEN_F16), x0, RED8)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out0 = _row_out(acc0, acc1, S, Bias, offs_n, mask_n, N, out_factor, HAS_BIAS, SILU_MUL, Out.dtype.element_ty,
                    BLOCKS)
    tl.store(Out + offs_n, out0.to(Out.dtype.element_ty), mask=mask_n)
    if TWO_ROWS:
        out1 = _row_out(acc1, acc1, S, Bias, offs_n, mask_n, N, out_factor, HAS_BIAS, False, Out.dtype.element_ty,
                        BLOCKS)
        tl.store(Out + stride_om + offs_n, out1.to(Out.dtype.element_ty), mask=mask_n)


@triton.jit
def _fp8_gemv_dot_kernel(X, W, S, Bias, Out, M, N, K, stride_xm, stride_wn, stride_om,
                         HAS_BIAS: tl.constexpr, FP32: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """SILU_MUL: W is [gate; up] (2N rows); the program multiplies the gate rows n and the up rows N + n and writes
    silu(gate) * up ([M, N])."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_rows = N * stride_wn.to(tl.int64)
    xt_ptrs = X + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # x.T tile [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        xt = tl.load(xt_ptrs, mask=mask_m[None, :], other=0.0)
        if FP32:
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(w.to(xt.dtype), xt)
        if SILU_MUL:
            wu = tl.load(w_ptrs + up_rows, mask=mask_n[:, None], other=0.0)
            if FP32:
                acc_u += tl.dot(wu.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:
                acc_u += tl.dot(wu.to(xt.dtype), xt)
        w_ptrs += BLOCK_K
        xt_ptrs += BLOCK_K
    out = acc * tl.load(S + offs_n, mask=mask_n, other=0.0)[:, None]
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    if SILU_MUL:
        up = acc_u * tl.load(S + N + offs_n, mask=mask_n, other=0.0)[:, None]
        if HAS_BIAS:
            up += tl.load(Bias + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        out = _silu_mul(out, up, Out.dtype.element_ty)
    o_ptrs = Out + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])


MAX_M = 16
# the elementwise kernel's variant flags, joined by "+": "f16" widens by moving bits, "ef" loads the weight
# evict-first, "r8" sums runs of 8 products in the thread (`_fp8_gemv_ew_kernel`)
EW_FLAGS = {"", "f16", "ef", "r8"}


def fp8_skinny_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                    bias: torch.Tensor | None = None, config: gemv_configs.GemvConfig | None = None,
                    silu_mul: bool = False, pdl_level: int | None = None,
                    block: tuple[int, int] | list[int] | None = None, out: torch.Tensor | None = None,
                    ) -> torch.Tensor | None:
    """x [M, K] (M <= 16, rows contiguous) times the fp8 weight w [N, K] with per-channel float32 scales ([N] or
    [N, 1]) -> [M, N] `out_dtype`; with `silu_mul`, w is [gate; up] and the result silu(gate) * up [M, N / 2]
    (the activation of a gated MLP in the GEMV's epilogue). `block` (bn, bk): the scales are block-wise
    [ceil(N / bn), ceil(K / bk)] instead (the elementwise kernel, one or two rows). None when the shape does not
    suit these kernels (M > 16, K not a multiple of 16; block-wise: more than two rows, or a [gate; up] split
    inside a row block): the caller falls back to `fp8_gemm`. `config` overrides the tuned choice (sweeps; with
    `silu_mul` the "fp8_silu" entry of the stacked N, and an "ew" tile reads block_n / 2 rows of each half).
    `pdl_level` overrides RADIXSERVE_PDL for the elementwise kernel (`triton_ops.pdl`). `out`: the [M, N_out]
    `out_dtype` tensor (rows contiguous) to write, instead of a new one. An int8 `w` (the int8 LM head,
    `lm_head_int8`) takes the same kernels, its bytes widened by conversion."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_M or k % 16 or x.stride(-1) != 1 or w.stride(-1) != 1 or w.shape[1] != k or (silu_mul and n % 2):
        return None
    n_out = n // 2 if silu_mul else n
    if block is None:
        if scale.numel() != n:
            return None
    else:
        bn, bk = int(block[0]), int(block[1])
        if m > (1 if silu_mul else 2) or scale.shape != (-(-n // bn), -(-k // bk)) or scale.stride(-1) != 1 \
                or bn & (bn - 1) or bk & (bk - 1) or bk < 8 or (silu_mul and n_out % bn):
            return None
    if out is None:
        out = torch.empty((m, n_out), dtype=out_dtype, device=x.device)
    elif out.shape != (m, n_out) or out.dtype != out_dtype or out.stride(-1) != 1 or out.device != x.device:
        raise ValueError(f"fp8 GEMV: out must be a row-contiguous {out_dtype} [{m}, {n_out}] on {x.device}; got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
    if m == 0:
        return out
    int8 = w.dtype == torch.int8
    cfg = config or gemv_configs.get("fp8_silu" if silu_mul else "int8" if int8 else "fp8", m, n, k, x.is_cuda)
    if block is not None and cfg.kernel != "ew":  # the tensor-core kernel takes per-channel scales only
        cfg = gemv_configs.default("fp8", 1, x.is_cuda)
    if cfg.kernel == "ew" and (m > 2 or (silu_mul and m > 1)):  # the elementwise kernel takes one or two rows
        cfg = gemv_configs.default("fp8", 16, x.is_cuda)
    block_k = cfg.block_k
    while k % block_k:
        block_k //= 2
    s = scale.reshape(-1) if block is None else scale
    b = bias if bias is not None else s
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages) if x.is_cuda else {}
    if cfg.kernel == "ew":
        block_n = max(1, cfg.block_n // 2) if silu_mul else cfg.block_n
        flags = set(cfg.variant.split("+"))
        if not flags <= EW_FLAGS:
            raise ValueError(f"fp8 GEMV: unknown variant {cfg.variant!r} (flags joined by '+': {sorted(EW_FLAGS)})")
        widen = "f16" in flags and not int8  # (an int8 weight is widened by conversion)
        groups = (0, 1, 1)  # per-channel scales: unused
        if block is not None:  # a program's rows in one row block (powers of two: the smaller divides the larger)
            block_n = min(block_n, bn)
            groups = (scale.stride(0), bn, bk)
        launch(_fp8_gemv_ew_kernel, (triton.cdiv(n_out, block_n),), x, w.view(torch.uint8) if widen else w, s, b,
               out, m, n_out, k, x.stride(0), w.stride(0), out.stride(0), 256.0 if widen else 1.0, *groups,
               HAS_BIAS=bias is not None, WIDEN_F16=widen, TWO_ROWS=m == 2, SILU_MUL=silu_mul, BLOCK_N=block_n,
               BLOCK_K=block_k, EVICT="ef" in flags, RED8="r8" in flags, BLOCKS=block is not None, **opts,
               **pdl.launch_opts(x, pdl_level, prefetch_row_bytes=k))  # (fp8 / int8: a byte an element)
    else:
        launch(_fp8_gemv_dot_kernel, (triton.cdiv(n_out, cfg.block_n),), x, w, s, b, out, m, n_out, k, x.stride(0),
               w.stride(0), out.stride(0), HAS_BIAS=bias is not None, FP32=x.dtype == torch.float32 or not x.is_cuda,
               SILU_MUL=silu_mul, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=block_k, **opts)
    return out
