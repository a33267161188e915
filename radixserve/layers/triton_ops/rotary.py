"""Rotary position embedding (neox layout) applied in place to the q and k heads of each token, in one kernel.

q and k may be strided views into the fused qkv projection output (row stride larger than their width); the kernel
writes back through the same strides, so no split or copy is made. The math is the torch path's: float32 cos/sin
from the module's cache, float32 products, one rounding to the activation dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, base, cos, sin, heads, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    p1 = X + base + h * HEAD_DIM + d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(p1, o1.to(X.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, Positions, Cos, Sin, stride_q, stride_k, stride_cache, num_q_heads, num_k_heads,
                   HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(Cos + pos * stride_cache + d, mask=d < HALF, other=0.0)
    sin = tl.load(Sin + pos * stride_cache + d, mask=d < HALF, other=0.0)
    _rotate_heads(Q, t * stride_q, cos, sin, num_q_heads, HALF, HEAD_DIM, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(K, t * stride_k, cos, sin, num_k_heads, HALF, HEAD_DIM, BLOCK_HK, BLOCK_HALF)


def apply_rotary_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                         sin_cache: torch.Tensor, head_dim: int) -> None:
    """Rotate q [T, Hq*D] and k [T, Hk*D] in place at `positions` [T]; cos/sin caches are [max_pos, D/2] float32."""
    if q.dim() != 2 or k.dim() != 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary expects 2-D q and k with unit stride in the last dim")
    if q.shape[0] != k.shape[0] or positions.shape != (q.shape[0],):
        raise ValueError(f"rotary got q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}")
    if q.shape[1] % head_dim or k.shape[1] % head_dim or head_dim % 2:
        raise ValueError(f"q/k widths {q.shape[1]}/{k.shape[1]} are not multiples of an even head_dim {head_dim}")
    if cos_cache.stride(-1) != 1 or cos_cache.shape != sin_cache.shape or cos_cache.stride() != sin_cache.stride():
        raise ValueError("cos and sin caches must have the same contiguous layout")
    t = q.shape[0]
    if t == 0:
        return
    hq, hk, half = q.shape[1] // head_dim, k.shape[1] // head_dim, head_dim // 2
    _rotary_kernel[(t,)](q, k, positions, cos_cache, sin_cache, q.stride(0), k.stride(0), cos_cache.stride(0),
                         hq, hk, HALF=half, HEAD_DIM=head_dim, BLOCK_HQ=triton.next_power_of_2(hq),
                         BLOCK_HK=triton.next_power_of_2(hk), BLOCK_HALF=triton.next_power_of_2(half))
