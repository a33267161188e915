"""The one-row q/k/v product with the rotary embedding and the KV store in its epilogue (decode at batch 1).

At batch 1 a Llama-family attention block runs the qkv GEMV (`gemv.py`), then the rotary kernel (`rotary.py`),
which rotates q and k in place and stores k and v into the KV pool. The rotary kernel reads and writes a few KB: its
time is its launch and its ramp, ~2 µs a layer. Here the GEMV's programs are laid out so that each one owns
`BLOCK_N` rows of the first half of one head and the `BLOCK_N` rows `HALF` further on, the other half of the same
rotary pairs; the epilogue then rotates them (q and k heads), writes the projection's output as the two kernels
together would leave it (q and k rotated, v as is) and stores k and v at the token's KV slot. One launch a layer
fewer; the weight is read as by the plain GEMV (the same bytes per program, two runs of rows instead of one).

The arithmetic is the two kernels': float32 accumulation, the product (+ bias) rounded to the activation dtype,
the rotation in float32 with the module's float32 cos/sin, one rounding; an fp8 pool stores k / k_scale and
v / v_scale clamped to the format's range (`kv_store.fp8_saturate`). Neox layout only (rotate_half), one token."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization import gemv_configs
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.kv_store import fp8_max, fp8_saturate
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

ENABLED = os.environ.get("RADIXSERVE_GEMV_ROPE", "1") not in ("0", "")


class KVDest(NamedTuple):
    """Where the token's k and v rows go: the pool's [slots, Hk, D] buffers at slot `loc[0]` (an fp8 pool stores
    k / k_scale and v / v_scale)."""
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    loc: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


@triton.jit
def _store_kv_half(Buf, base, d, y, inv, FP8_MAX: tl.constexpr):
    if FP8_MAX > 0:
        y = fp8_saturate(y, inv, FP8_MAX)
    tl.store(Buf + base + d, y.to(Buf.dtype.element_ty))


@triton.jit
def _rope_store(o1, o2, head, d, rows, Out, Cos, Sin, pos, stride_cache, loc, KBuf, VBuf, stride_kb, stride_vb,
                num_q_heads, num_kv_heads, k_inv, v_inv, STORE_KV: tl.constexpr, FP8_MAX: tl.constexpr,
                HALF: tl.constexpr):
    """The epilogue of a q/k/v product whose program holds rows `rows` (first halves, d within the head) and
    rows + HALF of head `head`, their float32 sums o1 / o2 (+ bias): rounded as the plain product stores them,
    q and k rotated at position `pos`, all stored to Out and (STORE_KV) k and v to the token's slot `loc`."""
    dtype = Out.dtype.element_ty
    x1 = o1.to(dtype).to(tl.float32)  # the projection's output as the plain GEMV stores it
    x2 = o2.to(dtype).to(tl.float32)
    if head < num_q_heads + num_kv_heads:  # q or k: rotate
        cos = tl.load(Cos + pos * stride_cache + d)
        sin = tl.load(Sin + pos * stride_cache + d)
        y1 = (x1 * cos - x2 * sin).to(dtype)
        y2 = (x2 * cos + x1 * sin).to(dtype)
    else:  # v
        y1 = x1.to(dtype)
        y2 = x2.to(dtype)
    tl.store(Out + rows, y1)
    tl.store(Out + rows + HALF, y2)
    if STORE_KV:
        if head >= num_q_heads:
            if head < num_q_heads + num_kv_heads:
                base = loc * stride_kb + (head - num_q_heads) * (2 * HALF)
                _store_kv_half(KBuf, base, d, y1, k_inv, FP8_MAX)
                _store_kv_half(KBuf, base + HALF, d, y2, k_inv, FP8_MAX)
            else:
                base = loc * stride_vb + (head - num_q_heads - num_kv_heads) * (2 * HALF)
                _store_kv_half(VBuf, base, d, y1, v_inv, FP8_MAX)
                _store_kv_half(VBuf, base + HALF, d, y2, v_inv, FP8_MAX)


@triton.jit
def _gemv_rope_kernel(X, W, Bias, Out, Positions, Cos, Sin, Loc, KBuf, VBuf, K, stride_wn, stride_cache,
                      stride_kb, stride_vb, num_q_heads, num_kv_heads, k_inv, v_inv,
                      HAS_BIAS: tl.constexpr, STORE_KV: tl.constexpr, FP8_MAX: tl.constexpr, EVEN_K: tl.constexpr,
                      HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    per_head = HALF // BLOCK_N
    head = pid // per_head
    d = (pid % per_head) * BLOCK_N + tl.arange(0, BLOCK_N)  # positions in the head's first half
    rows = head * (2 * HALF) + d
    # what the epilogue needs besides the product, asked for before the loop so that its latency hides behind the
    # weight's (only cos / sin, which need the position, are loaded after it)
    pos = tl.load(Positions).to(tl.int64)
    loc = tl.load(Loc).to(tl.int64) if STORE_KV else 0
    if HAS_BIAS:
        b1 = tl.load(Bias + rows).to(tl.float32)
        b2 = tl.load(Bias + rows + HALF).to(tl.float32)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    hi = HALF * stride_wn.to(tl.int64)  # the same pairs' second halves
    # x through a [BLOCK_N, BLOCK_K] tile of the weight tile's layout (the repeats hit L1), as in gemv.py
    x_ptrs = X + cols[None, :] + 0 * rows[:, None]
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            w1 = tl.load(w_ptrs, eviction_policy="evict_first")
            w2 = tl.load(w_ptrs + hi, eviction_policy="evict_first")
        else:
            mask = (cols[None, :] < K - k0) & (rows[:, None] >= 0)
            x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
            w1 = tl.load(w_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
            w2 = tl.load(w_ptrs + hi, mask=mask, other=0.0, eviction_policy="evict_first")
        acc1 += w1.to(tl.float32) * x
        acc2 += w2.to(tl.float32) * x
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    o1 = tl.sum(acc1, axis=1)
    o2 = tl.sum(acc2, axis=1)
    if HAS_BIAS:
        o1 += b1
        o2 += b2
    _rope_store(o1, o2, head, d, rows, Out, Cos, Sin, pos, stride_cache, loc, KBuf, VBuf, stride_kb, stride_vb,
                num_q_heads, num_kv_heads, k_inv, v_inv, STORE_KV, FP8_MAX, HALF)


def rope_entry(w: torch.Tensor) -> gemv_configs.GemvConfig | None:
    """The table's "row16_rope" entry for this [N, K] weight's shape (`benchmarks/bench_gemv_rope.py` writes one
    where the fusion wins), or None. The entry stands alone: where the plain one-row GEMV has none (cuBLAS serves the
    shape), the fused kernel was measured against cuBLAS + rotary. None with RADIXSERVE_GEMV_ROPE=0 or
    RADIXSERVE_GEMV_ROW=0 (no Triton one-row GEMV at all), or for a weight the one-row kernels do not serve."""
    from radixserve.layers.triton_ops.gemv import row16_weight

    if not ENABLED or not row16_weight(w):
        return None
    return gemv_configs.lookup("row16_rope", 1, w.shape[0], w.shape[1])


def gemv_rope_config(w: torch.Tensor, head_dim: int) -> gemv_configs.GemvConfig | None:
    """The tiles for a fused q/k/v + rotary product on this weight, or None to keep the two kernels: `rope_entry`,
    whose block_n (rows per half-head run) must tile half a head."""
    cfg = rope_entry(w)
    if cfg is None or (head_dim // 2) % cfg.block_n:
        return None
    return cfg


def rope_launch_args(who: str, n: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                     bias: torch.Tensor | None, positions: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor, kv: KVDest | None, out: torch.Tensor) -> tuple:
    """Checks a fused q/k/v + rotary product's arguments (ValueError naming `who`) and returns the kernel's KV
    arguments: (loc, k_buf, v_buf, k_buf row stride, v_buf row stride, 1 / k_scale, 1 / v_scale, fp8 max or 0),
    `out` and `positions` standing in for the pointers when there is no KV destination."""
    half = head_dim // 2
    if head_dim % 2 or n != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"{who}: {n} rows are not ({num_q_heads} + 2 x {num_kv_heads}) heads of an even "
                         f"head_dim {head_dim}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{who}: bias {tuple(bias.shape)} for {n} outputs")
    if positions.numel() < 1 or cos_cache.shape != sin_cache.shape or cos_cache.shape[-1] < half \
            or cos_cache.stride(-1) != 1 or cos_cache.stride() != sin_cache.stride():
        raise ValueError(f"{who}: a position and cos / sin caches of one contiguous [max_pos, D/2] layout")
    if kv is None:  # unused pointer arguments
        return positions, out, out, 0, 0, 1.0, 1.0, 0.0
    for name, buf in (("k_buf", kv.k_buf), ("v_buf", kv.v_buf)):
        if buf.dim() != 3 or buf.shape[1:] != (num_kv_heads, head_dim) or buf.stride(2) != 1 \
                or buf.stride(1) != head_dim:
            raise ValueError(f"{who}: {name} {tuple(buf.shape)} does not hold rows of {num_kv_heads} heads x "
                             f"{head_dim}")
    if kv.loc.numel() < 1 or kv.k_buf.dtype != kv.v_buf.dtype:
        raise ValueError(f"{who}: the KV destination needs a slot and one dtype for k and v")
    return (kv.loc, kv.k_buf, kv.v_buf, kv.k_buf.stride(0), kv.v_buf.stride(0), 1.0 / kv.k_scale, 1.0 / kv.v_scale,
            fp8_max(kv.k_buf.dtype))


def gemv_qkv_rope(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, num_q_heads: int, num_kv_heads: int,
                  head_dim: int, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                  kv: KVDest | None, config: gemv_configs.GemvConfig) -> torch.Tensor:
    """qkv [1, (Hq + 2 Hk) D] = x [1, K] @ w.T (+ bias), q and k heads rotated at `positions[0]` (neox layout;
    cos/sin caches [max_pos, D/2] float32); with `kv` the
    rotated k and the v rows are also stored in the pool. `config.block_n`: rows per program in each half-head run."""
    n = w.shape[0]
    half = head_dim // 2
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1 or w.dim() != 2 or w.shape[1] != x.shape[1] \
            or w.stride(-1) != 1 or w.dtype != x.dtype:
        raise ValueError(f"gemv_qkv_rope expects x [1, K] and w [N, K] of x's dtype with unit stride in K; got x "
                         f"{tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    if config.block_n < 1 or half % config.block_n:
        raise ValueError(f"gemv_qkv_rope: {config.block_n} rows a program do not tile half a head ({half})")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    loc, k_buf, v_buf, skb, svb, k_inv, v_inv, fmax = rope_launch_args(
        "gemv_qkv_rope", n, num_q_heads, num_kv_heads, head_dim, bias, positions, cos_cache, sin_cache, kv, out)
    k = x.shape[1]
    block_k = min(config.block_k, triton.next_power_of_2(k))
    opts = dict(num_warps=config.num_warps, num_stages=config.num_stages) if x.is_cuda else {}
    launch(_gemv_rope_kernel, (n // (2 * config.block_n),), x, w, bias if bias is not None else out, out, positions,
           cos_cache, sin_cache, loc, k_buf, v_buf, k, w.stride(0), cos_cache.stride(0), skb, svb, num_q_heads,
           num_kv_heads, k_inv, v_inv, HAS_BIAS=bias is not None, STORE_KV=kv is not None, FP8_MAX=fmax,
           EVEN_K=k % block_k == 0, HALF=half, BLOCK_N=config.block_n, BLOCK_K=block_k, **opts, **pdl.launch_opts(x))
    return out
