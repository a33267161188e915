"""Extend (prefill on top of a cached prefix) attention.

For request b, its extend_len new tokens (rows extend_start .. extend_start + extend_len - 1 of q, k, v) attend to
  1. the cached prefix: positions 0 .. prefix_len - 1, whose K/V are read from the pool through
     req_to_token[req_pool_indices[b], :prefix_len] (no mask: every new token sees the whole prefix), and
  2. the new tokens themselves, causally, read from the contiguous k/v inputs (not from the pool).
Under a sliding window of W tokens (SLIDING, window = W) a query at position p sees only the keys at p - W + 1 .. p,
under chunked attention of C tokens (SLIDING, window = -C: Llama 4) those at (p // C) * C .. p (`first_visible`):
the loops start at the first block any query of the program can see, and every block is masked.
One program handles BLOCK_M new tokens of one query head; both phases share one online softmax. Query heads map to
KV heads by integer division (GQA). An fp8 pool's prefix is read times its k/v scales (k's folded into the prefix's
score scale, v's applied as the tile is widened). Lengths vary per request; programs past a request's end exit at once.
With attention sinks (HAS_SINKS, GPT-OSS) each head's sink logit joins the final softmax sum, once per query.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.common import (
    LOG2E,
    check_sinks,
    first_visible,
    kernel_window,
    mma,
    online_softmax_step,
    sink_weight,
    soft_cap,
)
from radixserve.layers.triton_ops.launch import launch


@triton.jit
def _softmax_step(q, k, v, visible, m_i, l_i, acc, sm_scale_log2, DOT_FP32: tl.constexpr, MASKED: tl.constexpr,
                  ROWS_MAY_BE_EMPTY: tl.constexpr = False, CAP: tl.constexpr = 0.0):
    """One KV block of the online softmax (`online_softmax_step`) with the scores q·k (soft-capped when CAP > 0);
    `visible` [BLOCK_M, BLOCK_N] is only read when MASKED."""
    qk = mma(q, tl.trans(k), DOT_FP32) * sm_scale_log2
    if CAP > 0:
        qk = soft_cap(qk, CAP)
    return online_softmax_step(qk, v, visible, m_i, l_i, acc, DOT_FP32, MASKED, ROWS_MAY_BE_EMPTY)


@triton.jit
def _extend_kernel(
    Q, K_Ext, V_Ext, Out, K_Buf, V_Buf,
    Req_to_token, Req_pool_indices, Prefix_lens, Extend_lens, Extend_start, Sinks,
    sm_scale_log2, prefix_scale_log2, v_scale, window,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_kbt, stride_kbh,
    stride_vbt, stride_vbh,
    stride_r2t,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
    SLIDING: tl.constexpr,
    CAP: tl.constexpr = 0.0,
    HAS_SINKS: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    q_len = tl.load(Extend_lens + b).to(tl.int32)
    m0 = mblk * BLOCK_M
    if m0 < q_len:
        prefix_len = tl.load(Prefix_lens + b).to(tl.int32)
        q_start = tl.load(Extend_start + b).to(tl.int64)
        row = tl.load(Req_pool_indices + b).to(tl.int64)
        kv_head = h // GROUP

        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < q_len
        offs_d = tl.arange(0, BLOCK_D)
        if BLOCK_D == HEAD_DIM:
            mask_d = tl.full([BLOCK_D], 1, dtype=tl.int1)  # constant: keeps loads vectorized
        else:
            mask_d = offs_d < HEAD_DIM
        offs_nb = tl.arange(0, BLOCK_N)
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        r2t_row = Req_to_token + row * stride_r2t
        kb_head = K_Buf + kv_head * stride_kbh + offs_d[None, :]
        vb_head = V_Buf + kv_head * stride_vbh + offs_d[None, :]

        # 1. the cached prefix, read through req_to_token: full blocks, then the ragged tail
        full_end = (prefix_len // BLOCK_N) * BLOCK_N
        if SLIDING:  # from the block holding the first key this program's first query sees, all masked
            lo = (tl.maximum(first_visible(prefix_len + m0, window), 0) // BLOCK_N) * BLOCK_N
            for n0 in range(lo, prefix_len, BLOCK_N):
                offs_n = n0 + offs_nb
                mask_n = offs_n < prefix_len
                loc = tl.load(r2t_row + offs_n, mask=mask_n, other=0).to(tl.int64)
                mask_kv = mask_n[:, None] & mask_d[None, :]
                k = tl.load(kb_head + loc[:, None] * stride_kbt, mask=mask_kv, other=0.0)
                v = tl.load(vb_head + loc[:, None] * stride_vbt, mask=mask_kv, other=0.0)
                if KV_FP8:
                    v = (v.to(tl.float32) * v_scale).to(q.dtype)
                visible = mask_n[None, :] & (offs_n[None, :] >= first_visible(prefix_len + offs_m, window)[:, None])
                m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, prefix_scale_log2, DOT_FP32, True,
                                              True, CAP)
            full_end = 0  # nothing left for the unmasked loops below
        for n0 in range(0, full_end, BLOCK_N):
            loc = tl.load(r2t_row + n0 + offs_nb).to(tl.int64)
            k = tl.load(kb_head + loc[:, None] * stride_kbt, mask=mask_d[None, :], other=0.0)
            v = tl.load(vb_head + loc[:, None] * stride_vbt, mask=mask_d[None, :], other=0.0)
            if KV_FP8:
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            m_i, l_i, acc = _softmax_step(q, k, v, None, m_i, l_i, acc, prefix_scale_log2, DOT_FP32, False,
                                          CAP=CAP)
        if not SLIDING and full_end < prefix_len:
            offs_n = full_end + offs_nb
            mask_n = offs_n < prefix_len
            loc = tl.load(r2t_row + offs_n, mask=mask_n, other=0).to(tl.int64)
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(kb_head + loc[:, None] * stride_kbt, mask=mask_kv, other=0.0)
            v = tl.load(vb_head + loc[:, None] * stride_vbt, mask=mask_kv, other=0.0)
            if KV_FP8:
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            m_i, l_i, acc = _softmax_step(q, k, v, mask_n[None, :], m_i, l_i, acc, prefix_scale_log2, DOT_FP32,
                                          True, CAP=CAP)

        # 2. the new tokens (from the k/v inputs), causally: key j is visible to query i when j <= i.
        # Blocks wholly before this query block (BLOCK_M is a multiple of BLOCK_N) need no mask.
        ke_head = K_Ext + q_start * stride_kt + kv_head * stride_kh + offs_d[None, :]
        ve_head = V_Ext + q_start * stride_vt + kv_head * stride_vh + offs_d[None, :]
        unmasked_end = m0
        if SLIDING:
            unmasked_end = 0
        for n0 in range(0, unmasked_end, BLOCK_N):
            offs_n = n0 + offs_nb
            k = tl.load(ke_head + offs_n[:, None] * stride_kt, mask=mask_d[None, :], other=0.0)
            v = tl.load(ve_head + offs_n[:, None] * stride_vt, mask=mask_d[None, :], other=0.0)
            m_i, l_i, acc = _softmax_step(q, k, v, None, m_i, l_i, acc, sm_scale_log2, DOT_FP32, False, CAP=CAP)
        end_new = tl.minimum(m0 + BLOCK_M, q_len)
        masked_start = m0
        if SLIDING:
            masked_start = (tl.maximum(first_visible(prefix_len + m0, window) - prefix_len, 0) // BLOCK_N) * BLOCK_N
        for n0 in range(masked_start, end_new, BLOCK_N):
            offs_n = n0 + offs_nb
            mask_n = offs_n < q_len
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(ke_head + offs_n[:, None] * stride_kt, mask=mask_kv, other=0.0)
            v = tl.load(ve_head + offs_n[:, None] * stride_vt, mask=mask_kv, other=0.0)
            visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
            if SLIDING:
                first = first_visible(prefix_len + offs_m, window) - prefix_len  # in new-token indices
                visible = visible & (offs_n[None, :] >= first[:, None])
            m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, sm_scale_log2, DOT_FP32, True, SLIDING,
                                          CAP)

        if HAS_SINKS:  # the head's sink logit joins each query's softmax sum (its column is dropped)
            l_i += sink_weight(tl.load(Sinks + h), m_i)
        out = acc / l_i[:, None]
        tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _interpreted() -> bool:
    return not isinstance(_extend_kernel, triton.runtime.JITFunction)


def _default_blocks(head_dim: int, interp: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), picked from sweeps on an H200 (bf16; benchmarks/)."""
    if interp:
        return 32, 32, 4, 1
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128:
        return 64, 64, 4, 3
    return 64, 32, 4, 2


def extend_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attention_chunk: int = -1,
) -> None:
    """Writes `o` in place. q, o: [T, H, D]; k, v: [T, Hkv, D] (the new tokens, in q's order); k_buffer, v_buffer:
    [slots, Hkv, D] (an fp8 pool holds k / k_scale, v / v_scale); req_to_token [rows, max_ctx] int32; the
    per-request tensors [bs] on the device; max_extend_len >= max(extend_seq_lens) sizes the grid (a host int, so
    no device sync). sliding_window > 0: a query sees only the keys up to that many positions back, itself
    included. logit_cap > 0: the scaled scores are soft-capped, logit_cap * tanh(s / logit_cap). sinks: float32
    [H] per-head sink logits (GPT-OSS) that join every query's softmax (`check_sinks`), or None. attention_chunk > 0
    (Llama 4): a query at position p sees only the keys of its own chunk, from (p // chunk) * chunk."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k_buffer.dim() != 3 or v_buffer.dim() != 3:
        raise ValueError("q/o [T, H, D], k/v [T, Hkv, D] and k/v buffers [slots, Hkv, D] expected")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if k_buffer.shape[1:] != k.shape[1:] or v_buffer.shape[1:] != k.shape[1:]:
        raise ValueError(f"KV buffers {tuple(k_buffer.shape)} / {tuple(v_buffer.shape)} do not match k "
                         f"{tuple(k.shape)}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if o.shape != q.shape:
        raise ValueError(f"output shape {tuple(o.shape)} != q shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dimension")
    if max_extend_len < 0:
        raise ValueError(f"max_extend_len must be >= 0; got {max_extend_len}")
    window = kernel_window(sliding_window, attention_chunk)
    check_sinks(sinks, num_heads, q.device)
    bs = extend_seq_lens.shape[0]
    if num_tokens == 0 or bs == 0 or max_extend_len == 0:
        return

    interp = _interpreted()
    dm, dn, dw, ds = _default_blocks(head_dim, interp)
    block_m = block_m or dm
    block_n = block_n or dn
    num_warps = num_warps or dw
    num_stages = num_stages or ds
    if block_m % block_n != 0:
        raise ValueError(f"block_m ({block_m}) must be a multiple of block_n ({block_n})")
    block_d = max(16, triton.next_power_of_2(head_dim))
    dot_fp32 = interp or q.dtype == torch.float32
    kv_fp8 = k_buffer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    launch(_extend_kernel, grid,
        q, k, v, o, k_buffer, v_buffer,
        req_to_token, req_pool_indices, extend_prefix_lens, extend_seq_lens, extend_start_loc,
        o if sinks is None else sinks,  # (a stand-in pointer that the kernel does not touch)
        sm_scale * LOG2E, sm_scale * LOG2E * (k_scale if kv_fp8 else 1.0), v_scale, window,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_FP32=dot_fp32, KV_FP8=kv_fp8, SLIDING=window != 0, CAP=max(logit_cap, 0.0) * LOG2E,
        HAS_SINKS=sinks is not None, num_warps=num_warps, num_stages=num_stages,
    )
