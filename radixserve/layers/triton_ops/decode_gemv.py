"""One activation row times one or two 16-bit weights (decode at batch 1), optionally with the RMSNorm before it.

At batch 1 a linear layer streams its weight once to make one row. cuBLAS does that well for large weights, but for
the 2-20 MB attention projections of the MoE models it picks split-K kernels that need a second reduce launch
(o_proj), and the RMSNorm before q/k/v is a launch of its own. This kernel makes each of those one launch:

- programs over the output rows (BLOCK_N each, no split-K); a [BLOCK_N, BLOCK_K] float32 product accumulated on the
  CUDA cores and summed over K once after the loop;
- two weights side by side (`w2`): out = x @ [W1; W2].T, for projections that read the same input (DeepSeek's
  q_proj and kv_a_proj_with_mqa) in one launch;
- `norm`: the input is RMSNorm(x + residual) * weight, rounded as `fused_add_rmsnorm` rounds (the sum to the
  activation dtype, the normalised row to it, the product with the weight to it). Every program takes the row's
  statistics itself (one extra pass over a few KB that stay in L2) and program 0 stores the new residual.

The layers call it through `_LinearBase.forward` when they carry `decode_gemv` (set by the MoE / MLA models on their
attention projections) and the batch is one row; the torch product is the reference (tests/test_decode_gemv.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch


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
def _decode_gemv_kernel(X, Res, NormW, ResOut, W1, W2, Bias, Out, N1, N, K, eps,
                        NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    in_w1 = offs_n < N1
    rows = tl.where(in_w1, offs_n, offs_n - N1).to(tl.int64) * K
    w_rows = tl.where(in_w1[:, None], W1 + rows[:, None], W2 + rows[:, None])  # [BLOCK_N, 1] row starts
    offs = tl.arange(0, BLOCK_K)
    dtype = Out.dtype.element_ty
    rstd = 1.0
    if NORM:  # the row's statistics: one pass over x (+ residual)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + offs
            mask_k = offs_k < K
            s = _normed_chunk(X, Res, NormW, offs_k, mask_k, 1.0, HAS_RES, False, dtype)
            sq += s * s
            if HAS_RES:
                if pid == 0:
                    tl.store(ResOut + offs_k, s.to(ResOut.dtype.element_ty), mask=mask_k)
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs
        mask_k = offs_k < K
        x = _normed_chunk(X, Res, NormW, offs_k, mask_k, rstd, HAS_RES, NORM, dtype)
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + offs_n, out.to(dtype), mask=mask_n)


def _config(n: int, k: int, cuda: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) from the "bf16" family of `gemv_configs` (swept on the GPU by
    benchmarks/bench_decode_gemv.py; RADIXSERVE_GEMV_CONFIGS=picks.json overrides)."""
    from radixserve.layers.quantization import gemv_configs

    cfg = gemv_configs.get("bf16", 1, n, k, cuda)
    return cfg.block_n, min(cfg.block_k, triton.next_power_of_2(k)), cfg.num_warps, cfg.num_stages


def decode_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, w2: torch.Tensor | None = None,
                norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
                config: tuple[int, int, int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [1, N1 (+ N2)], new residual or None) for x [1, K]: out = x' @ [w; w2].T (+ bias), where x' is x, or
    with `norm` = (residual or None, norm weight [K], eps) RMSNorm(x + residual) * norm weight; the new residual
    (x + residual, in x's dtype) is returned when a residual was given. w, w2 [N, K] contiguous in x's dtype."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1:
        raise ValueError(f"decode_gemv takes one contiguous row; got {tuple(x.shape)}")
    k = x.shape[1]
    for m in (w, w2):
        if m is not None and (m.dim() != 2 or m.shape[1] != k or not m.is_contiguous() or m.dtype != x.dtype):
            raise ValueError(f"decode_gemv: weight {tuple(m.shape)} {m.dtype} does not fit x {tuple(x.shape)} "
                             f"{x.dtype} (contiguous, same dtype)")
    n1 = w.shape[0]
    n = n1 + (w2.shape[0] if w2 is not None else 0)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"decode_gemv: bias {tuple(bias.shape)} for {n} outputs")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res, nw, eps = norm if norm is not None else (None, x, 0.0)
    if norm is not None and (nw.shape != (k,) or (res is not None and (res.shape != x.shape or res.stride(-1) != 1))):
        raise ValueError(f"decode_gemv: norm weight {tuple(nw.shape)} / residual do not match x {tuple(x.shape)}")
    res_out = torch.empty_like(x) if res is not None else None
    bn, bk, warps, stages = config or _config(n, k, x.is_cuda)
    opts = dict(num_warps=warps, num_stages=stages) if x.is_cuda else {}
    launch(_decode_gemv_kernel, (triton.cdiv(n, bn),), x, res if res is not None else x, nw,
           res_out if res_out is not None else out, w, w2 if w2 is not None else w, bias if bias is not None else out,
           out, n1, n, k, float(eps), NORM=norm is not None, HAS_RES=res is not None, HAS_BIAS=bias is not None,
           BLOCK_N=bn, BLOCK_K=bk, **opts)
    return out, res_out
