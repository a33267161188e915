"""The one-row fp8 decode GEMV (`fp8_gemv`, the elementwise kernel) with the RMSNorm before it in its launch and,
for q/k/v, the rotary embedding and the KV store in its epilogue.

A Llama-family decode layer at batch 1 runs add + RMSNorm, q/k/v, rotary + KV store, attention, o, add + RMSNorm,
gate/up + SiLU·mul, down. The norm and rotary kernels move a few KB each: their time is their launch and ramp. Here
the norm goes into the next product's launch and the rotation into q/k/v's epilogue, 5 launches a layer instead of 8:

- every program first takes the row's statistics itself, exactly as the norm kernel does (the whole row, x +
  residual rounded to the activation dtype, in one tile: a few KB the L2 serves), and program 0 stores the new
  residual; each loop step then normalises its BLOCK_K columns (rounded as the norm kernel rounds) before the
  product, so the product sees the bytes the norm kernel would have written;
- `rope`: each program owns R = BLOCK_N / 2 rows of the first half of one head and the R rows HALF further on (the
  other halves of the same rotary pairs) and ends in `gemv_rope`'s epilogue (`_rope_store`: the product rounded as
  the plain GEMV stores it, q and k rotated, k and v stored at the token's slot);
- `silu_mul`: W is [gate; up] and the result silu(gate) * up, as `fp8_skinny_gemv(silu_mul=True)`.

The weight is read as by the plain kernel (the table's "fp8" / "fp8_silu" tiles for the shape)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization import gemv_configs
from radixserve.layers.quantization.fp8_gemv import EW_FLAGS, _acc, _load_w, _row_out, _widen
from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.gemv import _normed_chunk
from radixserve.layers.triton_ops.gemv_rope import _rope_store, rope_launch_args
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

# RADIXSERVE_FP8_FOLD_NORM=0 keeps the norm (and the rotary) kernels separate (comparisons)
ENABLED = os.environ.get("RADIXSERVE_FP8_FOLD_NORM", "1") not in ("0", "")


@triton.jit
def _fp8_normed_gemv_kernel(X, Res, NormW, ResOut, W, S, Bias, Out, Positions, Cos, Sin, Loc, KBuf, VBuf, N, K,
                            stride_wn, out_factor, eps, stride_cache, stride_kb, stride_vb, num_q_heads, num_kv_heads,
                            k_inv, v_inv, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                            ROPE: tl.constexpr, STORE_KV: tl.constexpr, FP8_MAX: tl.constexpr, HALF: tl.constexpr,
                            WIDEN_F16: tl.constexpr, EVICT: tl.constexpr, RED8: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK_N)
    R: tl.constexpr = BLOCK_N // 2
    if ROPE:  # R rows of a head's first half and the R rows HALF on
        per_head = HALF // R
        head = pid // per_head
        offs_n = head * (2 * HALF) + (pid % per_head) * R + i % R + (i // R) * HALF
    else:
        offs_n = pid * BLOCK_N + i
    mask_n = offs_n < N
    dtype = Out.dtype.element_ty
    if ROPE:  # before the loop: their latency hides behind the weight's
        pos = tl.load(Positions).to(tl.int64)
        loc = tl.load(Loc).to(tl.int64) if STORE_KV else 0
    # the row's statistics as the norm kernel takes them (triton_ops/norm.py: one tile of the whole row)
    cols = tl.arange(0, ROW_BLOCK)
    h = tl.load(X + cols, mask=cols < K, other=0.0)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(Res + cols, mask=cols < K, other=0.0).to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(ResOut + cols, h, mask=cols < K)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / K + eps)
    offs_k = tl.arange(0, BLOCK_K)
    offs_k = (offs_k // 8) * 8 + offs_k % 8  # runs of 8 columns a thread, as in `_fp8_gemv_ew_kernel`
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_rows = N * stride_wn.to(tl.int64)
    ACC_K: tl.constexpr = BLOCK_K // 8 if RED8 else BLOCK_K
    acc0 = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)  # the up rows
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (the wrapper checks)
        w = _load_w(w_ptrs, mask_n, EVICT)
        u = _load_w(w_ptrs + up_rows, mask_n, EVICT) if SILU_MUL else w
        x = _normed_chunk(X, Res, NormW, k0 + offs_k, k0 + offs_k < K, rstd, HAS_RES, True, dtype)[None, :]
        acc0 = _acc(acc0, _widen(w, WIDEN_F16), x, RED8)
        if SILU_MUL:
            acc1 = _acc(acc1, _widen(u, WIDEN_F16), x, RED8)
        w_ptrs += BLOCK_K
    out = _row_out(acc0, acc1, S, Bias, offs_n, mask_n, N, out_factor, HAS_BIAS, SILU_MUL, dtype)
    if ROPE:
        o1, o2 = tl.split(tl.permute(tl.reshape(out, (2, R)), (1, 0)))
        d = (pid % per_head) * R + tl.arange(0, R)
        _rope_store(o1, o2, head, d, head * (2 * HALF) + d, Out, Cos, Sin, pos, stride_cache, loc, KBuf, VBuf,
                    stride_kb, stride_vb, num_q_heads, num_kv_heads, k_inv, v_inv, STORE_KV, FP8_MAX, HALF)
    else:
        tl.store(Out + offs_n, out.to(dtype), mask=mask_n)


def rope_rows(cfg: gemv_configs.GemvConfig, head_dim: int) -> int:
    """Rows per half-head run for the elementwise tiles `cfg` (BLOCK_N = 2 R), or 0 where they do not pair."""
    r = cfg.block_n // 2
    return r if r >= 1 and cfg.block_n % 2 == 0 and head_dim % 2 == 0 and (head_dim // 2) % r == 0 else 0


def fp8_normed_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False,
                    rope: RopeArgs | None = None,
                    config: gemv_configs.GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                             bool] | None:
    """(out, new residual or None, rotated) for one row x [1, K]: out = RMSNorm(x + residual) * norm_weight times
    the fp8 weight w [N, K] with per-channel scales [N] (+ bias); with `silu_mul` w is [gate; up] and out
    silu(gate) * up [1, N / 2]; with `rope` (q/k/v) q and k rotated and k / v stored to `rope.kv` in the epilogue
    where the tiles pair the rotary halves (`rotated` says whether they did). None where these kernels do not take
    the product (the table's tile for the shape is not the elementwise kernel; the caller keeps the norm kernel)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1 or x.dtype not in (torch.bfloat16, torch.float16,
                                                                                torch.float32):
        raise ValueError(f"fp8_normed_gemv takes one contiguous 16/32-bit row; got x {tuple(x.shape)} {x.dtype}")
    n, k = w.shape
    if w.dim() != 2 or k != x.shape[1] or w.stride(-1) != 1 or scale.numel() != n or (silu_mul and n % 2):
        raise ValueError(f"fp8_normed_gemv: weight {tuple(w.shape)} with {scale.numel()} scales does not fit x "
                         f"{tuple(x.shape)} (per-channel scales; [gate; up] rows even with silu_mul)")
    if norm_weight.shape != (k,) or (residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1)):
        raise ValueError(f"fp8_normed_gemv: norm weight {tuple(norm_weight.shape)} / residual do not match x "
                         f"{tuple(x.shape)}")
    if silu_mul and rope is not None:
        raise ValueError("fp8_normed_gemv: the rotation is for q/k/v, SiLU·mul for gate/up; not both")
    cfg = config or gemv_configs.get("fp8_silu" if silu_mul else "fp8", 1, n, k, x.is_cuda)
    if cfg.kernel != "ew" or k % 16:
        return None
    flags = set(cfg.variant.split("+"))
    if not flags <= EW_FLAGS:
        raise ValueError(f"fp8 GEMV: unknown variant {cfg.variant!r} (flags joined by '+': {sorted(EW_FLAGS)})")
    block_k = cfg.block_k
    while k % block_k:
        block_k //= 2
    r = rope_rows(cfg, rope.head_dim) if rope is not None else 0
    n_out = n // 2 if silu_mul else n
    block_n = max(1, cfg.block_n // 2) if silu_mul else cfg.block_n
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if r:
        loc, k_buf, v_buf, skb, svb, k_inv, v_inv, fmax = rope_launch_args(
            "fp8_normed_gemv", n, rope.num_q_heads, rope.num_kv_heads, rope.head_dim, bias, rope.positions,
            rope.cos_cache, rope.sin_cache, rope.kv, out)
        positions, cos, sin, stride_cache = rope.positions, rope.cos_cache, rope.sin_cache, rope.cos_cache.stride(0)
        grid = n // (2 * r)
    else:
        loc, k_buf, v_buf, skb, svb, k_inv, v_inv, fmax = out, out, out, 0, 0, 1.0, 1.0, 0.0
        positions, cos, sin, stride_cache = out, out, out, 0
        grid = triton.cdiv(n_out, block_n)
    widen = "f16" in flags
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages) if x.is_cuda else {}
    s = scale.reshape(-1)
    launch(_fp8_normed_gemv_kernel, (grid,), x, residual if residual is not None else x, norm_weight,
           res_out if res_out is not None else x, w.view(torch.uint8) if widen else w, s,
           bias if bias is not None else s, out, positions, cos, sin, loc, k_buf, v_buf, n_out, k, w.stride(0),
           256.0 if widen else 1.0, float(eps), stride_cache, skb, svb,
           rope.num_q_heads if r else 0, rope.num_kv_heads if r else 0, k_inv, v_inv,
           HAS_RES=residual is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ROPE=bool(r),
           STORE_KV=bool(r) and rope.kv is not None, FP8_MAX=fmax, HALF=rope.head_dim // 2 if r else 1,
           WIDEN_F16=widen, EVICT="ef" in flags, RED8="r8" in flags, BLOCK_N=block_n, BLOCK_K=block_k,
           ROW_BLOCK=triton.next_power_of_2(k), **opts, **pdl.launch_opts(x))
    return out, res_out, bool(r)
