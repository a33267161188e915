"""Split-KV ("flash decoding") attention for one new token per request, reading the KV cache through req_to_token.

Stage 1 launches one program per (block of query heads that share a KV head, request, KV split). Each program walks
its chunk of the request's KV slots, keeps an online softmax, and writes a partial output (already divided by its
own softmax sum) plus the base-2 log-sum-exp of its scores. Stage 2 launches one program per (request, query head)
and merges the partials of the non-empty splits. When the batch is large enough that each request gets one split
(`kv_split_cap` gives 1), stage 1 writes the output itself and stage 2 is not launched. Given `counters` (one int32
a request and head block, all zero), a launch of several splits merges in stage 1 too: each program that stored a
partial counts it with one atomic, and the program of its request's non-empty splits that counts last merges them
all (stage 2's sums, in another order), then puts the counter back to 0 (`last_partial_done`,
`merge_decode_partials`); stage 2 is not launched. The backend passes counters where that measured faster
(`ONE_LAUNCH`).

An fp8 pool (k / k_scale, v / v_scale) costs nothing extra: k's scale is folded into the score scale, v's into the
partial output; its tiles are widened to fp16 (one conversion instruction per two values, where bf16 needs a second
one), and q and the softmax weights go to fp16 for those products (more mantissa than bf16; |q| and k / k_scale are
far inside fp16's range). Its V tile reaches the tensor cores through one-byte shared-memory loads (the product sums
over tokens and sm_90 has no transposing matrix load for 8-bit types); `fp8_v_pairs` reads V as 32-bit words
instead and widens (even, odd) token pairs in registers (`_fp8_pairs`), the default where the shapes allow it.

The grid depends only on the batch size (its split axis is `num_kv_splits`, which the caller picks from the batch
size alone), so both launches can be captured in a CUDA graph (and the counters need no reset: every launch leaves
them zero). How many splits a request really uses is decided inside the kernels from its seq_len:
`min(num_kv_splits, cdiv(seq_len, min_split_len))`, each split a multiple of BLOCK_N tokens; programs whose split is
empty do nothing (nor count), and stage 2 or the merging program recomputes the same split boundaries, so no split
count is ever stored. Under a sliding window of W tokens the splits cover only the last W positions. Attention sinks
(HAS_SINKS, GPT-OSS: a logit per query head) join the softmax sum once, wherever the output is normalised: stage 1
with one split, the merging program, or stage 2 (the partials stay sink-free).

Query heads of one KV head (GQA) are processed together: the K/V tile is loaded once for the group, and the scores
come from `tl.dot` with the group padded to at least 16 rows (tensor cores want M >= 16). That holds even for plain
multi-head attention (a group of one): decode is bound by reading the KV cache, and the padded dot was twice as fast
as an elementwise product on an H200. The elementwise path remains as an option for groups of one.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.common import (
    LOG2E,
    check_sinks,
    decode_head_block,
    decode_splits,
    head_dims,
    kernel_window,
    merge_if_last,
    merge_split_block,
    mma,
    sink_weight,
    soft_cap,
    store_decode_partial,
)
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

# a = [e0, o0, e1, o1] and b = [e2, o2, e3, o3] (bytes of the even and odd words); each half widens to an fp16 pair
_PAIRS_PTX = """{
.reg .b32 a, b;
.reg .b16 a0, a1, b0, b1;
prmt.b32 a, $4, $5, 0x5140;
prmt.b32 b, $4, $5, 0x7362;
mov.b32 {a0, a1}, a;
mov.b32 {b0, b1}, b;
cvt.rn.f16x2.FMTx2 $0, a0;
cvt.rn.f16x2.FMTx2 $1, a1;
cvt.rn.f16x2.FMTx2 $2, b0;
cvt.rn.f16x2.FMTx2 $3, b1;
}"""
_PAIRS_E4M3 = tl.constexpr(_PAIRS_PTX.replace("FMT", "e4m3"))
_PAIRS_E5M2 = tl.constexpr(_PAIRS_PTX.replace("FMT", "e5m2"))


@triton.jit
def _fp8_pairs(we, wo, FMT: tl.constexpr, PORTABLE: tl.constexpr):
    """Two tiles of 32-bit words of an fp8 pool, four head dims each (`we` of even tokens, `wo` of the odd ones
    after them), widened to eight tiles: (even, odd) of dims 4w, 4w+1, 4w+2, 4w+3. FMT 1: e4m3, 2: e5m2. On the GPU
    one `prmt` pairs an even and an odd token's bytes of two dims, and one `cvt` widens each pair: the tiles reach
    the products without the one-byte shared-memory loads a transposed fp8 tile takes. PORTABLE (the interpreter,
    float32 products) widens byte by byte."""
    if PORTABLE:
        fp8: tl.constexpr = tl.float8e4nv if FMT == 1 else tl.float8e5
        e0 = (we & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float32)
        o0 = (wo & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float32)
        e1 = ((we >> 8) & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float32)
        o1 = ((wo >> 8) & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float32)
        e2 = ((we >> 16) & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float32)
        o2 = ((wo >> 16) & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float32)
        e3 = ((we >> 24) & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float32)
        o3 = ((wo >> 24) & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float32)
    else:
        asm: tl.constexpr = _PAIRS_E4M3 if FMT == 1 else _PAIRS_E5M2
        x0, x1, x2, x3 = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [we, wo],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        e0 = (x0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        o0 = (x0 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        e1 = (x1 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        o1 = (x1 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        e2 = (x2 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        o2 = (x2 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        e3 = (x3 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        o3 = (x3 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return e0, o0, e1, o1, e2, o2, e3, o3


# The split count and length are plain runtime values (not specialised: a value of 1 or a multiple of 16 would
# otherwise compile its own variant the first time some batch size produced it, in the middle of serving).
@triton.jit(do_not_specialize=["num_kv_splits", "min_split_len", "window"])
def _decode_stage1_kernel(
    Q, K_Buf, V_Buf, Req_to_token, Req_pool_indices, Seq_lens, Mid_O, Mid_LSE, Out, Counters, Sinks,
    sm_scale_log2, v_scale, num_kv_splits, min_split_len, window,
    stride_qb, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_r2t,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    stride_cb,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_F16: tl.constexpr,
    V_PAIRS: tl.constexpr = 0,
    SLIDING: tl.constexpr = False,
    PDL: tl.constexpr = 0,
    HEADS_FIRST: tl.constexpr = False,
    DIRECT: tl.constexpr = False,
    MERGE: tl.constexpr = False,
    MERGE_HEADS: tl.constexpr = 1,
    MERGE_SPLITS: tl.constexpr = 1,
    CAP: tl.constexpr = 0.0,
    HAS_SINKS: tl.constexpr = False,
):
    pdl_prologue(PDL)
    if HEADS_FIRST:  # the grid's fastest axis is the head: one token's heads are read by programs running together
        b = tl.program_id(1)
        pid_h = tl.program_id(0)
    else:
        b = tl.program_id(0)
        pid_h = tl.program_id(1)
    split = tl.program_id(2)
    kv_head, heads, mask_h = decode_head_block(pid_h, GROUP, HEAD_BLOCKS, BLOCK_H)
    offs_d, mask_d = head_dims(HEAD_DIM, BLOCK_D)

    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    if SLIDING:
        kv_start, chunk, n_valid = decode_splits(seq_len, window, num_kv_splits, min_split_len, BLOCK_N)
    else:
        # full attention: the same boundaries as decode_splits, but with kv_start = 0 and no lower bound on chunk
        # known at compile time, every split starts at a multiple of BLOCK_N (the window-aware form made stage 1
        # ~20% slower at batch 64-256 on an H200)
        kv_start = 0
        n_splits = tl.minimum(tl.maximum(tl.cdiv(seq_len, min_split_len), 1), num_kv_splits)
        chunk = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
        # the splits below with start < end (chunk is 0 only for seq_len 0, which has none)
        n_valid = tl.cdiv(seq_len, tl.maximum(chunk, 1))
    start = kv_start + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    out_ptrs = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    mask_o = mask_h[:, None] & mask_d[None, :]

    if start < end:
        row = tl.load(Req_pool_indices + b).to(tl.int64)
        q_ptrs = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        if not USE_DOT:
            q = q.to(tl.float32)
        elif KV_F16:  # fp8 pool: the products in fp16, which fp8 widens to in one instruction (bf16 takes two)
            q = q.to(tl.float16)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        if V_PAIRS:  # an fp8 pool's V as words of four dims, one accumulator per dim modulo 4 (_fp8_pairs)
            acc0 = tl.zeros([BLOCK_H, BLOCK_D // 4], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_H, BLOCK_D // 4], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_H, BLOCK_D // 4], dtype=tl.float32)
            acc3 = tl.zeros([BLOCK_H, BLOCK_D // 4], dtype=tl.float32)
            offs_w = tl.arange(0, BLOCK_D // 4)
            mask_w = offs_w < HEAD_DIM // 4
            offs_pair = tl.arange(0, BLOCK_N // 2)
            v_words = V_Buf.to(tl.pointer_type(tl.int32), bitcast=True)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            loc = tl.load(Req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K_Buf + loc[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                        mask=mask_kv, other=0.0)
            if USE_DOT:
                qk = mma(q, tl.trans(k), DOT_FP32)
            else:  # BLOCK_H == 1: q [1, D] against k [N, D], all in 2-D
                qk = tl.sum(q * k.to(tl.float32), axis=1)[None, :]
            qk = qk * sm_scale_log2
            if CAP > 0:  # Gemma 2's soft-capped scores (in log2 e units, as CAP)
                qk = soft_cap(qk, CAP)
            qk = tl.where(mask_n[None, :], qk, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if V_PAIRS:
                even = n0 + 2 * offs_pair
                loc_e = tl.load(Req_to_token + row * stride_r2t + even, mask=even < end, other=0).to(tl.int64)
                loc_o = tl.load(Req_to_token + row * stride_r2t + even + 1, mask=even + 1 < end, other=0).to(tl.int64)
                w_ptrs = v_words + kv_head * (stride_vh // 4) + offs_w[None, :]
                we = tl.load(w_ptrs + loc_e[:, None] * (stride_vt // 4), mask=(even < end)[:, None] & mask_w[None, :],
                             other=0)
                wo = tl.load(w_ptrs + loc_o[:, None] * (stride_vt // 4),
                             mask=(even + 1 < end)[:, None] & mask_w[None, :], other=0)
                e0, o0, e1, o1, e2, o2, e3, o3 = _fp8_pairs(we, wo, V_PAIRS, DOT_FP32)
                pe, po = tl.split(tl.reshape(p.to(q.dtype), [BLOCK_H, BLOCK_N // 2, 2]))
                acc0 = acc0 * alpha[:, None] + mma(pe, e0, DOT_FP32) + mma(po, o0, DOT_FP32)
                acc1 = acc1 * alpha[:, None] + mma(pe, e1, DOT_FP32) + mma(po, o1, DOT_FP32)
                acc2 = acc2 * alpha[:, None] + mma(pe, e2, DOT_FP32) + mma(po, o2, DOT_FP32)
                acc3 = acc3 * alpha[:, None] + mma(pe, e3, DOT_FP32) + mma(po, o3, DOT_FP32)
            elif USE_DOT:
                v = tl.load(V_Buf + loc[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                            mask=mask_kv, other=0.0)
                acc = acc * alpha[:, None] + mma(p.to(q.dtype), v, DOT_FP32)
            else:
                v = tl.load(V_Buf + loc[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                            mask=mask_kv, other=0.0)
                acc = acc * alpha[:, None] + tl.sum(tl.trans(p) * v.to(tl.float32), axis=0)[None, :]
            m_i = m_new
        if V_PAIRS:  # dim 4w + i from acc_i[:, w]
            acc = tl.reshape(tl.join(tl.join(acc0, acc2), tl.join(acc1, acc3)), [BLOCK_H, BLOCK_D])

        if DIRECT or MERGE:  # the sum of an output written here: the softmax's, and the heads' sinks
            l_out = l_i
            if HAS_SINKS:
                l_out = l_i + sink_weight(tl.load(Sinks + heads, mask=mask_h, other=0.0), m_i)
        if DIRECT:  # one split: the program's result is the output, with no partials to merge
            out = acc * (v_scale / tl.where(l_out > 0, l_out, 1.0)[:, None])
            tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=mask_o)
        elif MERGE:
            if n_valid == 1:  # the request's one non-empty split: its result is the output, as with DIRECT
                out = acc * (v_scale / tl.where(l_out > 0, l_out, 1.0)[:, None])
                tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=mask_o)
            else:  # the last of the request's programs for these heads merges the partials (stage 2's work)
                store_decode_partial(Mid_O, Mid_LSE, b, heads, split, offs_d, mask_h, mask_d, acc, m_i, l_i,
                                     v_scale, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh)
                first = (pid_h % HEAD_BLOCKS) * BLOCK_H  # the block's first head in the group
                merge_if_last(Counters + b.to(tl.int64) * stride_cb + pid_h, Mid_O, Mid_LSE, Out, b,
                              kv_head * GROUP + first, tl.minimum(GROUP - first, BLOCK_H), n_valid,
                              stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                              MERGE_HEADS, MERGE_SPLITS, HEAD_DIM, BLOCK_D, Sinks, HAS_SINKS)
        else:
            store_decode_partial(Mid_O, Mid_LSE, b, heads, split, offs_d, mask_h, mask_d, acc, m_i, l_i, v_scale,
                                 stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh)
    elif DIRECT or MERGE:
        if split == 0:  # an empty request (seq_len 0) attends to nothing: zeros, as stage 2 writes them
            tl.store(out_ptrs, tl.zeros([BLOCK_H, BLOCK_D], dtype=Out.dtype.element_ty), mask=mask_o)


@triton.jit(do_not_specialize=["num_kv_splits", "min_split_len", "window", "dense_len", "top_k"])
def _decode_stage2_kernel(
    Mid_O, Mid_LSE, Out, Seq_lens, Sinks,
    num_kv_splits, min_split_len, window, dense_len, top_k,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
    SPARSE: tl.constexpr = 0,
    HAS_SINKS: tl.constexpr = False,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d, mask_d = head_dims(HEAD_DIM, BLOCK_D)

    # the same split boundaries as stage 1; only the non-empty splits are read, SPLIT_BLOCK at a time (a runtime
    # loop: one compiled variant serves every split count, and a batch of 2 splits reads 2, not the buffer's 16).
    # One split per iteration: summing a [SPLIT_BLOCK, D] tile over its split axis was slower at every batch size
    # measured (docs/perf-log.md has the figures).
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    if SPARSE:  # double sparsity: a request past dense_len attended over its top_k selected positions
        seq_len = tl.where(seq_len <= dense_len, seq_len, top_k)
    _, chunk, n_valid = decode_splits(seq_len, window, num_kv_splits, min_split_len, BLOCK_N)
    lse_base = Mid_LSE + b.to(tl.int64) * stride_mlb + h * stride_mlh
    o_base = Mid_O + b.to(tl.int64) * stride_mob + h * stride_moh
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_valid, SPLIT_BLOCK):
        offs_s = s0 + tl.arange(0, SPLIT_BLOCK)
        valid = offs_s < n_valid
        lse = tl.load(lse_base + offs_s, mask=valid, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        w = tl.exp2(lse - m_new)
        scale = tl.exp2(m - m_new)
        parts = tl.load(o_base + offs_s[:, None] * stride_mos + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0)
        acc = acc * scale + tl.sum(w[:, None] * parts, axis=0)
        denom = denom * scale + tl.sum(w, axis=0)
        m = m_new
    if HAS_SINKS:  # the head's sink logit joins the softmax sum (no weight for an empty request: m = -inf)
        denom += sink_weight(tl.load(Sinks + h), m)
    out = acc / tl.where(denom > 0, denom, 1.0)  # an empty request (seq_len 0) writes zeros
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


# Tile of an fp8 pool (tokens per loop step, pipeline stages): its rows are half the bytes of bf16 ones, so the
# same token count keeps half as many bytes in flight. RADIXSERVE_DECODE_FP8_BLOCK_N / _STAGES override them
# (comparisons; `benchmarks/bench_attention_kernels.py --kv-dtype fp8_e4m3 --block-n ... --num-stages ...`).
# On an H200 (8B shape, 8 KV heads, batch 160-512, 640-1024 tokens) 128 tokens and 3 stages read an fp8 pool at
# 2.2-2.5 TB/s against 1.6-1.8 with bf16's 64 and 2 (docs/perf-log.md).
FP8_BLOCK_N = int(os.environ.get("RADIXSERVE_DECODE_FP8_BLOCK_N", "128"))
FP8_NUM_STAGES = int(os.environ.get("RADIXSERVE_DECODE_FP8_STAGES", "3"))
# An fp8 pool's V tile is read as 32-bit words and widened in token pairs (`_fp8_pairs`) instead of reaching the
# tensor cores through one-byte shared-memory loads (`benchmarks/decode_kernel_ptx.py`: 1,396 instructions a
# 128-token tile against 1,532, no byte loads). On an H200 (8B shape, batch 160-512, 640-1,024 tokens) stage 1 over
# an e4m3 pool takes 16-23% less time with it (512 x 1,024: 325 against 421 us; docs/perf-log.md).
# RADIXSERVE_DECODE_FP8_V_PAIRS=0 widens V's tile whole, as before (`bench_attention_kernels.py --fp8-v-pairs 0,1`).
FP8_V_PAIRS = os.environ.get("RADIXSERVE_DECODE_FP8_V_PAIRS", "1") == "1"
# Stage 1's grid has the heads as its fastest axis, so the programs of one request's KV heads run side by side and
# read the neighbouring parts of the same pool rows (a token's heads are adjacent). On an H200 (8B shape, batch 512 x
# 1,024 tokens, bf16) 1-3% faster than requests first, and the 1,000-prompt offline run 0.8% (docs/perf-log.md);
# RADIXSERVE_DECODE_HEADS_FIRST=0 restores the requests-first order.
HEADS_FIRST = os.environ.get("RADIXSERVE_DECODE_HEADS_FIRST", "1") == "1"
# A small batch split over many KV splits a request merges them in stage 1's own launch: the last program of each
# (request, head block) to store its partial merges them (`last_partial_done`, `merge_decode_partials`) instead of
# stage 2. Replayed from a CUDA graph the gap between the two launches is only ~0.2 us; the gain is the merge's
# own time, many splits a step where stage 2 waits a round trip to L2 per split. On an H200 (8B shape, bf16, 32
# query heads on 8 KV heads, 64 splits) batch 1 x 512 / 2,048 / 8,192 tokens took 5.6 / 8.4-8.7 / 14.6 us against
# 6.0 / 9.7-9.9 / 16.5, batch 2 0.4-1.7 us less, batch 4-8 within 0.5 us; but batch 16 (9 splits) x 512 took
# 0.7-0.9 us more, plain multi-head attention 1.3-5.7 us more (113 registers a thread against 94), and a group of
# 128 heads or MLA (one program merging 64 or 16 heads) 2-3x stage 2's time. So the backend passes its counters
# only where it paid (`one_launch_pays`); RADIXSERVE_DECODE_ONE_LAUNCH=0 never does
# (`bench_attention_kernels.py --one-launch 0,1` compares them).
ONE_LAUNCH = os.environ.get("RADIXSERVE_DECODE_ONE_LAUNCH", "1") == "1"
# A batch's requests are split until stage 1 has this many programs per SM (`kv_split_cap`), at most
# cdiv(seq_len, min_split_len) splits a request. On an H200 (8B shape, bf16, 512-8,192 tokens) 2 against the
# earlier 8: one split from batch 33 up (no stage 2) instead of 2-3, 2-5 splits at batch 8-32 instead of 5-17;
# stage 1 + 2 at batch 64 x 512 41.3 against 44.8 us, 64 x 8,192 481 against 525, 16 x 512 13.3 against 15.4,
# batch 1-8 at 512-2,048 tokens 2.7 us less to 0.5 more, at 8,192 up to 2.2 more (docs/perf-log.md, 2026-12-02).
# RADIXSERVE_DECODE_PROGRAMS_PER_SM overrides it (`bench_attention_kernels.py --programs-per-sm ...` compares).
PROGRAMS_PER_SM = int(os.environ.get("RADIXSERVE_DECODE_PROGRAMS_PER_SM", "2"))
if PROGRAMS_PER_SM < 1:
    raise ValueError(f"RADIXSERVE_DECODE_PROGRAMS_PER_SM must be positive, got {PROGRAMS_PER_SM}")


def is_interpreted() -> bool:
    """True when these kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when this module was imported)."""
    return not isinstance(_decode_stage1_kernel, triton.runtime.JITFunction)


def v_pairs_fit(v_buffer: torch.Tensor, block_n: int) -> bool:
    """Whether `fp8_v_pairs` can read this V pool as words: fp8, a head dim of at least 64 and a multiple of 4,
    tiles of at least 32 tokens (the products' inner size is half the tile), 4-byte aligned rows."""
    return (v_buffer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and v_buffer.shape[-1] % 4 == 0
            and v_buffer.shape[-1] >= 64 and block_n >= 32 and v_buffer.stride(0) % 4 == 0
            and v_buffer.stride(1) % 4 == 0 and v_buffer.data_ptr() % 4 == 0)


def decode_partial_shapes(batch_size: int, num_heads: int, head_dim: int,
                          num_kv_splits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the float32 partial-output and log-sum-exp buffers `decode_attention_fwd` needs for up to
    `num_kv_splits` splits (padded to `split_capacity`)."""
    cap = split_capacity(num_kv_splits)
    return (batch_size, num_heads, cap, head_dim), (batch_size, num_heads, cap)


def new_decode_counters(batch_size: int, num_heads: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed int32 [batch_size, num_heads] counters with which `decode_attention_fwd` (and `mla_decode_fwd`)
    merge a split batch in one launch; every call leaves them zero again, so one allocation serves every call and
    every CUDA graph of at most batch_size requests (calls one after the other on a stream, never two at once)."""
    return torch.zeros((batch_size, num_heads), dtype=torch.int32, device=device)


def one_launch_pays(group: int, num_kv_splits: int) -> bool:
    """Whether merging in stage 1's launch (counters) beat stage 2 on an H200 for this shape (ONE_LAUNCH's
    measurements): query groups of 2 to 8 heads a KV head, at least 32 splits a request (batch 1-4 at 8 KV heads)."""
    return 2 <= group <= 8 and num_kv_splits >= 32


def check_decode_counters(counters: torch.Tensor, bs: int, num_heads: int) -> None:
    """ValueError unless `counters` is the contiguous int32 [>= bs, >= num_heads] of `new_decode_counters`."""
    if counters.dtype != torch.int32 or counters.dim() != 2 or counters.shape[0] < bs \
            or counters.shape[1] < num_heads or not counters.is_contiguous():
        raise ValueError(f"counters must be contiguous int32 [>= {bs}, >= {num_heads}] (new_decode_counters); got "
                         f"{counters.dtype} {tuple(counters.shape)} with strides {counters.stride()}")


def split_capacity(num_kv_splits: int) -> int:
    """Split slots of the partial buffers for `num_kv_splits` splits: a multiple of 16, so that their strides are
    the same whatever the split count of a batch, and no batch size compiles its own kernel variant (Triton
    specialises on integer arguments divisible by 16). The kernels read only the splits a request uses."""
    return max(16, triton.cdiv(num_kv_splits, 16) * 16)


def kv_split_cap(batch_size: int, num_heads: int, num_kv_heads: int, num_sms: int, max_kv_splits: int,
                 programs_per_sm: int | None = None, use_dot: bool | None = None) -> int:
    """How many KV splits per request to launch for a batch: enough stage-1 programs to fill the GPU
    `programs_per_sm` (default PROGRAMS_PER_SM) times over, at most max_kv_splits. Depends on the batch size only
    (CUDA-graph safe)."""
    if programs_per_sm is None:
        programs_per_sm = PROGRAMS_PER_SM
    group = max(1, num_heads // max(1, num_kv_heads))
    head_blocks = triton.cdiv(group, _block_h(group, use_dot))
    programs = max(1, batch_size * num_kv_heads * head_blocks)
    return max(1, min(max_kv_splits, triton.cdiv(programs_per_sm * num_sms, programs)))


def _block_h(group: int, use_dot: bool | None = None) -> int:
    if use_dot is None:
        use_dot = _default_use_dot(group)
    return min(64, max(16, triton.next_power_of_2(group))) if use_dot else 1


def _default_use_dot(group: int) -> bool:
    """tl.dot (query rows padded to 16) for every group size: on an H200 it read MHA's KV at about 4 TB/s against
    about 2 TB/s for the elementwise path, which stays available (use_dot=False) for group 1."""
    return True


def _check_decode_inputs(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                         mid_o: torch.Tensor, mid_lse: torch.Tensor, num_kv_splits: int) -> None:
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.dim() != 3:
        raise ValueError(f"q [bs, H, D] and k/v buffers [slots, Hkv, D] expected; got {tuple(q.shape)}, "
                         f"{tuple(k_buffer.shape)}, {tuple(v_buffer.shape)}")
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if k_buffer.shape[2] != head_dim or v_buffer.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"head sizes differ: q {tuple(q.shape)}, k {tuple(k_buffer.shape)}, v {tuple(v_buffer.shape)}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if o.shape != q.shape:
        raise ValueError(f"output shape {tuple(o.shape)} != q shape {tuple(q.shape)}")
    if num_kv_splits < 1:
        raise ValueError(f"at least one split is needed; got {num_kv_splits}")
    if mid_o.dim() != 4 or mid_lse.dim() != 3 or tuple(mid_o.shape[:3]) != tuple(mid_lse.shape) \
            or tuple(mid_o.shape[:2]) != (bs, num_heads) or mid_o.shape[3] != head_dim \
            or mid_lse.shape[2] < num_kv_splits:
        raise ValueError(f"partial buffers must be [{bs}, {num_heads}, S, {head_dim}] and [{bs}, {num_heads}, S] with "
                         f"S >= {num_kv_splits} splits; got {tuple(mid_o.shape)}, {tuple(mid_lse.shape)}")
    if mid_o.dtype != torch.float32 or mid_lse.dtype != torch.float32:
        raise ValueError("partial buffers must be float32")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o), ("mid_o", mid_o),
                    ("mid_lse", mid_lse)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dimension")
    if not (mid_o.is_contiguous() and mid_lse.is_contiguous()):
        raise ValueError("partial buffers must be contiguous")


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    sm_scale: float,
    min_split_len: int = 64,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_dot: bool | None = None,
    num_kv_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int = -1,
    heads_first: bool | None = None,
    fp8_v_pairs: bool | None = None,
    counters: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attention_chunk: int = -1,
) -> None:
    """Attention of one query token per request over its first seq_len KV slots (the last `sliding_window` of them
    when it is positive; those of the query's own chunk when `attention_chunk` is, Llama 4's chunked attention: from
    ((seq_len - 1) // chunk) * chunk); writes `o` in place. The pool holds k / k_scale and v / v_scale (1.0 unless
    it is fp8).

    q, o: [bs, H, D]; k_buffer, v_buffer: [slots, Hkv, D]; req_to_token: [rows, max_ctx] int32;
    req_pool_indices, seq_lens: [bs] (int32 or int64, on the device); mid_o [bs, H, S, D] and mid_lse [bs, H, S]
    float32 scratch buffers (`decode_partial_shapes`). num_kv_splits (default S), the number of splits launched per
    request, is the cap: a request of seq_len L uses min(num_kv_splits, cdiv(L, min_split_len)) of them
    (`kv_split_cap` picks it for a batch size). heads_first (default HEADS_FIRST) orders stage 1's grid;
    fp8_v_pairs (default FP8_V_PAIRS) reads an fp8 pool's V as words widened in token pairs, where the shapes allow
    it (a head dim of at least 64 and a multiple of 4, tiles of at least 32 tokens, 4-byte aligned rows).
    counters (int32 [>= bs, >= H], all zero: `new_decode_counters`; left zero again) merge the splits in stage 1's
    launch when there are several (ONE_LAUNCH); without them stage 2 merges them in a second launch.
    logit_cap > 0: the scaled scores are soft-capped, logit_cap * tanh(s / logit_cap) (Gemma 2).
    sinks: float32 [H] per-head sink logits (GPT-OSS), taken into the softmax sum wherever the output is written
    (one split, the one-launch merge or stage 2), or None.
    """
    if mid_lse.dim() != 3:
        raise ValueError(f"mid_lse must be [bs, H, S]; got {tuple(mid_lse.shape)}")
    capacity = mid_lse.shape[-1]
    if num_kv_splits is None:
        num_kv_splits = capacity
    _check_decode_inputs(q, k_buffer, v_buffer, o, mid_o, mid_lse, num_kv_splits)
    bs, num_heads, head_dim = q.shape
    if counters is not None:
        check_decode_counters(counters, bs, num_heads)
    check_sinks(sinks, num_heads, q.device)
    if bs == 0:
        return
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    if min_split_len < 1:
        raise ValueError(f"min_split_len must be positive; got {min_split_len}")
    window = kernel_window(sliding_window, attention_chunk)
    interp = is_interpreted()
    if k_buffer.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        k_scale = v_scale = 1.0  # only an fp8 pool is scaled
    block_d = max(16, triton.next_power_of_2(head_dim))
    if use_dot is None:
        use_dot = _default_use_dot(group)
    elif not use_dot and group > 1:
        raise ValueError("the elementwise decode path handles one query head per KV head only")
    block_h = _block_h(group, use_dot)
    head_blocks = triton.cdiv(group, block_h)
    fp8_pool = k_buffer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if block_n is None:
        block_n = 32 if interp else FP8_BLOCK_N if fp8_pool else 64
    if num_stages is None:
        num_stages = FP8_NUM_STAGES if fp8_pool and not interp else 2
    if num_warps is None:
        num_warps = 4 if head_dim <= 128 else 8
    # fp32 inputs (tests) keep full precision in tl.dot; the interpreter's dot mishandles bfloat16, so upcast there.
    dot_fp32 = use_dot and (interp or q.dtype == torch.float32)
    if heads_first is None:
        heads_first = HEADS_FIRST and bs < 65536  # the grid's second axis holds at most 65,535 programs
    if fp8_v_pairs is None:
        fp8_v_pairs = FP8_V_PAIRS
    v_pairs = 0
    if fp8_v_pairs and use_dot and v_pairs_fit(v_buffer, block_n):
        v_pairs = 1 if v_buffer.dtype == torch.float8_e4m3fn else 2

    grid1 = (num_kv_heads * head_blocks, bs, num_kv_splits) if heads_first else (bs, num_kv_heads * head_blocks,
                                                                                   num_kv_splits)
    direct = num_kv_splits == 1  # stage 1 writes the output itself; no stage 2
    # stage 1's last program of each head block merges; no stage 2. Not with sinks: Triton 3.6's thread-locality
    # pass asserts on that variant (the split loop's running max read by the sink weight and the partial's store;
    # GPT-OSS's batch-64 decode on an H100), so stage 2 adds them
    merge = not direct and counters is not None and sinks is None
    merge_heads = min(block_h, triton.next_power_of_2(group))  # the block's real heads (block_h pads them to 16)
    launch(_decode_stage1_kernel, grid1,
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, o,
        counters if merge else mid_lse,  # (a stand-in pointer that the kernel does not touch)
        mid_lse if sinks is None else sinks,  # (likewise)
        sm_scale * k_scale * LOG2E, v_scale, num_kv_splits, min_split_len, window,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        counters.stride(0) if merge else 0,
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_N=block_n, USE_DOT=use_dot, DOT_FP32=dot_fp32,
        KV_F16=use_dot and not dot_fp32 and fp8_pool, V_PAIRS=v_pairs,
        SLIDING=window != 0, HEADS_FIRST=heads_first, DIRECT=direct, MERGE=merge,
        MERGE_HEADS=merge_heads, MERGE_SPLITS=merge_split_block(merge_heads, block_d),
        CAP=max(logit_cap, 0.0) * LOG2E, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_opts(q),
    )
    if direct or merge:
        return
    grid2 = (bs, num_heads)
    launch(_decode_stage2_kernel, grid2,
        mid_o, mid_lse, o, seq_lens, mid_lse if sinks is None else sinks,
        num_kv_splits, min_split_len, window, 0, 0,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, SPLIT_BLOCK=1, HAS_SINKS=sinks is not None,
        num_warps=4, num_stages=1, **pdl.launch_opts(q),
    )
