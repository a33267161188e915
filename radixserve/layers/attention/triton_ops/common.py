"""Triton helpers shared by the extend and decode attention kernels."""

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
