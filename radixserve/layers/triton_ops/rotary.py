"""Rotary position embedding (neox layout) applied in place to the q and k heads of each token, in one kernel,
optionally also writing the rotated k and the v rows into the KV pool (which saves the separate KV-store kernel).

q and k may be strided views into the fused qkv projection output (row stride larger than their width); the kernel
writes back through the same strides, so no split or copy is made. The math is the torch path's: float32 cos/sin
from the module's cache, float32 products, one rounding to the activation dtype (and a cast to the pool's dtype for
the stored copy, as `store_kv` does)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.kv_store import fp8_max, fp8_saturate
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue


class KVWrite(NamedTuple):
    """Where the rotated k and the v rows of this layer go: the pool's [slots, Hk, D] buffers at slots `loc` [T]
    (an fp8 pool stores k / k_scale and v / v_scale)."""
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    loc: torch.Tensor
    v: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


@triton.jit
def _rotate_heads(X, base, cos, sin, heads, Dst, dst_base, dst_inv, NormW, eps, HALF: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, STORE: tl.constexpr,
                  FP8_MAX: tl.constexpr, NORM: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    p1 = X + base + h * HEAD_DIM + d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # per-head RMSNorm first (Qwen3's q_norm / k_norm), rounded as the RMSNorm kernel rounds
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        rstd = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(NormW + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(NormW + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(X.dtype.element_ty).to(tl.float32) * w1).to(X.dtype.element_ty).to(tl.float32)
        x2 = ((x2 * rstd).to(X.dtype.element_ty).to(tl.float32) * w2).to(X.dtype.element_ty).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(X.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(X.dtype.element_ty)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)
    if STORE:
        d1 = Dst + dst_base + h * HEAD_DIM + d
        if FP8_MAX > 0:
            o1 = fp8_saturate(o1, dst_inv, FP8_MAX)
            o2 = fp8_saturate(o2, dst_inv, FP8_MAX)
        tl.store(d1, o1.to(Dst.dtype.element_ty), mask=mask)
        tl.store(d1 + HALF, o2.to(Dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, V, KBuf, VBuf, Loc, Positions, Cos, Sin, QNormW, KNormW, stride_q, stride_k, stride_v,
                   stride_kb, stride_vb, stride_cache, num_q_heads, num_k_heads, k_inv, v_inv, q_eps, k_eps,
                   HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, STORE_KV: tl.constexpr, FP8_MAX: tl.constexpr, NORM: tl.constexpr,
                   PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    # program (t, 0) rotates token t's q heads, program (t, 1) its k heads (and stores k and v): a decode batch of
    # a few tokens gets twice the programs
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(Cos + pos * stride_cache + d, mask=d < HALF, other=0.0)
    sin = tl.load(Sin + pos * stride_cache + d, mask=d < HALF, other=0.0)
    if tl.program_id(1) == 0:
        _rotate_heads(Q, t * stride_q, cos, sin, num_q_heads, Q, 0, 1.0, QNormW, q_eps, HALF, HEAD_DIM, BLOCK_HQ,
                      BLOCK_HALF, False, 0.0, NORM)
    elif STORE_KV:
        loc = tl.load(Loc + t).to(tl.int64)
        _rotate_heads(K, t * stride_k, cos, sin, num_k_heads, KBuf, loc * stride_kb, k_inv, KNormW, k_eps, HALF,
                      HEAD_DIM, BLOCK_HK, BLOCK_HALF, True, FP8_MAX, NORM)
        h = tl.arange(0, BLOCK_HK)[:, None]
        dv = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        vmask = (h < num_k_heads) & (dv < HEAD_DIM)
        v = tl.load(V + t * stride_v + h * HEAD_DIM + dv, mask=vmask)
        if FP8_MAX > 0:
            v = fp8_saturate(v, v_inv, FP8_MAX)
        tl.store(VBuf + loc * stride_vb + h * HEAD_DIM + dv, v.to(VBuf.dtype.element_ty), mask=vmask)
    else:
        _rotate_heads(K, t * stride_k, cos, sin, num_k_heads, K, 0, 1.0, KNormW, k_eps, HALF, HEAD_DIM, BLOCK_HK,
                      BLOCK_HALF, False, 0.0, NORM)


def _check_kv_write(w: KVWrite, k: torch.Tensor, head_dim: int) -> None:
    t, width = k.shape
    if w.v.shape != k.shape or w.v.stride(-1) != 1 or w.loc.shape != (t,):
        raise ValueError(f"KV write got v {tuple(w.v.shape)} and loc {tuple(w.loc.shape)} for k {tuple(k.shape)}")
    for name, buf in (("k_buf", w.k_buf), ("v_buf", w.v_buf)):
        if buf.dim() != 3 or buf.shape[1] * buf.shape[2] != width or buf.shape[2] != head_dim \
                or buf.stride(2) != 1 or buf.stride(1) != head_dim:
            raise ValueError(f"{name} of shape {tuple(buf.shape)} strides {buf.stride()} does not hold rows of "
                             f"{width // head_dim} heads x {head_dim}")


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and of k (Qwen3's q_norm / k_norm: weights [D]) applied before the rotation."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    q_eps: float
    k_eps: float


def apply_rotary_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                         sin_cache: torch.Tensor, head_dim: int, kv_write: KVWrite | None = None,
                         qk_norm: QKNorm | None = None) -> None:
    """Rotate q [T, Hq*D] and k [T, Hk*D] in place at `positions` [T]; cos/sin caches are [max_pos, D/2] float32.
    With `kv_write`, also store the rotated k and `kv_write.v` [T, Hk*D] into the pool at `kv_write.loc`. With
    `qk_norm`, each head is RMS-normalised (as `RMSNorm` rounds) before it is rotated."""
    if q.dim() != 2 or k.dim() != 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary expects 2-D q and k with unit stride in the last dim")
    if q.shape[0] != k.shape[0] or positions.shape != (q.shape[0],):
        raise ValueError(f"rotary got q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}")
    if q.shape[1] % head_dim or k.shape[1] % head_dim or head_dim % 2:
        raise ValueError(f"q/k widths {q.shape[1]}/{k.shape[1]} are not multiples of an even head_dim {head_dim}")
    if cos_cache.stride(-1) != 1 or cos_cache.shape != sin_cache.shape or cos_cache.stride() != sin_cache.stride():
        raise ValueError("cos and sin caches must have the same contiguous layout")
    if kv_write is not None:
        _check_kv_write(kv_write, k, head_dim)
    if qk_norm is not None and (qk_norm.q_weight.shape != (head_dim,) or qk_norm.k_weight.shape != (head_dim,)):
        raise ValueError(f"q/k norm weights {tuple(qk_norm.q_weight.shape)} / {tuple(qk_norm.k_weight.shape)} are "
                         f"not [{head_dim}]")
    t = q.shape[0]
    if t == 0:
        return
    hq, hk, half = q.shape[1] // head_dim, k.shape[1] // head_dim, head_dim // 2
    if kv_write is None:  # unused pointer arguments: any tensor will do
        v, k_buf, v_buf, loc, sv, skb, svb = k, k, k, positions, 0, 0, 0
        k_inv = v_inv = 1.0
        fmax = 0.0
    else:
        v, k_buf, v_buf, loc = kv_write.v, kv_write.k_buf, kv_write.v_buf, kv_write.loc
        sv, skb, svb = v.stride(0), k_buf.stride(0), v_buf.stride(0)
        k_inv, v_inv, fmax = 1.0 / kv_write.k_scale, 1.0 / kv_write.v_scale, fp8_max(k_buf.dtype)
    norm = qk_norm or QKNorm(cos_cache, cos_cache, 0.0, 0.0)  # unused pointers when there is no norm
    launch(_rotary_kernel, (t, 2), q, k, v, k_buf, v_buf, loc, positions, cos_cache, sin_cache, norm.q_weight,
           norm.k_weight, q.stride(0), k.stride(0), sv, skb, svb, cos_cache.stride(0), hq, hk, k_inv, v_inv,
           float(norm.q_eps), float(norm.k_eps), HALF=half, HEAD_DIM=head_dim, BLOCK_HQ=triton.next_power_of_2(hq),
           BLOCK_HK=triton.next_power_of_2(hk), BLOCK_HALF=triton.next_power_of_2(half),
           STORE_KV=kv_write is not None, FP8_MAX=fmax, NORM=qk_norm is not None, **pdl.launch_opts(q))
