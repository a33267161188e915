"""Multi-head latent attention kernels over the latent pool (one KV "head" per token: the latent c of C values and
the rotated key part of R values).

After weight absorption each query head is [q_c (C), q_r (R)]; its score against token j is q_c·c_j + q_r·r_j and
its output sum_j p_j c_j. So one KV tile [BLOCK_N, C] is loaded once per block of query heads and used twice: as
keys and as values. C (512 for DeepSeek) and R (64) are kept apart so that neither is padded to a power of two
with the other.

- Decode: split-KV like `decode_attention.py` (stage 1 here, one program per request × block of heads × split; the
  merge is that file's stage 2, with the latent as the head dim). With one split a request (large batches) stage 1
  writes the output itself and stage 2 is not launched; with several and `counters`, the last program of each
  request's head block merges them in stage 1's launch, as there (`merge_decode_partials`), though at DeepSeek's
  shape that one program's merge of 16 heads x 512 took 2-3x stage 2's time on an H200, so the backend leaves MLA
  to stage 2 by default (`ONE_LAUNCH` in decode_attention.py). The grid depends on the batch size only, so it
  captures in a CUDA graph.
- Extend: one program per (request, head, BLOCK_M new tokens); keys are the request's cached prefix and its new
  tokens, all read from the pool (the backend stores the new latents first), the new ones causally.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.common import (
    decode_splits,
    merge_if_last,
    merge_split_block,
    store_decode_partial,
)
from radixserve.layers.attention.triton_ops.decode_attention import (
    _decode_stage2_kernel,
    check_decode_counters,
    is_interpreted,
)
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

_LOG2E = 1.4426950408889634


def _decode_config() -> tuple[int, int, int]:
    """Stage 1's tokens per loop step, warps and pipeline stages on a GPU; RADIXSERVE_MLA_DECODE_CFG="N,WARPS,STAGES"
    overrides them. 64 tokens, 4 warps, 2 stages won `benchmarks/bench_mla_decode.py` on an H200 at every batch
    from 1 to 512 (DeepSeek-V2-Lite's shape; docs/perf-log.md)."""
    raw = os.environ.get("RADIXSERVE_MLA_DECODE_CFG", "64,4,2")
    try:
        block_n, warps, stages = (int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"RADIXSERVE_MLA_DECODE_CFG must be 'BLOCK_N,WARPS,STAGES', got {raw!r}") from None
    if block_n < 16 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise ValueError(f"RADIXSERVE_MLA_DECODE_CFG {raw!r}: BLOCK_N a power of two >= 16, warps 1-16, stages >= 1")
    return block_n, warps, stages


DECODE_BLOCK_N, DECODE_WARPS, DECODE_STAGES = _decode_config()
# Split a batch's requests until stage 1 has this many programs per SM (`kv_split_cap`); each MLA program holds all
# 16 heads of a DeepSeek layer and the whole latent, so one a SM is enough (the MHA kernel aims for 8): on an H200
# with the tile above, batch 128 x 1,024 tokens in 2 splits a request takes 56.7 us against 74.4 in the 9 that 8
# programs a SM gave, and batch 512 x 1,300 in one split (the output written without stage 2) 212 against 256.
# RADIXSERVE_MLA_PROGRAMS_PER_SM overrides it.
PROGRAMS_PER_SM = int(os.environ.get("RADIXSERVE_MLA_PROGRAMS_PER_SM", "1"))
if PROGRAMS_PER_SM < 1:
    raise ValueError(f"RADIXSERVE_MLA_PROGRAMS_PER_SM must be positive, got {PROGRAMS_PER_SM}")


@triton.jit
def _mma(a, b, FP32: tl.constexpr):
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b.to(a.dtype))


@triton.jit(do_not_specialize=["num_kv_splits", "min_split_len"])
def _mla_decode_stage1_kernel(
    Q, KV_Buf, Req_to_token, Req_pool_indices, Seq_lens, Mid_O, Mid_LSE, Out, Counters,
    sm_scale_log2, num_kv_splits, min_split_len, num_heads,
    stride_qb, stride_qh, stride_kvt, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, stride_cb,
    C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, DIRECT: tl.constexpr = False,
    MERGE: tl.constexpr = False,
    MERGE_SPLITS: tl.constexpr = 1,
    PDL: tl.constexpr = 0,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    pid_h = tl.program_id(1)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    mask_h = heads < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_c = offs_c < C
    mask_r = offs_r < R

    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    _, chunk, n_valid = decode_splits(seq_len, 0, num_kv_splits, min_split_len, BLOCK_N)  # stage 2's splits
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    out_ptrs = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
    mask_o = mask_h[:, None] & mask_c[None, :]
    if start < end:
        row = tl.load(Req_pool_indices + b).to(tl.int64)
        q_base = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
        q_c = tl.load(q_base + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
        q_r = tl.load(q_base + C + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            loc = tl.load(Req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_base = KV_Buf + loc[:, None] * stride_kvt
            kc = tl.load(kv_base + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0)
            kr = tl.load(kv_base + C + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
            qk = _mma(q_c, tl.trans(kc), DOT_FP32) + _mma(q_r, tl.trans(kr), DOT_FP32)
            qk = tl.where(mask_n[None, :], qk * sm_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _mma(p.to(q_c.dtype), kc, DOT_FP32)
            m_i = m_new
        if DIRECT:  # one split: the program's result is the output
            tl.store(out_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=mask_o)
        elif MERGE:
            if n_valid == 1:  # the request's one non-empty split: its result is the output, as with DIRECT
                tl.store(out_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=mask_o)
            else:  # the last of the request's programs for these heads merges the partials (stage 2's work)
                store_decode_partial(Mid_O, Mid_LSE, b, heads, split, offs_c, mask_h, mask_c, acc, m_i, l_i, 1.0,
                                     stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh)
                merge_if_last(Counters + b.to(tl.int64) * stride_cb + pid_h, Mid_O, Mid_LSE, Out, b,
                              pid_h * BLOCK_H, num_heads - pid_h * BLOCK_H, n_valid, stride_mob, stride_moh,
                              stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, BLOCK_H, MERGE_SPLITS, C,
                              BLOCK_C, Mid_LSE, False)  # (no sinks: Mid_LSE a stand-in pointer)
        else:
            store_decode_partial(Mid_O, Mid_LSE, b, heads, split, offs_c, mask_h, mask_c, acc, m_i, l_i, 1.0,
                                 stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh)
    elif DIRECT or MERGE:
        if split == 0:  # an empty request attends to nothing: zeros, as stage 2 writes them
            tl.store(out_ptrs, tl.zeros([BLOCK_H, BLOCK_C], dtype=Out.dtype.element_ty), mask=mask_o)


def mla_decode_fwd(q: torch.Tensor, kv_buffer: torch.Tensor, o: torch.Tensor, req_to_token: torch.Tensor,
                   req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, mid_o: torch.Tensor,
                   mid_lse: torch.Tensor, sm_scale: float, kv_lora_rank: int, num_kv_splits: int,
                   min_split_len: int = 64, block_n: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, counters: torch.Tensor | None = None) -> None:
    """q [bs, H, C + R]; kv_buffer [slots, 1, C + R]; o [bs, H, C]; mid_o [bs, H, S, C] and mid_lse [bs, H, S]
    float32 scratch (S >= num_kv_splits, contiguous; not touched with one split). Writes o in place. block_n /
    num_warps / num_stages default to DECODE_BLOCK_N / _WARPS / _STAGES on a GPU. counters (int32 [>= bs, >= H], all
    zero: `new_decode_counters`; left zero again) merge several splits in stage 1's launch, without stage 2."""
    bs, num_heads, dim = q.shape
    c = kv_lora_rank
    r = dim - c
    if kv_buffer.dim() != 3 or kv_buffer.shape[1:] != (1, dim) or o.shape != (bs, num_heads, c):
        raise ValueError(f"MLA decode: q {tuple(q.shape)}, kv {tuple(kv_buffer.shape)}, o {tuple(o.shape)} "
                         f"do not fit a latent of {c}")
    if num_kv_splits < 1:
        raise ValueError(f"MLA decode: num_kv_splits must be positive, got {num_kv_splits}")
    if num_kv_splits > 1 and (tuple(mid_o.shape[:2]) != (bs, num_heads) or mid_o.shape[3] != c
                              or mid_lse.shape[2] < num_kv_splits):
        raise ValueError(f"MLA decode scratch {tuple(mid_o.shape)} / {tuple(mid_lse.shape)} too small")
    if counters is not None:
        check_decode_counters(counters, bs, num_heads)
    if bs == 0:
        return
    interp = is_interpreted()
    block_n = block_n or (16 if interp else DECODE_BLOCK_N)
    block_h = 16
    dot_fp32 = interp or q.dtype == torch.float32
    direct = num_kv_splits == 1  # stage 1 writes o; no stage 2
    merge = not direct and counters is not None  # stage 1's last program of each head block merges; no stage 2
    launch(_mla_decode_stage1_kernel, (bs, triton.cdiv(num_heads, block_h), num_kv_splits),
           q, kv_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, o,
           counters if merge else mid_lse,  # (a stand-in pointer that the kernel does not touch)
           sm_scale * _LOG2E, num_kv_splits, min_split_len, num_heads,
           q.stride(0), q.stride(1), kv_buffer.stride(0), req_to_token.stride(0),
           mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
           o.stride(0), o.stride(1), counters.stride(0) if merge else 0,
           C=c, R=r, BLOCK_C=triton.next_power_of_2(c), BLOCK_R=max(16, triton.next_power_of_2(r)),
           BLOCK_H=block_h, BLOCK_N=block_n, DOT_FP32=dot_fp32, DIRECT=direct, MERGE=merge,
           MERGE_SPLITS=merge_split_block(block_h, triton.next_power_of_2(c)),
           **({} if interp else dict(num_warps=num_warps or DECODE_WARPS, num_stages=num_stages or DECODE_STAGES,
                                     **pdl.launch_opts(q))))
    if direct or merge:
        return
    block_c = triton.next_power_of_2(c)
    launch(_decode_stage2_kernel, (bs, num_heads),
           mid_o, mid_lse, o, seq_lens, mid_lse, num_kv_splits, min_split_len, 0, 0, 0,  # no sinks, no window
           mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
           o.stride(0), o.stride(1),
           HEAD_DIM=c, BLOCK_D=block_c, BLOCK_N=block_n, SPLIT_BLOCK=1,
           **({} if interp else dict(num_warps=4, num_stages=1, **pdl.launch_opts(q))))


@triton.jit
def _mla_extend_kernel(
    Q, KV_Buf, Out, Req_to_token, Req_pool_indices, Prefix_lens, Extend_lens, Extend_start,
    sm_scale_log2, stride_qt, stride_qh, stride_kvt, stride_ot, stride_oh, stride_r2t,
    C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    ext_len = tl.load(Extend_lens + b).to(tl.int32)
    if mblk * BLOCK_M >= ext_len:
        return
    prefix = tl.load(Prefix_lens + b).to(tl.int32)
    first = tl.load(Extend_start + b).to(tl.int64)
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_c = offs_c < C
    mask_r = offs_r < R
    q_base = Q + (first + offs_m[:, None]) * stride_qt + h * stride_qh
    q_c = tl.load(q_base + offs_c[None, :], mask=mask_m[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_base + C + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    q_pos = prefix + offs_m  # absolute positions of this block's queries
    kv_end = tl.minimum(prefix + (mblk + 1) * BLOCK_M, prefix + ext_len)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        loc = tl.load(Req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_base = KV_Buf + loc[:, None] * stride_kvt
        kc = tl.load(kv_base + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0)
        kr = tl.load(kv_base + C + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        qk = (_mma(q_c, tl.trans(kc), DOT_FP32) + _mma(q_r, tl.trans(kr), DOT_FP32)) * sm_scale_log2
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _mma(p.to(q_c.dtype), kc, DOT_FP32)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (first + offs_m[:, None]) * stride_ot + h * stride_oh + offs_c[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


def mla_extend_fwd(q: torch.Tensor, kv_buffer: torch.Tensor, o: torch.Tensor, req_to_token: torch.Tensor,
                   req_pool_indices: torch.Tensor, extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                   extend_start_loc: torch.Tensor, max_extend_len: int, sm_scale: float, kv_lora_rank: int) -> None:
    """q [T, H, C + R] (new tokens); kv_buffer [slots, 1, C + R] already holding the new tokens' latents;
    o [T, H, C]. Each request's keys: req_to_token[row, :prefix + extend_len], the new ones causal."""
    num_tokens, num_heads, dim = q.shape
    c = kv_lora_rank
    if kv_buffer.shape[1:] != (1, dim) or o.shape != (num_tokens, num_heads, c):
        raise ValueError(f"MLA extend: q {tuple(q.shape)}, kv {tuple(kv_buffer.shape)}, o {tuple(o.shape)} "
                         f"do not fit a latent of {c}")
    bs = extend_seq_lens.shape[0]
    if num_tokens == 0 or bs == 0 or max_extend_len == 0:
        return
    interp = is_interpreted()
    block_m, block_n = (16, 16) if interp else (32, 32)
    dot_fp32 = interp or q.dtype == torch.float32
    launch(_mla_extend_kernel, (bs, num_heads, triton.cdiv(max_extend_len, block_m)),
           q, kv_buffer, o, req_to_token, req_pool_indices, extend_prefix_lens, extend_seq_lens, extend_start_loc,
           sm_scale * _LOG2E, q.stride(0), q.stride(1), kv_buffer.stride(0), o.stride(0), o.stride(1),
           req_to_token.stride(0),
           C=c, R=dim - c, BLOCK_C=triton.next_power_of_2(c), BLOCK_R=max(16, triton.next_power_of_2(dim - c)),
           BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP32=dot_fp32,
           **({} if interp else dict(num_warps=8, num_stages=2)))
