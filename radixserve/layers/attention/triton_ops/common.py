"""Triton helpers shared by the extend and decode attention kernels (and double sparsity's decode)."""

from __future__ import annotations

import torch
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
def soft_cap(x, CAP: tl.constexpr):
    """CAP * tanh(x / CAP) (Gemma 2's score capping; x and CAP both in the kernels' log2 e units), as
    CAP * (1 - 2 / (exp(2x / CAP) + 1)): +-CAP, never NaN, for any finite or infinite x."""
    return CAP * (1.0 - 2.0 / (tl.exp(2.0 * x / CAP) + 1.0))


@triton.jit
def sink_weight(sink, m_i):
    """What an attention sink (GPT-OSS: one logit a query head, in natural-log units, as loaded) adds to a softmax
    sum kept against the running maximum m_i (base-2 units, as the kernels' scores): exp2(sink * log2 e - m_i), 0
    for a row that saw no key (m_i = -inf: its output stays zeros)."""
    return tl.where(m_i == float("-inf"), 0.0, tl.exp2(sink.to(tl.float32) * 1.4426950408889634 - m_i))


@triton.jit
def online_softmax_step(qk, v, visible, m_i, l_i, acc, DOT_FP32: tl.constexpr, MASKED: tl.constexpr,
                        ROWS_MAY_BE_EMPTY: tl.constexpr = False):
    """One KV block of the online softmax over scores qk [BLOCK_M, BLOCK_N] (already times the scale and log2 e):
    the running max m_i, sum l_i and output acc updated with p·v. `visible` is only read when MASKED.
    ROWS_MAY_BE_EMPTY: a row may see no key of this block before it has seen any (sliding window); its running max
    is then still -inf, and the exponentials are taken against 0 instead (so they give 0, not NaN)."""
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_ref = m_new
    if ROWS_MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_FP32)
    return m_new, l_i, acc


def kernel_window(sliding_window: int, attention_chunk: int) -> int:
    """The kernels' `window` argument: W for a sliding window of W tokens, -C for chunks of C, 0 for neither."""
    if sliding_window == 0 or sliding_window < -1:
        raise ValueError(f"sliding_window must be -1 (none) or positive; got {sliding_window}")
    if attention_chunk == 0 or attention_chunk < -1:
        raise ValueError(f"attention_chunk must be -1 (none) or positive; got {attention_chunk}")
    if sliding_window > 0 and attention_chunk > 0:
        raise ValueError("a sliding window and an attention chunk cannot both be set")
    return sliding_window if sliding_window > 0 else -attention_chunk if attention_chunk > 0 else 0


@triton.jit
def first_visible(pos, window):
    """The first key position a query at `pos` sees: pos - window + 1 under a sliding window (window > 0; may be
    negative), the start of its chunk (pos // C) * C under chunked attention (window = -C < 0), else 0
    (`base_attn_backend.local_window` / `first_key` on the host)."""
    c = tl.maximum(-window, 1)
    return tl.where(window > 0, pos - window + 1, tl.where(window < 0, pos // c * c, 0))


@triton.jit
def window_start(seq_len, window):
    """The first KV position the last query of a seq_len-token sequence sees: seq_len - window under a sliding
    window (window > 0), its chunk's first under chunked attention (window < 0), else 0."""
    return tl.maximum(first_visible(seq_len - 1, window), 0)


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


@triton.jit
def last_partial_done(Counter, n_valid):
    """After a decode program has stored its partial (`store_decode_partial`): count it on its (request, head
    block)'s int32 counter, and return whether it was the last of the n_valid non-empty splits, the program that
    then merges them (`merge_decode_partials`) and puts the counter back to 0.

    The barrier makes every thread's part of the partial precede the atomic, which thread 0 alone runs (the
    counter is a scalar) at GPU scope: its release publishes the whole program's stores, and in the last program
    its acquire (broadcast to the other threads through shared memory behind a barrier) orders the merge's loads
    after every other program's stores."""
    tl.debug_barrier()
    return tl.atomic_add(Counter, 1, sem="acq_rel", scope="gpu") == n_valid - 1


@triton.jit
def merge_decode_partials(Mid_O, Mid_LSE, Out, b, head0, n_heads, n_valid,
                          stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                          HEADS: tl.constexpr, SPLIT_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, Sinks, HAS_SINKS: tl.constexpr):
    """Stage 2's merge of request b's first n_valid splits for heads head0 .. head0 + n_heads - 1 (n_heads <=
    HEADS), stored into Out: each partial weighted by exp2(lse - the head's largest lse), the sum divided by the sum
    of the weights; zeros for n_valid 0.

    Run by the last program of the request's head block (`last_partial_done`), so the heads' whole merge is one
    program's work: SPLIT_BLOCK splits a step, loaded together ([HEADS, SPLIT_BLOCK, BLOCK_D]), with the largest
    lse found first so that the steps depend on each other only through their sums (one split a step, stage 2's
    running maximum, waited a round trip to L2 per split). The other programs wrote the partials while this
    kernel runs: the loads go to L2 (`.cg`), past this SM's L1, which is not kept coherent with other SMs' stores.
    HAS_SINKS: the heads' sink logits (Sinks [heads]) join the sum of the weights (`sink_weight`)."""
    offs_h = tl.arange(0, HEADS)
    mask_h = offs_h < n_heads
    heads = head0 + offs_h
    offs_d, mask_d = head_dims(HEAD_DIM, BLOCK_D)
    lse_ptrs = Mid_LSE + b.to(tl.int64) * stride_mlb + heads[:, None] * stride_mlh  # [HEADS, 1]
    m = tl.full([HEADS], -1.0e30, dtype=tl.float32)  # (finite: padding heads must not make -inf - -inf)
    offs_m = tl.arange(0, 64)
    for s0 in range(0, n_valid, 64):
        ok = mask_h[:, None] & (s0 + offs_m[None, :] < n_valid)
        lse = tl.load(lse_ptrs + s0 + offs_m[None, :], mask=ok, other=-1.0e30, cache_modifier=".cg")
        m = tl.maximum(m, tl.max(lse, axis=1))
    acc = tl.zeros([HEADS, BLOCK_D], dtype=tl.float32)
    denom = tl.zeros([HEADS], dtype=tl.float32)
    if SPLIT_BLOCK == 1:  # 2-D (Triton 3.6 fails to compile the sum over a [HEADS, 1, BLOCK_D] tile's middle axis)
        o_ptrs = Mid_O + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + offs_d[None, :]
        for s in range(0, n_valid):
            lse = tl.load(lse_ptrs + s, mask=mask_h[:, None], other=-1.0e30, cache_modifier=".cg")  # [HEADS, 1]
            w = tl.where(mask_h[:, None], tl.exp2(lse - m[:, None]), 0.0)
            parts = tl.load(o_ptrs + s * stride_mos, mask=mask_h[:, None] & mask_d[None, :], other=0.0,
                            cache_modifier=".cg")
            acc += w * parts
            denom += tl.sum(w, axis=1)
    else:
        offs_s = tl.arange(0, SPLIT_BLOCK)
        o_ptrs = (Mid_O + b.to(tl.int64) * stride_mob + heads[:, None, None] * stride_moh
                  + offs_s[None, :, None] * stride_mos + offs_d[None, None, :])
        for s0 in range(0, n_valid, SPLIT_BLOCK):
            ok = mask_h[:, None] & (s0 + offs_s[None, :] < n_valid)  # [HEADS, SPLIT_BLOCK]
            lse = tl.load(lse_ptrs + s0 + offs_s[None, :], mask=ok, other=-1.0e30, cache_modifier=".cg")
            w = tl.where(ok, tl.exp2(lse - m[:, None]), 0.0)
            parts = tl.load(o_ptrs + s0 * stride_mos, mask=ok[:, :, None] & mask_d[None, None, :], other=0.0,
                            cache_modifier=".cg")
            acc += tl.sum(w[:, :, None] * parts, axis=1)
            denom += tl.sum(w, axis=1)
    if HAS_SINKS:
        denom += sink_weight(tl.load(Sinks + heads, mask=mask_h, other=0.0), m)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


@triton.jit
def merge_if_last(Counter, Mid_O, Mid_LSE, Out, b, head0, n_heads, n_valid,
                  stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                  HEADS: tl.constexpr, SPLIT_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  Sinks, HAS_SINKS: tl.constexpr):
    """Stage 1's end in one-launch mode, after the program stored its partial: the last of the request's n_valid
    programs for these heads (`last_partial_done`) merges them into Out (`merge_decode_partials`) and puts the
    counter back to 0, ready for the next launch (CUDA graphs replay the same counters, with no memset)."""
    if last_partial_done(Counter, n_valid):
        merge_decode_partials(Mid_O, Mid_LSE, Out, b, head0, n_heads, n_valid, stride_mob, stride_moh, stride_mos,
                              stride_mlb, stride_mlh, stride_ob, stride_oh, HEADS, SPLIT_BLOCK, HEAD_DIM, BLOCK_D,
                              Sinks, HAS_SINKS)
        tl.atomic_xchg(Counter, 0, sem="relaxed")


def merge_split_block(heads: int, block_d: int) -> int:
    """Splits a step of `merge_decode_partials` for `heads` heads of block_d: a [heads, splits, block_d] float32
    tile of at most 4,096 values (32 registers a thread at 4 warps), 1 to 16 splits."""
    return max(1, min(16, 4096 // (heads * block_d)))


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """ValueError unless `sinks` is None or a contiguous float32 [num_heads] tensor on `device`."""
    if sinks is None:
        return
    if sinks.dtype != torch.float32 or sinks.shape != (num_heads,) or not sinks.is_contiguous() \
            or sinks.device != device:
        raise ValueError(f"sinks must be a contiguous float32 [{num_heads}] tensor on {device}; got {sinks.dtype} "
                         f"{tuple(sinks.shape)} on {sinks.device}")
