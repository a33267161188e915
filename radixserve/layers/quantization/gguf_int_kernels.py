"""Q4_K decode GEMVs with integer products, and the tile helpers every Q4_K GEMV shares.

x is quantised to int8 per 32 columns (llama.cpp's q8_1 activations: amax / 127, halves away from zero), the 4-bit
weights are multiplied as integers and each 32-weight sub-block's scales are applied after its integer dot:
w = d sc (q - 8) + (8 d sc - dmin m), so out = d sc x_scale dot(q - 8, x_q) + (8 d sc - dmin m) sum(x). The kernels:
- `mma` / `mma2d`: x quantised in the program, an int8 MMA with x in the first column (one row of x a program);
- `dp4a` / `dp4w`: dp4a on the CUDA cores, x quantised per weight row or once per program and step;
- `dp4x`: the same on words with x quantised beforehand (`q8_1_words`), one row of x a program; `dp4x_rows`: up to
  8 rows of x in one program, the weight's words read once;
- `dp4c` (`gguf_chunk_kernels`): one row of x a program, whole 32-byte chunks a thread (the one-row pick on the
  8B shapes);
- `mma_rows`: up to 16 rows of x as the columns of one int8 MMA per sub-block.
Dispatch, limits and the float kernels: `gguf_kernels`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue


@triton.jit
def _q4_k_chunk_pointers(X, Wq, Sc, Mn, D, Dmin, m, rows, ch, offs_l, stride_xm, stride_wn, stride_sn, stride_dn):
    """The pointer tiles of the Q4_K GEMVs that read NCH 32-byte chunks of BLOCK_N rows a step, at chunk 0: the q
    bytes and x as [BLOCK_N, NCH, 32] (x the same for every row; chunk g's low nibbles meet x[64g + l], its high
    ones x[64g + 32 + l]), the sub-block scales and mins of chunk g's first sub-block (2g) and the super-block's
    d / dmin (g // 4) as [BLOCK_N, NCH]."""
    w_ptrs = Wq + rows[:, None, None] * stride_wn + (ch[:, None] * 32 + offs_l[None, :])[None, :, :]
    x_ptrs = X + m * stride_xm + (ch[:, None] * 64 + offs_l[None, :])[None, :, :] + 0 * rows[:, None, None]
    s_ptrs, m_ptrs, d_ptrs, dm_ptrs = _q4_k_scale_pointers(Sc, Mn, D, Dmin, rows, ch, stride_sn, stride_dn)
    return w_ptrs, x_ptrs, s_ptrs, m_ptrs, d_ptrs, dm_ptrs


@triton.jit
def _q4_k_scale_pointers(Sc, Mn, D, Dmin, rows, ch, stride_sn, stride_dn):
    """[BLOCK_N, NCH] pointer tiles, at chunk 0, of the scale and min of each chunk's first sub-block (2g) and of
    its super-block's d / dmin (g // 4)."""
    s_ptrs = Sc + rows[:, None] * stride_sn + 2 * ch[None, :]
    m_ptrs = Mn + rows[:, None] * stride_sn + 2 * ch[None, :]
    d_ptrs = D + rows[:, None] * stride_dn + ch[None, :] // 4
    dm_ptrs = Dmin + rows[:, None] * stride_dn + ch[None, :] // 4
    return s_ptrs, m_ptrs, d_ptrs, dm_ptrs


@triton.jit
def _q4_k_chunk_scales(s_ptrs, m_ptrs, d_ptrs, dm_ptrs, g0, mask_s):
    """The float32 factors of the step that starts at chunk g0, each shaped as the pointer tiles: the scale and min
    of the low and high sub-blocks of each chunk, and its super-block's d and dmin."""
    sc_lo = tl.load(s_ptrs + 2 * g0, mask=mask_s, other=0).to(tl.float32)
    sc_hi = tl.load(s_ptrs + 2 * g0 + 1, mask=mask_s, other=0).to(tl.float32)
    mn_lo = tl.load(m_ptrs + 2 * g0, mask=mask_s, other=0).to(tl.float32)
    mn_hi = tl.load(m_ptrs + 2 * g0 + 1, mask=mask_s, other=0).to(tl.float32)
    d = tl.load(d_ptrs + g0 // 4, mask=mask_s, other=0.0).to(tl.float32)
    dm = tl.load(dm_ptrs + g0 // 4, mask=mask_s, other=0.0).to(tl.float32)
    return sc_lo, sc_hi, mn_lo, mn_hi, d, dm


@triton.jit
def _round_to_int8(v):
    """|v| <= 127 to the nearest int8, halves away from zero (llama.cpp's roundf)."""
    return tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32).to(tl.int8)


@triton.jit
def _q4_k_gemv_mma_kernel(X, Wq, Sc, Mn, D, Dmin, Out, Bias, N, K, stride_xm, stride_wn, stride_sn, stride_dn,
                          stride_om, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, NCH: tl.constexpr):
    """As `_q4_k_gemv_kernel`, with the products on the integer tensor cores: each 32-weight sub-block of x is
    quantised to int8 in the program (amax / 127, as llama.cpp's q8_1 activations), the nibbles are unpacked to
    int8 and centred (q - 8), and one batched int8 dot per loop step (batch = the NCH chunks, [BLOCK_N, 32] x
    [32, 16] with x in column 0) gives each sub-block's integer dot product; the sub-block's scales are applied
    after the MMA: d * sc * x_scale * dot + (8 d * sc - dmin * m) * sum(x). Per weight that leaves a mask or shift
    and a share of the MMA and its epilogue, where the CUDA-core kernels spend a conversion and two
    multiply-adds."""
    m = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ch = tl.arange(0, NCH)
    offs_l = tl.arange(0, 32)
    col = tl.arange(0, 16)
    rows = offs_n.to(tl.int64)
    # q bytes as [NCH, BLOCK_N, 32] (the dot's batch first); chunk c holds sub-blocks 2c (low) and 2c + 1 (high)
    w_ptrs = Wq + rows[None, :, None] * stride_wn + (ch[:, None, None] * 32 + offs_l[None, None, :])
    x_ptrs = X + m * stride_xm + ch[:, None] * 64 + offs_l[None, :]  # [NCH, 32]
    s_ptrs = Sc + rows[None, :] * stride_sn + 2 * ch[:, None]  # [NCH, BLOCK_N]
    m_ptrs = Mn + rows[None, :] * stride_sn + 2 * ch[:, None]
    d_ptrs = D + rows[None, :] * stride_dn + ch[:, None] // 4
    dm_ptrs = Dmin + rows[None, :] * stride_dn + ch[:, None] // 4
    mask_w = mask_n[None, :, None]
    mask_s = mask_n[None, :]
    first = (col == 0)[None, None, :]  # [1, 1, 16]
    acc = tl.zeros((NCH, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, K // 64, NCH):  # K % (64 * NCH) == 0 and NCH % 4 == 0 (the wrapper checks)
        b = tl.load(w_ptrs + g0 * 32, mask=mask_w, other=0)
        q_lo = (b & 0xF).to(tl.int8) - 8  # centred: the int8 rounding of x then meets half the magnitude
        q_hi = (b >> 4).to(tl.int8) - 8
        x_lo = tl.load(x_ptrs + g0 * 64).to(tl.float32)  # [NCH, 32]
        x_hi = tl.load(x_ptrs + g0 * 64 + 32).to(tl.float32)
        xs_lo = tl.maximum(tl.max(tl.abs(x_lo), axis=1), 1e-30) / 127.0  # [NCH]
        xs_hi = tl.maximum(tl.max(tl.abs(x_hi), axis=1), 1e-30) / 127.0
        xq_lo = _round_to_int8(x_lo / xs_lo[:, None])
        xq_hi = _round_to_int8(x_hi / xs_hi[:, None])
        xt_lo = tl.where(first, xq_lo[:, :, None], 0).to(tl.int8)  # [NCH, 32, 16], x in column 0
        xt_hi = tl.where(first, xq_hi[:, :, None], 0).to(tl.int8)
        dot_lo = tl.sum(tl.dot(q_lo, xt_lo, out_dtype=tl.int32), axis=2).to(tl.float32)  # [NCH, BLOCK_N]
        dot_hi = tl.sum(tl.dot(q_hi, xt_hi, out_dtype=tl.int32), axis=2).to(tl.float32)
        sc_lo, sc_hi, mn_lo, mn_hi, d, dm = _q4_k_chunk_scales(s_ptrs, m_ptrs, d_ptrs, dm_ptrs, g0, mask_s)
        # w = d sc (q - 8) + (8 d sc - dmin m): the second part times the float sum of x
        acc += d * (sc_lo * dot_lo * xs_lo[:, None] + sc_hi * dot_hi * xs_hi[:, None]) \
            + (8.0 * d * sc_lo - dm * mn_lo) * tl.sum(x_lo, axis=1)[:, None] \
            + (8.0 * d * sc_hi - dm * mn_hi) * tl.sum(x_hi, axis=1)[:, None]
    out = tl.sum(acc, axis=0)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, out.to(Out.dtype.element_ty), mask=mask_n)


@triton.jit
def _q4_k_chunk_rows(w_ptrs, d_ptrs, dm_ptrs, g, mask_n):
    """Chunk g (32 bytes: sub-blocks 2g and 2g + 1) of BLOCK_N weight rows, [BLOCK_N, 32] bytes, and the float32 d
    and dmin of its super-block [BLOCK_N]; w_ptrs point at chunk 0, d_ptrs / dm_ptrs at each row's first d."""
    b = tl.load(w_ptrs + g * 32, mask=mask_n[:, None], other=0)
    d = tl.load(d_ptrs + g // 4, mask=mask_n, other=0.0).to(tl.float32)
    dm = tl.load(dm_ptrs + g // 4, mask=mask_n, other=0.0).to(tl.float32)
    return b, d, dm


@triton.jit
def _q4_k_sub_block(b, s_ptrs, m_ptrs, blk, HIGH: tl.constexpr, mask_n):
    """Sub-block blk of a chunk's bytes b: its nibbles (HIGH: the high ones) centred as int8 (q - 8), and its scale
    and min as float32 [BLOCK_N]."""
    q = ((b >> (4 * HIGH)) & 0xF).to(tl.int8) - 8
    sc = tl.load(s_ptrs + blk, mask=mask_n, other=0).to(tl.float32)
    mn = tl.load(m_ptrs + blk, mask=mask_n, other=0).to(tl.float32)
    return q, sc, mn


@triton.jit
def _q4_k_gemv_mma2d_kernel(X, Wq, Sc, Mn, D, Dmin, Out, Bias, N, K, stride_xm, stride_wn, stride_sn, stride_dn,
                            stride_om, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, NCH: tl.constexpr):
    """`_q4_k_gemv_mma_kernel` with one 2-D int8 dot per sub-block ([BLOCK_N, 32] x [32, 16]) in an unrolled loop
    over the NCH chunks of a step, instead of one batched dot."""
    m = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_l = tl.arange(0, 32)
    first = (tl.arange(0, 16) == 0)[None, :]
    rows = offs_n.to(tl.int64)
    w_ptrs = Wq + rows[:, None] * stride_wn + offs_l[None, :]  # [BLOCK_N, 32]
    x_ptrs = X + m * stride_xm + offs_l
    s_ptrs = Sc + rows * stride_sn
    m_ptrs = Mn + rows * stride_sn
    d_ptrs = D + rows * stride_dn
    dm_ptrs = Dmin + rows * stride_dn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g0 in range(0, K // 64, NCH):  # K % (64 * NCH) == 0 and NCH % 4 == 0 (the wrapper checks)
        for c in tl.static_range(NCH):
            g = g0 + c
            b, d, dm = _q4_k_chunk_rows(w_ptrs, d_ptrs, dm_ptrs, g, mask_n)
            for half in tl.static_range(2):
                q, sc, mn = _q4_k_sub_block(b, s_ptrs, m_ptrs, 2 * g + half, half, mask_n)
                x = tl.load(x_ptrs + g * 64 + 32 * half).to(tl.float32)  # [32]
                xs = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30) / 127.0
                xt = tl.where(first, _round_to_int8(x / xs)[:, None], 0).to(tl.int8)  # [32, 16], x in column 0
                dot = tl.sum(tl.dot(q, xt, out_dtype=tl.int32), axis=1).to(tl.float32)  # [BLOCK_N]
                acc += d * sc * xs * dot + (8.0 * d * sc - dm * mn) * tl.sum(x, axis=0)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, acc.to(Out.dtype.element_ty), mask=mask_n)


@triton.jit
def _nibble_dot4(b, xq, HIGH: tl.constexpr, ASM: tl.constexpr):
    """Products of the low (or HIGH) nibbles of the bytes b (uint8) with the int8 xq, for a sum over the last
    axis: with ASM, one `dp4a` per 4 bytes (the nibbles masked out of a 32-bit register in one instruction), the
    4-byte sum in the first of the 4 results and 0 in the others; without it (the interpreter), the elementwise
    products (the same sum)."""
    if ASM:  # (string literals in place: a jitted function cannot bind a str to a name)
        if HIGH:
            return tl.inline_asm_elementwise(
                "{.reg .b32 t; shr.b32 t, $4, 4; and.b32 t, t, 0x0F0F0F0F; dp4a.u32.s32 $0, t, $5, 0; "
                "mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;}",
                "=r,=r,=r,=r,r,r", [b, xq], dtype=tl.int32, is_pure=True, pack=4)
        return tl.inline_asm_elementwise(
            "{.reg .b32 t; and.b32 t, $4, 0x0F0F0F0F; dp4a.u32.s32 $0, t, $5, 0; "
            "mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;}",
            "=r,=r,=r,=r,r,r", [b, xq], dtype=tl.int32, is_pure=True, pack=4)
    q = (b >> 4) if HIGH else (b & 0xF)
    return q.to(tl.int32) * xq.to(tl.int32)


@triton.jit
def _q4_k_gemv_dp4a_kernel(X, Wq, Sc, Mn, D, Dmin, Out, Bias, N, K, stride_xm, stride_wn, stride_sn, stride_dn,
                           stride_om, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                           NCH: tl.constexpr):
    """As `_q4_k_gemv_mma_kernel` (x to int8 per 32-column block in the program, the sub-blocks' scales after an
    integer dot product), with the integer products by `dp4a` on the CUDA cores: 4 weights a instruction, their
    nibbles masked out of the packed bytes 4 at a time. q is taken unsigned (0..15) and the centring (q - 8) done
    on the sums: dot(q - 8, xq) = dot(q, xq) - 8 sum(xq)."""
    m = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ch = tl.arange(0, NCH)
    offs_l = tl.arange(0, 32)
    rows = offs_n.to(tl.int64)
    w_ptrs, x_ptrs, s_ptrs, m_ptrs, d_ptrs, dm_ptrs = _q4_k_chunk_pointers(
        X, Wq, Sc, Mn, D, Dmin, m, rows, ch, offs_l, stride_xm, stride_wn, stride_sn, stride_dn)
    mask_w = mask_n[:, None, None]
    mask_s = mask_n[:, None]
    acc = tl.zeros((BLOCK_N, NCH), dtype=tl.float32)
    for g0 in range(0, K // 64, NCH):  # K % (64 * NCH) == 0 and NCH % 4 == 0 (the wrapper checks)
        b = tl.load(w_ptrs + g0 * 32, mask=mask_w, other=0)
        x_lo = tl.load(x_ptrs + g0 * 64).to(tl.float32)  # [BLOCK_N, NCH, 32], every row the same
        x_hi = tl.load(x_ptrs + g0 * 64 + 32).to(tl.float32)
        xs_lo = tl.maximum(tl.max(tl.abs(x_lo), axis=2), 1e-30) / 127.0  # [BLOCK_N, NCH]
        xs_hi = tl.maximum(tl.max(tl.abs(x_hi), axis=2), 1e-30) / 127.0
        xq_lo = _round_to_int8(x_lo / xs_lo[:, :, None])
        xq_hi = _round_to_int8(x_hi / xs_hi[:, :, None])
        dot_lo = tl.sum(_nibble_dot4(b, xq_lo, False, ASM), axis=2) - 8 * tl.sum(xq_lo.to(tl.int32), axis=2)
        dot_hi = tl.sum(_nibble_dot4(b, xq_hi, True, ASM), axis=2) - 8 * tl.sum(xq_hi.to(tl.int32), axis=2)
        sc_lo, sc_hi, mn_lo, mn_hi, d, dm = _q4_k_chunk_scales(s_ptrs, m_ptrs, d_ptrs, dm_ptrs, g0, mask_s)
        acc += d * (sc_lo * dot_lo.to(tl.float32) * xs_lo + sc_hi * dot_hi.to(tl.float32) * xs_hi) \
            + (8.0 * d * sc_lo - dm * mn_lo) * tl.sum(x_lo, axis=2) \
            + (8.0 * d * sc_hi - dm * mn_hi) * tl.sum(x_hi, axis=2)
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, out.to(Out.dtype.element_ty), mask=mask_n)


@triton.jit
def _dp4a_nibbles(w, xw, HIGH: tl.constexpr, ASM: tl.constexpr):
    """Per 32-bit word: the dot product of the four low (or HIGH) nibbles of w's bytes (unsigned) with the four
    int8 of xw: one `dp4a` after masking the nibbles out of the word; under the interpreter (no ASM) the same sum
    from the unpacked bytes."""
    if ASM:
        if HIGH:
            return tl.inline_asm_elementwise(
                "{.reg .b32 t; shr.b32 t, $1, 4; and.b32 t, t, 0x0F0F0F0F; dp4a.u32.s32 $0, t, $2, 0;}",
                "=r,r,r", [w, xw], dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise(
            "{.reg .b32 t; and.b32 t, $1, 0x0F0F0F0F; dp4a.u32.s32 $0, t, $2, 0;}",
            "=r,r,r", [w, xw], dtype=tl.int32, is_pure=True, pack=1)
    t = (w >> 4) & 0x0F0F0F0F if HIGH else w & 0x0F0F0F0F
    acc = tl.zeros_like(w)
    for b in tl.static_range(4):
        xb = (xw >> (8 * b)) & 0xFF
        acc += ((t >> (8 * b)) & 0xFF) * tl.where(xb >= 128, xb - 256, xb)
    return acc


@triton.jit
def _q8_words(x):
    """x [NCH, 8, 4] (float32, 32 values a chunk) -> (int8 levels packed 4 to an int32 word [NCH, 8], the scale
    amax / 127 [NCH], the sum of the levels [NCH], the float sum [NCH]): llama.cpp's q8_1 activations, halves
    away from zero."""
    xs = tl.maximum(tl.max(tl.max(tl.abs(x), axis=2), axis=1), 1e-30) / 127.0
    q = _round_to_int8(x / xs[:, None, None]).to(tl.int32)
    shift = (tl.arange(0, 4) * 8)[None, None, :]
    words = tl.sum((q & 0xFF) << shift, axis=2)  # disjoint bits: the sum is the OR
    return words, xs, tl.sum(tl.sum(q, axis=2), axis=1), tl.sum(tl.sum(x, axis=2), axis=1)


@triton.jit
def _q4_k_gemv_dp4w_kernel(X, W32, Sc, Mn, D, Dmin, Out, Bias, N, K, stride_xm, stride_ww, stride_sn, stride_dn,
                           stride_om, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                           NCH: tl.constexpr):
    """Integer products on whole words: the q bytes read as int32 (W32: qweight viewed as int32, stride_ww words a
    row; word j of chunk g holds weights 64g + 4j.. in its low nibbles, 64g + 32 + 4j.. in its high ones), and x
    quantised to int8 per 32 columns once per program and step (not per weight row) and packed 4 to a word, so
    each word of weights costs two `dp4a` and three bit operations. The products are centred after the fact, so
    that x's int8 rounding meets q - 8 (half the magnitude of q) and the rest the float x: per sub-block
    w.x = d sc x_scale (dot(q, x_int8) - 8 sum(x_int8)) + (8 d sc - dmin m) sum(x)."""
    m = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    ch = tl.arange(0, NCH)
    offs_j = tl.arange(0, 8)
    offs_b = tl.arange(0, 4)
    w_ptrs = W32 + rows[:, None, None] * stride_ww + (ch[:, None] * 8 + offs_j[None, :])[None, :, :]
    x_ptrs = X + m * stride_xm + ch[:, None, None] * 64 + offs_j[None, :, None] * 4 + offs_b[None, None, :]
    s_ptrs, m_ptrs, d_ptrs, dm_ptrs = _q4_k_scale_pointers(Sc, Mn, D, Dmin, rows, ch, stride_sn, stride_dn)
    mask_w = mask_n[:, None, None]
    mask_s = mask_n[:, None]
    acc = tl.zeros((BLOCK_N, NCH), dtype=tl.float32)
    for g0 in range(0, K // 64, NCH):  # K % (64 * NCH) == 0 and NCH % 4 == 0 (the wrapper checks)
        w = tl.load(w_ptrs + g0 * 8, mask=mask_w, other=0)  # [BLOCK_N, NCH, 8] int32
        xw_lo, xs_lo, qsum_lo, xsum_lo = _q8_words(tl.load(x_ptrs + g0 * 64).to(tl.float32))
        xw_hi, xs_hi, qsum_hi, xsum_hi = _q8_words(tl.load(x_ptrs + g0 * 64 + 32).to(tl.float32))
        dot_lo = tl.sum(_dp4a_nibbles(w, tl.broadcast_to(xw_lo[None, :, :], w.shape), False, ASM), axis=2)
        dot_hi = tl.sum(_dp4a_nibbles(w, tl.broadcast_to(xw_hi[None, :, :], w.shape), True, ASM), axis=2)
        dot_lo = (dot_lo - 8 * qsum_lo[None, :]).to(tl.float32) * xs_lo[None, :]  # [BLOCK_N, NCH]
        dot_hi = (dot_hi - 8 * qsum_hi[None, :]).to(tl.float32) * xs_hi[None, :]
        sc_lo, sc_hi, mn_lo, mn_hi, d, dm = _q4_k_chunk_scales(s_ptrs, m_ptrs, d_ptrs, dm_ptrs, g0, mask_s)
        acc += d * (sc_lo * dot_lo + sc_hi * dot_hi) + (8.0 * d * sc_lo - dm * mn_lo) * xsum_lo[None, :] \
            + (8.0 * d * sc_hi - dm * mn_hi) * xsum_hi[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, out.to(Out.dtype.element_ty), mask=mask_n)


@triton.jit
def _q8_1_row_tile(K, BLOCK_G: tl.constexpr):
    """This program's row m of x and its BLOCK_G 32-column blocks g (mask_g: those inside the row), with the
    offsets in the row of their values as a [BLOCK_G, 8, 4] tile (word j of block g: columns 32 g + 4 j ..)."""
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = g < K // 32
    offs = g[:, None, None] * 32 + tl.arange(0, 8)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    return m, g, mask_g, offs


@triton.jit
def _q8_1_store_words(x, Words, m, g, mask_g, K):
    """x [BLOCK_G, 8, 4] (float32 values of blocks g of row m) -> their int8 levels packed 4 to a word, stored to
    Words [M, K / 4]; returns (the blocks' scales, sums of the levels, float sums)."""
    words, xs, qsum, xsum = _q8_words(x)
    w_offs = g[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(Words + m * (K // 4) + w_offs, words, mask=mask_g[:, None])
    return xs, qsum, xsum


@triton.jit
def _q8_1_row_blocks(X, Words, K, stride_xm, BLOCK_G: tl.constexpr):
    """The shared part of x's quantisation kernels: this program's row m and BLOCK_G 32-column blocks g of x,
    their int8 levels packed 4 to a word stored to Words [M, K / 4]; returns (m, g, mask_g, the blocks' scales, sums
    of the levels, float sums)."""
    m, g, mask_g, offs = _q8_1_row_tile(K, BLOCK_G)
    x = tl.load(X + m * stride_xm + offs, mask=mask_g[:, None, None], other=0.0).to(tl.float32)
    xs, qsum, xsum = _q8_1_store_words(x, Words, m, g, mask_g, K)
    return m, g, mask_g, xs, qsum, xsum


@triton.jit
def _q8_1_words_kernel(X, Words, Xs, Qsum, Xsum, K, stride_xm, BLOCK_G: tl.constexpr, PDL: tl.constexpr = 0):
    """x [M, K] -> per 32-column block g: its int8 levels (amax / 127, halves away from zero) packed 4 to an int32
    word (Words [M, K / 4]), the scale (Xs), the sum of the levels (Qsum) and of the float x (Xsum) [M, K / 32].
    One program per row and BLOCK_G blocks."""
    pdl_prologue(PDL)
    m, g, mask_g, xs, qsum, xsum = _q8_1_row_blocks(X, Words, K, stride_xm, BLOCK_G)
    tl.store(Xs + m * (K // 32) + g, xs, mask=mask_g)
    tl.store(Qsum + m * (K // 32) + g, qsum, mask=mask_g)
    tl.store(Xsum + m * (K // 32) + g, xsum, mask=mask_g)


@triton.jit
def _q4_k_gemv_dp4x_kernel(XW, Xs, Qsum, Xsum, W32, Sc, Mn, D, Dmin, Out, Bias, N, K, stride_ww, stride_sn,
                           stride_dn, stride_om, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                           NCH: tl.constexpr, PDL: tl.constexpr = 0):
    """As `_q4_k_gemv_dp4w_kernel`, with x quantised beforehand (`_q8_1_words_kernel`, one small launch a product):
    the packed words and the per-block factors of x are read through tiles shaped as the weight's (every row the
    same; L1 serves the repeats), so the loop has no reduction and no layout exchange besides the sum of each
    chunk's 8 words."""
    pdl_prologue(PDL)
    m = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    ch = tl.arange(0, NCH)
    offs_j = tl.arange(0, 8)
    word = (ch[:, None] * 8 + offs_j[None, :])[None, :, :]  # [1, NCH, 8]: word j of chunk g
    w_ptrs = W32 + rows[:, None, None] * stride_ww + word
    # x's words: the low nibbles of chunk g meet block 2g (words 16g + j), the high ones block 2g + 1 (16g + 8 + j)
    xw_ptrs = XW + m * (K // 4) + (ch[:, None] * 16 + offs_j[None, :])[None, :, :] + 0 * rows[:, None, None]
    xb = m * (K // 32) + 2 * ch[None, :] + 0 * rows[:, None]  # [BLOCK_N, NCH]: block 2g
    s_ptrs, m_ptrs, d_ptrs, dm_ptrs = _q4_k_scale_pointers(Sc, Mn, D, Dmin, rows, ch, stride_sn, stride_dn)
    mask_w = mask_n[:, None, None]
    mask_s = mask_n[:, None]
    acc = tl.zeros((BLOCK_N, NCH), dtype=tl.float32)
    for g0 in range(0, K // 64, NCH):  # K % (64 * NCH) == 0 and NCH % 4 == 0 (the wrapper checks)
        w = tl.load(w_ptrs + g0 * 8, mask=mask_w, other=0)  # [BLOCK_N, NCH, 8] int32
        dot_lo = tl.sum(_dp4a_nibbles(w, tl.load(xw_ptrs + g0 * 16), False, ASM), axis=2)
        dot_hi = tl.sum(_dp4a_nibbles(w, tl.load(xw_ptrs + g0 * 16 + 8), True, ASM), axis=2)
        b = xb + 2 * g0
        dot_lo = (dot_lo - 8 * tl.load(Qsum + b)).to(tl.float32) * tl.load(Xs + b)
        dot_hi = (dot_hi - 8 * tl.load(Qsum + b + 1)).to(tl.float32) * tl.load(Xs + b + 1)
        sc_lo, sc_hi, mn_lo, mn_hi, d, dm = _q4_k_chunk_scales(s_ptrs, m_ptrs, d_ptrs, dm_ptrs, g0, mask_s)
        acc += d * (sc_lo * dot_lo + sc_hi * dot_hi) + (8.0 * d * sc_lo - dm * mn_lo) * tl.load(Xsum + b) \
            + (8.0 * d * sc_hi - dm * mn_hi) * tl.load(Xsum + b + 1)
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, out.to(Out.dtype.element_ty), mask=mask_n)


@triton.jit
def _q4_k_gemv_dp4x_rows_kernel(XW, Xs, Qsum, Xsum, W32, Sc, Mn, D, Dmin, Out, Bias, M, N, K, stride_ww,
                                stride_sn, stride_dn, stride_om, HAS_BIAS: tl.constexpr, ASM: tl.constexpr,
                                BLOCK_N: tl.constexpr, NCH: tl.constexpr, ROWS: tl.constexpr,
                                PDL: tl.constexpr = 0):
    """`_q4_k_gemv_dp4x_kernel` for 2 to ROWS rows of x a program (program axis 1: rows ROWS * j ..): each step's
    weight words are read once and meet every row's words in [ROWS, BLOCK_N, NCH, 8] tiles (the weight broadcast
    over the rows, x over the weight's rows), so a batch of up to ROWS reads the packed weight once (the linears of
    an 8B Q4_K step on an H200: 2.80 ms at 2 rows, 4.01 at 4, 6.38 at 8, against 2.62 ms for this kernel at 1 row;
    the one-row kernel, whose x tiles have the weight's shape, takes 2.03 ms there, so one row keeps it)."""
    pdl_prologue(PDL)
    offs_m = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    mask_m = offs_m < M
    mr = offs_m.to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    ch = tl.arange(0, NCH)
    offs_j = tl.arange(0, 8)
    word = (ch[:, None] * 8 + offs_j[None, :])[None, None, :, :]  # [1, 1, NCH, 8]: word j of chunk g
    w_ptrs = W32 + rows[None, :, None, None] * stride_ww + word  # [1, BLOCK_N, NCH, 8]
    # x's words: the low nibbles of chunk g meet block 2g (words 16g + j), the high ones block 2g + 1 (16g + 8 + j)
    xw_ptrs = XW + mr[:, None, None, None] * (K // 4) + (ch[:, None] * 16 + offs_j[None, :])[None, None, :, :]
    xb = mr[:, None, None] * (K // 32) + 2 * ch[None, None, :]  # [ROWS, 1, NCH]: block 2g
    s_ptrs, m_ptrs, d_ptrs, dm_ptrs = _q4_k_scale_pointers(Sc, Mn, D, Dmin, rows, ch, stride_sn, stride_dn)
    mask_w = mask_n[None, :, None, None]
    mask_x = mask_m[:, None, None, None]
    mask_b = mask_m[:, None, None]
    mask_s = mask_n[:, None]
    acc = tl.zeros((ROWS, BLOCK_N, NCH), dtype=tl.float32)
    for g0 in range(0, K // 64, NCH):  # K % (64 * NCH) == 0 and NCH % 4 == 0 (the wrapper checks)
        w = tl.load(w_ptrs + g0 * 8, mask=mask_w, other=0)  # [1, BLOCK_N, NCH, 8] int32
        dot_lo = tl.sum(_dp4a_nibbles(w, tl.load(xw_ptrs + g0 * 16, mask=mask_x, other=0), False, ASM), axis=3)
        dot_hi = tl.sum(_dp4a_nibbles(w, tl.load(xw_ptrs + g0 * 16 + 8, mask=mask_x, other=0), True, ASM), axis=3)
        b = xb + 2 * g0
        dot_lo = (dot_lo - 8 * tl.load(Qsum + b, mask=mask_b, other=0)).to(tl.float32) \
            * tl.load(Xs + b, mask=mask_b, other=0.0)
        dot_hi = (dot_hi - 8 * tl.load(Qsum + b + 1, mask=mask_b, other=0)).to(tl.float32) \
            * tl.load(Xs + b + 1, mask=mask_b, other=0.0)
        sc_lo, sc_hi, mn_lo, mn_hi, d, dm = _q4_k_chunk_scales(s_ptrs, m_ptrs, d_ptrs, dm_ptrs, g0, mask_s)
        acc += (d * sc_lo)[None] * dot_lo + (d * sc_hi)[None] * dot_hi \
            + (8.0 * d * sc_lo - dm * mn_lo)[None] * tl.load(Xsum + b, mask=mask_b, other=0.0) \
            + (8.0 * d * sc_hi - dm * mn_hi)[None] * tl.load(Xsum + b + 1, mask=mask_b, other=0.0)
    out = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + mr[:, None] * stride_om + offs_n[None, :], out.to(Out.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _q4_k_gemv_mma_rows_kernel(XQ, Xs, Xsum, Wq, Sc, Mn, D, Dmin, Out, Bias, M, N, K, stride_wn, stride_sn, stride_dn,
                               stride_om, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, NCH: tl.constexpr,
                               PDL: tl.constexpr = 0):
    """Up to 16 rows of x on the integer tensor cores, every row in one program: x quantised beforehand
    (`q8_1_words`, its int8 levels read as bytes, XQ [M, K]), and per 32-weight sub-block one int8 MMA of the
    centred nibbles [BLOCK_N, 32] with x's levels [32, 16] (one column per row of x, where `_q4_k_gemv_mma2d_kernel`
    fills only the first), the sub-block's scales and x's block scales applied to the [BLOCK_N, 16] integer
    products after it: d sc x_scale dot + (8 d sc - dmin m) sum(x), as the other integer kernels. A batch of up to
    16 rows costs the tensor cores what one row does."""
    pdl_prologue(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, 16)
    mask_m = offs_m < M
    mr = offs_m.to(tl.int64)
    offs_l = tl.arange(0, 32)
    rows = offs_n.to(tl.int64)
    w_ptrs = Wq + rows[:, None] * stride_wn + offs_l[None, :]  # [BLOCK_N, 32]: chunk 0's bytes
    x_ptrs = XQ + mr[None, :] * K + offs_l[:, None]  # [32, 16]: block 0's levels, a column per row of x
    xb = mr * (K // 32)  # [16]: each row's block 0
    s_ptrs = Sc + rows * stride_sn
    m_ptrs = Mn + rows * stride_sn
    d_ptrs = D + rows * stride_dn
    dm_ptrs = Dmin + rows * stride_dn
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for g0 in range(0, K // 64, NCH):  # K % (64 * NCH) == 0 and NCH % 4 == 0 (the wrapper checks)
        for c in tl.static_range(NCH):
            g = g0 + c
            b, d, dm = _q4_k_chunk_rows(w_ptrs, d_ptrs, dm_ptrs, g, mask_n)
            for half in tl.static_range(2):  # low nibbles: block 2g (x[64g + l]); high: block 2g + 1
                blk = 2 * g + half
                q, sc, mn = _q4_k_sub_block(b, s_ptrs, m_ptrs, blk, half, mask_n)
                xq = tl.load(x_ptrs + g * 64 + 32 * half, mask=mask_m[None, :], other=0)
                dot = tl.dot(q, xq, out_dtype=tl.int32).to(tl.float32)  # [BLOCK_N, 16]
                xs = tl.load(Xs + xb + blk, mask=mask_m, other=0.0)
                xsum = tl.load(Xsum + xb + blk, mask=mask_m, other=0.0)
                acc += (d * sc)[:, None] * dot * xs[None, :] + (8.0 * d * sc - dm * mn)[:, None] * xsum[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    tl.store(Out + mr[None, :] * stride_om + offs_n[:, None], acc.to(Out.dtype.element_ty),
             mask=mask_n[:, None] & mask_m[None, :])


def q8_1_words(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [M, K] (K a multiple of 32, rows contiguous) -> (words int32 [M, K / 4], scales, level sums, float sums
    [M, K / 32]): the activations of `_q4_k_gemv_dp4x_kernel`."""
    m, k = x.shape
    words = torch.empty((m, k // 4), dtype=torch.int32, device=x.device)
    xs = torch.empty((m, k // 32), dtype=torch.float32, device=x.device)
    qsum = torch.empty((m, k // 32), dtype=torch.int32, device=x.device)
    xsum = torch.empty((m, k // 32), dtype=torch.float32, device=x.device)
    block_g = 16
    launch(_q8_1_words_kernel, (m, triton.cdiv(k // 32, block_g)), x, words, xs, qsum, xsum, k, x.stride(0),
           BLOCK_G=block_g, **(dict(num_warps=4) if x.is_cuda else {}), **pdl.launch_opts(x))
    return words, xs, qsum, xsum

