"""The Q4_K one-row q/k/v product (dp4c, `gguf_chunk_kernels`) with the rotary embedding and the KV store in its
epilogue, as `triton_ops/gemv_rope` does for 16-bit weights: each program owns R rows of the first half of one head
and the R rows HALF further on (the other halves of the same rotary pairs), multiplies them with dp4c's loop
(`_dp4c_row_sums`) and ends in `gemv_rope`'s epilogue (`_rope_store`: the product rounded as the plain kernel stores
it, q and k rotated, k and v stored at the token's slot). One launch a layer fewer than dp4c + the rotary kernel; the
weight's bytes are read as by dp4c (2 R rows a program)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.quantization.gguf_chunk_kernels import _dp4c_row_sums
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.gemv_rope import KVDest, _rope_store, rope_launch_args
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue


class RopeArgs(NamedTuple):
    """What a q/k/v product needs to rotate q and k (neox layout) and store k and v: the heads, the token's position
    (a device tensor), the rotary module's float32 cos / sin caches [max_pos, D / 2], the KV destination or None."""
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    kv: KVDest | None


@triton.jit
def _q4_k_dp4c_rope_kernel(XW, F, W32, Sc16, Mn16, D, Dmin, Out, Bias, Positions, Cos, Sin, Loc, KBuf, VBuf, K,
                           stride_fm, stride_ww, stride_s16, stride_dn, stride_cache, stride_kb, stride_vb,
                           num_q_heads, num_kv_heads, k_inv, v_inv, HAS_BIAS: tl.constexpr, STORE_KV: tl.constexpr,
                           FP8_MAX: tl.constexpr, ASM: tl.constexpr, HALF: tl.constexpr, R: tl.constexpr,
                           NCH: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)  # the one row of x
    per_head = HALF // R
    head = pid // per_head
    d = (pid % per_head) * R + tl.arange(0, R)  # positions in the head's first half
    i = tl.arange(0, 2 * R)
    rows = (head * (2 * HALF) + (pid % per_head) * R + i % R + (i // R) * HALF).to(tl.int64)  # both runs
    pos = tl.load(Positions).to(tl.int64)  # before the loop: their latency hides behind the weight's
    loc = tl.load(Loc).to(tl.int64) if STORE_KV else 0
    out = _dp4c_row_sums(XW, F, W32, Sc16, Mn16, D, Dmin, m, rows, rows >= 0, K, stride_fm, stride_ww, stride_s16,
                         stride_dn, ASM, 2 * R, NCH, True)
    if HAS_BIAS:
        out += tl.load(Bias + rows).to(tl.float32)
    o1, o2 = tl.split(tl.permute(tl.reshape(out, (2, R)), (1, 0)))
    _rope_store(o1, o2, head, d, head * (2 * HALF) + d, Out, Cos, Sin, pos, stride_cache, loc, KBuf, VBuf,
                stride_kb, stride_vb, num_q_heads, num_kv_heads, k_inv, v_inv, STORE_KV, FP8_MAX, HALF)


def rope_rows(cfg: GemvConfig, head_dim: int) -> int:
    """Rows per half-head run for dp4c's tiles `cfg` (its 2 R rows a program), or 0 where they do not tile half a
    head."""
    r = max(1, cfg.block_n // 2)
    return r if head_dim % 2 == 0 and (head_dim // 2) % r == 0 else 0


def dp4c_qkv_rope(xw: torch.Tensor, f: torch.Tensor, fields: dict[str, torch.Tensor], n: int,
                  bias: torch.Tensor | None, cfg: GemvConfig, rope: RopeArgs, out: torch.Tensor) -> torch.Tensor:
    """out [1, n] = x @ dequant(W).T (+ bias) from x quantised for dp4c (words, factors), q and k heads rotated at
    `rope.positions[0]`, k and v stored to `rope.kv`; `cfg` from `gguf_kernels.dp4c_config`."""
    if xw.shape[0] != 1:
        raise ValueError(f"dp4c_qkv_rope takes one row of x; got {xw.shape[0]}")
    r = rope_rows(cfg, rope.head_dim)
    if r == 0:
        raise ValueError(f"dp4c_qkv_rope: {cfg.block_n} rows a program do not tile half a head of {rope.head_dim}")
    loc, k_buf, v_buf, skb, svb, k_inv, v_inv, fmax = rope_launch_args(
        "dp4c_qkv_rope", n, rope.num_q_heads, rope.num_kv_heads, rope.head_dim, bias, rope.positions,
        rope.cos_cache, rope.sin_cache, rope.kv, out)
    from radixserve.layers.quantization.gguf_kernels import dp4c_tiles

    block_k, opts = dp4c_tiles(cfg, xw.shape[1] * 4, xw.is_cuda)
    wq, sc, d = fields["qweight"], fields["scales"], fields["d"]
    w32, sc16, mn16 = wq.view(torch.int32), sc.view(torch.int16), fields["mins"].view(torch.int16)
    launch(_q4_k_dp4c_rope_kernel, (n // (2 * r), 1), xw, f, w32, sc16, mn16, d, fields["dmin"], out,
           bias if bias is not None else d, rope.positions, rope.cos_cache, rope.sin_cache, loc, k_buf, v_buf,
           xw.shape[1] * 4, f.stride(0), w32.stride(0), sc16.stride(0), d.stride(0), rope.cos_cache.stride(0), skb, svb,
           rope.num_q_heads, rope.num_kv_heads, k_inv, v_inv, HAS_BIAS=bias is not None, STORE_KV=rope.kv is not None,
           FP8_MAX=fmax, ASM=xw.is_cuda, HALF=rope.head_dim // 2, R=r, NCH=block_k // 64, **opts,
           **pdl.launch_opts(xw))
    return out
