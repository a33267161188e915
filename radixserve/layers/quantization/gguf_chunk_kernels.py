"""The Q4_K one-row decode GEMV that gives each thread whole 32-byte chunks (`_q4_k_gemv_dp4c_kernel`, "dp4c" in
the GEMV table) and the quantisation of x it reads (`q8_1_blocks`): int8 levels packed in words as for the other
integer kernels of `gguf_int_kernels`, with per-block factors that fold the centring and the mins in. Dispatch and
its limits: `gguf_kernels.gguf_gemv`; x quantised in the launch of the norm or activation before the product:
`gguf_prologue`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization.gguf_int_kernels import _dp4a_nibbles, _q8_1_row_blocks
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue


@triton.jit
def _dp4a_halves(w, xlo, xhi, ASM: tl.constexpr):
    """Half-chunks of Q4_K words w [..., 4] (16 bytes: word j holds four weights' nibbles) against x's words for
    their low and high nibbles -> (the integer dot of the low nibbles, 16 times that of the high ones) [...]: with
    ASM, four chained `dp4a` per nibble half in one inline PTX block (the high nibbles masked in place, not
    shifted); under the interpreter, the same sums from the unpacked bytes."""
    if ASM:
        s = tl.inline_asm_elementwise(
            "{.reg .b32 t, a, b; "
            "and.b32 t, $4, 0x0F0F0F0F; dp4a.u32.s32 a, t, $8, 0; "
            "and.b32 t, $5, 0x0F0F0F0F; dp4a.u32.s32 a, t, $9, a; "
            "and.b32 t, $6, 0x0F0F0F0F; dp4a.u32.s32 a, t, $10, a; "
            "and.b32 t, $7, 0x0F0F0F0F; dp4a.u32.s32 a, t, $11, a; "
            "and.b32 t, $4, 0xF0F0F0F0; dp4a.u32.s32 b, t, $12, 0; "
            "and.b32 t, $5, 0xF0F0F0F0; dp4a.u32.s32 b, t, $13, b; "
            "and.b32 t, $6, 0xF0F0F0F0; dp4a.u32.s32 b, t, $14, b; "
            "and.b32 t, $7, 0xF0F0F0F0; dp4a.u32.s32 b, t, $15, b; "
            "mov.b32 $0, a; mov.b32 $1, 0; mov.b32 $2, b; mov.b32 $3, 0;}",
            "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [w, xlo, xhi], dtype=tl.int32, is_pure=True, pack=4)
        e02, _ = tl.split(tl.reshape(s, s.shape[:-1] + [2, 2]))  # the 4 words' results: [lo, 0, hi, 0]
        lo, hi = tl.split(e02)
        return lo, hi
    lo = tl.sum(_dp4a_nibbles(w, xlo, False, False), axis=-1)
    hi = tl.sum(_dp4a_nibbles(w, xhi, True, False), axis=-1) * 16
    return lo, hi


@triton.jit
def _split4(v):
    """[..., 4] -> its four [...] slices (a split of the thread's own registers, no data movement)."""
    e02, e13 = tl.split(tl.reshape(v, v.shape[:-1] + [2, 2]))
    e0, e2 = tl.split(e02)
    e1, e3 = tl.split(e13)
    return e0, e1, e2, e3


@triton.jit
def _load_rows(ptrs, mask, EVEN: tl.constexpr):
    """A load of weight rows, masked (0 past the last row) unless EVEN says every row exists."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _store_dp4c_factors(F, m, g, mask_g, xs, qsum, xsum, K):
    """Blocks g of row m: their four float32 factors for `_q4_k_gemv_dp4c_kernel` into F [M, K / 8] (see
    `_q8_1_blocks_kernel`)."""
    a = tl.where(g % 2 == 1, xs / 16.0, xs)[:, None]
    p = (8.0 * (xsum - xs * qsum.to(tl.float32)))[:, None]
    j = tl.arange(0, 4)[None, :]
    f = tl.where(j == 0, a, tl.where(j == 1, p, tl.where(j == 2, xsum[:, None], 0.0)))
    tl.store(F + m * (K // 8) + g[:, None] * 4 + j, f, mask=mask_g[:, None])


@triton.jit
def _q8_1_blocks_kernel(X, Words, F, K, stride_xm, BLOCK_G: tl.constexpr, PDL: tl.constexpr = 0):
    """x [M, K] -> the inputs of `_q4_k_gemv_dp4c_kernel`: per 32-column block its int8 levels packed 4 to a word
    (Words [M, K / 4], as `_q8_1_words_kernel`) and four float32 factors (F [M, K / 8]): the scale a (an odd
    block's divided by 16: it meets the high nibbles, whose dot products come 16 times too large), p = 8 (sum(x) -
    a sum(levels)), c = sum(x), 0 — so that a sub-block contributes d sc (a dot + p) - dmin m c, the centred
    product of the other integer kernels. One program per row and BLOCK_G blocks."""
    pdl_prologue(PDL)
    m, g, mask_g, xs, qsum, xsum = _q8_1_row_blocks(X, Words, K, stride_xm, BLOCK_G)
    _store_dp4c_factors(F, m, g, mask_g, xs, qsum, xsum, K)


@triton.jit
def _dp4c_row_sums(XW, F, W32, Sc16, Mn16, D, Dmin, m, rows, mask_n, K, stride_fm, stride_ww, stride_s16, stride_dn,
                   ASM: tl.constexpr, BLOCK_N: tl.constexpr, NCH: tl.constexpr, EVEN_N: tl.constexpr):
    """The float32 products of row m of x with weight rows `rows` [BLOCK_N] (int64; mask_n: those that exist), the
    loop of `_q4_k_gemv_dp4c_kernel` (see there)."""
    h = tl.arange(0, 2)[:, None, None, None]
    c = tl.arange(0, NCH)
    j = tl.arange(0, 4)
    cj = c[:, None] * 8 + j[None, :]  # [NCH, 4]
    w_ptrs = W32 + rows[None, :, None, None] * stride_ww + h * 4 + cj[None, None, :, :]
    x_ptrs = XW + m * (K // 4) + h * 4 + (c[:, None] * 16 + j[None, :])[None, None, :, :]  # [2, 1, NCH, 4]
    # [1, NCH, 4]: block 2c's a, p, c, 0; + 4: block 2c + 1's (stride_fm: F's row stride, whose divisibility by 16
    # the compiler sees, so that these are 16-byte loads in the words' layout)
    f_ptrs = F + m * stride_fm + cj[None, :, :]
    # the chunk index through a division the compiler cannot see through: the scale loads stay one per element,
    # in the layout the dots come out in (contiguous 16-bit loads would be vectorised into another layout)
    c_opaque = (c * K) // K
    s_ptrs = Sc16 + rows[:, None] * stride_s16 + c_opaque[None, :]  # [BLOCK_N, NCH]: sub-blocks 2c, 2c + 1
    m_ptrs = Mn16 + rows[:, None] * stride_s16 + c_opaque[None, :]
    d_ptrs = D + rows[:, None] * stride_dn + c_opaque[None, :] // 4
    dm_ptrs = Dmin + rows[:, None] * stride_dn + c_opaque[None, :] // 4
    mask_w = mask_n[None, :, None, None]
    mask_s = mask_n[:, None]
    acc = tl.zeros((BLOCK_N, NCH), dtype=tl.float32)
    for g0 in range(0, K // 64, NCH):  # K % (64 * NCH) == 0 (the wrapper checks)
        w = _load_rows(w_ptrs + g0 * 8, mask_w, EVEN_N)  # [2, BLOCK_N, NCH, 4] int32
        xlo = tl.broadcast_to(tl.load(x_ptrs + g0 * 16), w.shape)
        xhi = tl.broadcast_to(tl.load(x_ptrs + g0 * 16 + 8), w.shape)
        a_lo, p_lo, c_lo, _ = _split4(tl.load(f_ptrs + g0 * 8))
        a_hi, p_hi, c_hi, _ = _split4(tl.load(f_ptrs + g0 * 8 + 4))
        sc = _load_rows(s_ptrs + g0, mask_s, EVEN_N).to(tl.int32)
        mn = _load_rows(m_ptrs + g0, mask_s, EVEN_N).to(tl.int32)
        d = _load_rows(d_ptrs + g0 // 4, mask_s, EVEN_N).to(tl.float32)
        dm = _load_rows(dm_ptrs + g0 // 4, mask_s, EVEN_N).to(tl.float32)
        lo, hi = _dp4a_halves(w, xlo, xhi, ASM)
        t_lo = tl.sum(lo, axis=0).to(tl.float32) * a_lo + p_lo  # [BLOCK_N, NCH]
        t_hi = tl.sum(hi, axis=0).to(tl.float32) * a_hi + p_hi
        acc += d * ((sc & 0xFF).to(tl.float32) * t_lo + ((sc >> 8) & 0xFF).to(tl.float32) * t_hi) \
            - dm * ((mn & 0xFF).to(tl.float32) * c_lo + ((mn >> 8) & 0xFF).to(tl.float32) * c_hi)
    return tl.sum(acc, axis=1)


@triton.jit
def _q4_k_gemv_dp4c_kernel(XW, F, W32, Sc16, Mn16, D, Dmin, Out, Bias, N, K, stride_fm, stride_ww, stride_s16,
                           stride_dn, stride_om, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                           NCH: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr = 0):
    """One row of x (program axis 1) times BLOCK_N Q4_K rows with integer products, laid out so that a thread holds
    whole 32-byte chunks: each step reads NCH chunks of every row as [2 (half), BLOCK_N, NCH, 4] word tiles (half h,
    word j of chunk c: weights 64c + 16h + 4j.. in its low nibbles, 64c + 32 + 16h + 4j.. in its high ones), so
    that with NCH >= the program's threads a chunk's two 16-byte halves and the rows are the thread's own
    registers. Its 8 words take 16 chained `dp4a` (`_dp4a_halves`), the halves' integer dots are added in the
    thread, and the chunk's scales (sub-blocks 2c / 2c + 1 as one 16-bit load each, d / dmin) and x's per-block
    factors (`q8_1_blocks`: 16-byte loads shared by the rows) meet them in the same register layout: a chunk
    contributes d (sc_lo (a_lo lo + p_lo) + sc_hi (a_hi hi + p_hi)) - dmin (m_lo c_lo + m_hi c_hi), with no data
    exchanged between threads inside the loop (where `_q4_k_gemv_dp4x_kernel` converts layouts through shared
    memory, and spends ~3x the instructions a byte). EVEN_N: N is a multiple of BLOCK_N, the loads need no masks."""
    pdl_prologue(PDL)
    m = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    out = _dp4c_row_sums(XW, F, W32, Sc16, Mn16, D, Dmin, m, rows, mask_n, K, stride_fm, stride_ww, stride_s16,
                         stride_dn, ASM, BLOCK_N, NCH, EVEN_N)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs_n, out.to(Out.dtype.element_ty), mask=mask_n)


def q8_1_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 64, rows contiguous) -> (words int32 [M, K / 4], factors float32 [M, K / 8]): the
    activations of `_q4_k_gemv_dp4c_kernel`."""
    m, k = x.shape
    words = torch.empty((m, k // 4), dtype=torch.int32, device=x.device)
    f = torch.empty((m, k // 8), dtype=torch.float32, device=x.device)
    block_g = 16
    launch(_q8_1_blocks_kernel, (m, triton.cdiv(k // 32, block_g)), x, words, f, k, x.stride(0), BLOCK_G=block_g,
           **(dict(num_warps=4) if x.is_cuda else {}), **pdl.launch_opts(x))
    return words, f
