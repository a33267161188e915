"""Triton helpers shared by the extend and decode attention kernels (and double sparsity's decode)."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels use exp2: scores are scaled by sm_scale * log2(e)


@triton.jit
def mma(a, b, FP32: tl.constexpr):
    """a @ b with float32 accumulation; FP32 runs it on float32 operands at full (IEEE) precision."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b.to(a.dtype))


@triton.jit
def window_start(seq_len, window):
    """The first KV position the last query of a seq_len-token sequence sees: seq_len - window under a sliding
    window (window > 0), else 0."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def decode_splits(seq_len, window, num_kv_splits, min_split_len, BLOCK_N: tl.constexpr):
    """How a decode request's visible KV [kv_start, seq_len) is cut into splits: (kv_start, chunk, n_valid). Each
    split is `chunk` tokens (a multiple of BLOCK_N) and at most min(num_kv_splits, cdiv(len, min_split_len)) of
    them are non-empty. Stage 1 and stage 2 both call this, so they agree on the boundaries without storing them."""
    kv_start = window_start(seq_len, window)
    kv_len = seq_len - kv_start
    n_splits = tl.minimum(tl.maximum(tl.cdiv(kv_len, min_split_len), 1), num_kv_splits)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_len, n_splits), BLOCK_N) * BLOCK_N, 1)
    n_valid = tl.where(kv_len > 0, tl.cdiv(kv_len, chunk), 0)
    return kv_start, chunk, n_valid


@triton.jit
def head_dims(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(offs_d, mask_d) of a head_dim row padded to BLOCK_D; an unpadded row's mask is a constant, which keeps the
    loads vectorized."""
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        mask_d = tl.full([BLOCK_D], 1, dtype=tl.int1)
    else:
        mask_d = offs_d < HEAD_DIM
    return offs_d, mask_d


@triton.jit
def decode_head_block(pid_h, GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr):
    """A decode program's query heads: (kv_head, heads, mask_h) for program pid_h of the grid's head axis, which has
    HEAD_BLOCKS programs per KV head, each BLOCK_H of the GROUP query heads sharing it."""
    kv_head = pid_h // HEAD_BLOCKS
    offs_g = (pid_h % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    return kv_head, kv_head * GROUP + offs_g, offs_g < GROUP


@triton.jit
def store_decode_partial(Mid_O, Mid_LSE, b, heads, split, offs_d, mask_h, mask_d, acc, m_i, l_i, v_scale,
                         stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh):
    """Stage 1's output for one split: the partial output divided by its softmax sum (times v's scale) and the
    base-2 log-sum-exp of its scores. A split whose positions were all masked (l_i = 0) writes zeros and a
    log-sum-exp so low that the merge gives it no weight (finite: the merge's running maximum must not start at
    -inf)."""
    live = l_i > 0
    safe_l = tl.where(live, l_i, 1.0)
    out_ptrs = (Mid_O + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + split * stride_mos
                + offs_d[None, :])
    tl.store(out_ptrs, acc * (v_scale / safe_l[:, None]), mask=mask_h[:, None] & mask_d[None, :])
    tl.store(Mid_LSE + b.to(tl.int64) * stride_mlb + heads * stride_mlh + split,
             tl.where(live, m_i + tl.log2(safe_l), -1.0e30), mask=mask_h)
