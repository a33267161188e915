"""Bandwidth-bound product of ONE activation row with 16-bit weights (decode at batch 1): out = x @ W.T.

At batch 1 a linear layer's time is its weight's bytes over the memory bandwidth. cuBLAS streams the large 8B
projections at ~97% of the copy bandwidth but the small ones (qkv 6144x4096, o 4096x4096) at ~72-77%, and picks
split-K for some shapes, which adds a reduction kernel per call. One kernel, `_gemv_row_kernel`, serves every
one-row 16-bit product:

- programs over the output rows (no split-K: a 4,096-row weight already gives hundreds of programs), each streaming
  BLOCK_N whole rows in runs of BLOCK_K columns into a [BLOCK_N, BLOCK_K] float32 accumulator summed once after the
  loop;
- `silu_mul`: the weight is a stacked [gate; up] (2N rows); the program reads gate row n and up row N + n and writes
  silu(gate) * up (the gated MLP's activation in the epilogue: one kernel and one [1, 2N] round trip less a layer);
- `w2`: out = x @ [W; W2].T, two projections of the same input in one launch (DeepSeek's q_proj and
  kv_a_proj_with_mqa);
- `slots`: the rows past the base weight are equal slots (LoRA's A of every adapter slot stacked under the base
  weight) and only the slot named by a device tensor is computed: a batch-1 decode reads its own adapter's rows only;
- `norm` = (residual or None, norm weight, eps): the input is RMSNorm(x + residual) * weight, rounded as
  `fused_add_rmsnorm` rounds (the sum, the normalised row and its product with the weight each to the activation
  dtype). Every program takes the row's statistics itself (a first pass over a few KB that stay in L2; the first
  chunk of its weight rows is requested before it, which took the MoE / MLA q/k/v projections from 10.0 to 8.4 us
  and 7.8 to 6.5 us on an H200 at their one-chunk tiles) and program 0 stores the new residual.

Tiles come from one table (`gemv_configs`, families "row16", "row16_silu", "row16_norm"). Two kinds of caller:
- the dense models' linear layers and the LM head (`gemv_config`): only shapes where a sweep on the GPU
  (`benchmarks/sweep_gemv.py --families row16 row16_silu --baselines`) found the kernel faster than cuBLAS have an
  entry; every other shape stays on `F.linear`;
- the MoE / MLA models' attention projections, opted in per layer (`_LinearBase.decode_gemv`), with the input norm
  folded into q/k/v (`opt_in_config`): the table's entry, else the family's default tiles."""

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
def _normed_chunk(X, Res, NormW, offs_k, mask_k, rstd, HAS_RES: tl.constexpr, NORM: tl.constexpr,
                  dtype: tl.constexpr):
    x = tl.load(X + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if HAS_RES:
        x = (x + tl.load(Res + offs_k, mask=mask_k, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    if NORM:
        nw = tl.load(NormW + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        x = ((x * rstd).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)
    return x


@triton.jit
def _gemv_row_kernel(X, Res, NormW, ResOut, W, W2, Bias, Out, Slot, N1, N, K, stride_wn, stride_w2n, eps,
                     HAS_W2: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SLOT_ROWS: tl.constexpr = 0, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if SLOT_ROWS > 0:  # rows from N1 on come in slots of SLOT_ROWS: only slot `*Slot`'s are computed (-1: none)
        slot = tl.load(Slot)
        row_ok = row_ok & ((rows < N1) | ((rows - N1) // SLOT_ROWS == slot))
        if tl.max(row_ok.to(tl.int32), axis=0) == 0:
            return
    cols = tl.arange(0, BLOCK_K)
    if HAS_W2:  # rows [0, N1) from W, [N1, N) from W2
        in_w1 = rows < N1
        w_ptrs = tl.where(in_w1[:, None], W + rows[:, None].to(tl.int64) * stride_wn,
                          W2 + (rows - N1)[:, None].to(tl.int64) * stride_w2n) + cols[None, :]
    else:
        w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    up_off = N * stride_wn.to(tl.int64)
    dtype = Out.dtype.element_ty
    rstd = 1.0
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = 0
    tl.static_assert(not (NORM and SILU_MUL), "the input norm's first chunk below has no up half")
    if NORM:
        # the first chunk of the weight is asked for before the statistics pass, so its latency overlaps that pass
        # (the rest of the row follows in the loop); its product is taken once rstd is known
        first_mask = row_ok[:, None] if EVEN_K else row_ok[:, None] & (cols[None, :] < K)
        w_first = tl.load(w_ptrs, mask=first_mask, other=0.0, eviction_policy="evict_first")
        # the row's statistics: one pass over x (+ residual)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + cols
            mask_k = offs_k < K
            s = _normed_chunk(X, Res, NormW, offs_k, mask_k, 1.0, HAS_RES, False, dtype)
            sq += s * s
            if HAS_RES:
                if pid == 0:
                    tl.store(ResOut + offs_k, s.to(ResOut.dtype.element_ty), mask=mask_k)
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        x = _normed_chunk(X, Res, NormW, cols, cols < K, rstd, HAS_RES, NORM, dtype)[None, :]
        acc += w_first.to(tl.float32) * x
        w_ptrs += BLOCK_K
        k_start = BLOCK_K
    # without the norm, x goes through a [BLOCK_N, BLOCK_K] tile of the weight tile's layout (each row of it the same
    # K run; the repeats hit L1), so the product needs no exchange of x between threads inside the loop
    x_ptrs = X + cols[None, :] + 0 * rows[:, None]
    for k0 in range(k_start, K, BLOCK_K):
        if EVEN_K:
            w_mask = row_ok[:, None]
        else:
            w_mask = row_ok[:, None] & (cols[None, :] < K - k0)
        if NORM:
            offs_k = k0 + cols
            x = _normed_chunk(X, Res, NormW, offs_k, offs_k < K, rstd, HAS_RES, NORM, dtype)[None, :]
        elif EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
        else:
            x = tl.load(x_ptrs, mask=cols[None, :] < K - k0, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x
        if SILU_MUL:
            wu = tl.load(w_ptrs + up_off, mask=w_mask, other=0.0, eviction_policy="evict_first")
            acc_up += wu.to(tl.float32) * x
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + rows, mask=row_ok, other=0.0).to(tl.float32)
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
_CPU_TILES = gemv_configs.GemvConfig("ew", 2, 64)  # the interpreter (CPU tests): small tiles


def row16_weight(w: torch.Tensor) -> bool:
    """Whether the one-row 16-bit kernels may serve this weight: a bf16 / fp16 [N, K] CUDA tensor with unit stride in
    K, and RADIXSERVE_GEMV_ROW not 0 (whether they do is the table's: `gemv_config`, `gemv_rope.rope_entry`)."""
    return ENABLED and w.is_cuda and w.dtype in (torch.bfloat16, torch.float16) and w.dim() == 2 \
        and w.stride(-1) == 1


def gemv_config(w: torch.Tensor, silu_mul: bool = False) -> gemv_configs.GemvConfig | None:
    """For the dense layers: the table's tiles for this 16-bit [N, K] CUDA weight at one row (N: the stacked rows
    with `silu_mul`), or None where the layer keeps cuBLAS: no entry for the shape (cuBLAS was as fast), another
    dtype, not on CUDA, or RADIXSERVE_GEMV_ROW=0."""
    if not row16_weight(w):
        return None
    return gemv_configs.lookup("row16_silu" if silu_mul else "row16", 1, w.shape[0], w.shape[1])


def opt_in_config(n: int, k: int, norm: bool, cuda: bool = True) -> gemv_configs.GemvConfig:
    """For the layers that opt in (MoE / MLA attention): the table's tiles for an [N, K] product (with the input
    norm: family "row16_norm"), else the family's default."""
    return gemv_configs.get("row16_norm" if norm else "row16", 1, n, k, cuda)


def _check(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1:
        raise ValueError(f"gemv_row expects x [1, K] with unit stride in K; got x {tuple(x.shape)}")
    k = x.shape[1]
    for m in (w, w2):
        if m is not None and (m.dim() != 2 or m.shape[1] != k or m.stride(-1) != 1 or m.dtype != x.dtype):
            raise ValueError(f"gemv_row: weight {tuple(m.shape)} {m.dtype} does not fit x {tuple(x.shape)} "
                             f"{x.dtype} (w [N, K] with unit stride in K, x's dtype)")


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, w2: torch.Tensor | None,
            norm: tuple[torch.Tensor | None, torch.Tensor, float] | None, silu_mul: bool, n_out: int,
            cfg: gemv_configs.GemvConfig,
            slots: tuple[torch.Tensor, int, int] | None = None,
            pdl_level: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    k = x.shape[1]
    block_k = min(cfg.block_k, triton.next_power_of_2(k))
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    res, nw, eps = norm if norm is not None else (None, x, 0.0)
    res_out = torch.empty_like(x) if res is not None else None
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages) if x.is_cuda else {}
    n1 = w.shape[0] if w2 is not None else (slots[1] if slots is not None else n_out)
    launch(_gemv_row_kernel, (triton.cdiv(n_out, cfg.block_n),), x, res if res is not None else x, nw,
           res_out if res_out is not None else out, w, w2 if w2 is not None else w,
           bias if bias is not None else out, out, slots[0] if slots is not None else out, n1, n_out, k,
           w.stride(0), w2.stride(0) if w2 is not None else w.stride(0), float(eps),
           HAS_W2=w2 is not None, NORM=norm is not None, HAS_RES=res is not None, HAS_BIAS=bias is not None,
           SILU_MUL=silu_mul, EVEN_K=k % block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
           SLOT_ROWS=slots[2] if slots is not None else 0, **opts, **pdl.launch_opts(x, pdl_level))
    return out, res_out


def gemv_row(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
             config: gemv_configs.GemvConfig | None = None, silu_mul: bool = False,
             slots: tuple[torch.Tensor, int, int] | None = None, pdl_level: int | None = None) -> torch.Tensor:
    """x [1, K] times w [N, K] (x's dtype, rows contiguous) -> [1, N]; with `silu_mul`, w is [gate; up] and the
    result silu(gate) * up [1, N / 2]. `config` gives the tiles (default: the "row16" family's).
    `slots` = (slot, n_main, slot_rows): w's rows from n_main on are slots of slot_rows rows (LoRA's A stacked
    under the base weight) and only those of slot `slot[0]` (a device tensor, -1: none) are computed; the other
    slots' outputs are left unwritten. `pdl_level`: programmatic dependent launch (triton_ops/pdl.py; None:
    RADIXSERVE_PDL)."""
    _check(x, w)
    n = w.shape[0]
    if silu_mul and (n % 2 or slots is not None):
        raise ValueError(f"gemv_row with silu_mul expects a stacked [gate; up] weight (even rows, no slots), got {n}")
    if slots is not None and (slots[2] <= 0 or not 0 <= slots[1] <= n or (n - slots[1]) % slots[2]):
        raise ValueError(f"gemv_row: slots of {slots[2]} rows from row {slots[1]} do not tile {n} rows")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv_row: bias {tuple(bias.shape)} for {n} outputs")
    n_out = n // 2 if silu_mul else n
    cfg = config or (gemv_configs.default("row16", 1, True) if x.is_cuda else _CPU_TILES)
    return _launch(x, w, bias, None, None, silu_mul, n_out, cfg, slots, pdl_level)[0]


def gemv_row_norm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  w2: torch.Tensor | None = None,
                  norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
                  config: gemv_configs.GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [1, N1 (+ N2)], new residual or None) for x [1, K]: out = x' @ [w; w2].T (+ bias), where x' is x, or
    with `norm` = (residual or None, norm weight [K], eps) RMSNorm(x + residual) * norm weight; the new residual
    (x + residual, in x's dtype) is returned when a residual was given. `config`: default `opt_in_config`."""
    _check(x, w, w2)
    k = x.shape[1]
    n = w.shape[0] + (w2.shape[0] if w2 is not None else 0)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv_row: bias {tuple(bias.shape)} for {n} outputs")
    if norm is not None:
        res, nw, _ = norm
        if nw.shape != (k,) or (res is not None and (res.shape != x.shape or res.stride(-1) != 1)):
            raise ValueError(f"gemv_row: norm weight {tuple(nw.shape)} / residual do not match x {tuple(x.shape)}")
    cfg = config or opt_in_config(n, k, norm is not None, x.is_cuda)
    return _launch(x, w, bias, w2, norm, False, n, cfg)
